"""The documentation as the tests read it: README.md and the pages under docs/, their fenced blocks, their links and
headings, and the dit-* commands in their shell blocks."""
from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from tests._util import REPO

SHELL = ("bash", "sh", "shell", "console")
_FENCE = re.compile(r"^```([\w+-]*)[^\n]*\n(.*?)^```[ \t]*$", re.S | re.M)
COMMAND = re.compile(r"dit-(extract|train|shards|sample|eval|report)")
# where a shell line's command ends and the shell's syntax begins
_SHELL_SYNTAX = {">", ">>", "<", "|", "||", "&&", ";", "&", "2>", "2>&1"}


def pages() -> list[Path]:
    """README.md and every Markdown page under docs/ (the generated reference included), as paths."""
    return [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]


def rel(page: Path) -> str:
    return page.relative_to(REPO).as_posix()


def text(page: str | Path) -> str:
    return (REPO / page).read_text(encoding="utf-8")


@dataclass(frozen=True)
class Block:
    page: str   # relative to the repository
    line: int   # of the opening fence, 1-based
    lang: str
    body: str

    @property
    def where(self) -> str:
        return f"{self.page}:{self.line}"


def blocks(page: str | Path) -> list[Block]:
    """The fenced code blocks of a page, in order."""
    body = text(page)
    name = page if isinstance(page, str) else rel(page)
    return [Block(name, body.count("\n", 0, m.start()) + 1, m.group(1), m.group(2)) for m in _FENCE.finditer(body)]


def section(page: str | Path, heading: str, end: str | None = None) -> str:
    """The text of `page` from `heading` (any line starting with it) to the next heading of the same or a higher
    level (or to `end`)."""
    body = text(page)
    start = body.index(heading)
    rest = body[start + len(heading):]
    if end is not None:
        return body[start:start + len(heading) + rest.index(end)]
    level = len(heading) - len(heading.lstrip("#")) if heading.startswith("#") else 7
    m = re.search(rf"^#{{1,{level}}} ", rest, re.M)
    return body[start:start + len(heading) + (m.start() if m else len(rest))]


def block_after(page: str | Path, heading: str, lang: str = "bash") -> str:
    """The first ```lang block after `heading` on `page`."""
    body = text(page)
    m = re.compile(rf"^```{lang}\n(.*?)^```", re.S | re.M).search(body, body.index(heading))
    assert m, f"{page}: no ```{lang} block after {heading!r}"
    return m.group(1)


def command_lines(block: str) -> list[list[str]]:
    """A shell block's commands as words: continuations joined, comments dropped, `$(which dit-X)` as `dit-X`'s
    path word kept as written (`$(which`, `dit-X)`), shell syntax after a command (redirections, pipes) cut."""
    out = []
    for line in block.replace("\\\n", " ").splitlines():
        words = shlex.split(line, comments=True)
        cut = next((i for i, w in enumerate(words) if w in _SHELL_SYNTAX or w.startswith((">", "2>"))), len(words))
        if words[:cut]:
            out.append(words[:cut])
    return out


def invocation(words: list[str]) -> tuple[str, list[str]] | None:
    """The dit-* command a line runs and its arguments: directly, after `VAR=value` words, after `srun`, or after
    `torchrun ... $(which dit-X)`; None for a line that runs none."""
    for i, w in enumerate(words):
        name = w[:-1] if i and words[i - 1] == "$(which" and w.endswith(")") else w
        if COMMAND.fullmatch(name):
            return name, words[i + 1:]
    return None


def invocations(page: str | Path | None = None) -> list[tuple[str, list[str], str]]:
    """Every dit-* command in the shell blocks of one page (or of all pages): (command, arguments, where)."""
    out = []
    for p in ([page] if page is not None else pages()):
        for b in blocks(p):
            if b.lang not in SHELL:
                continue
            for words in _script_safe_lines(b):
                found = invocation(words)
                if found:
                    out.append((*found, b.where))
    return out


def _script_safe_lines(b: Block) -> list[list[str]]:
    """The command lines of a block; a script's lines that shlex cannot split (quoted shell fragments) skipped."""
    lines = []
    for line in b.body.replace("\\\n", " ").splitlines():
        try:
            lines += command_lines(line)
        except ValueError:
            continue
    return lines


def slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but `-` and `_` dropped, spaces as dashes."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(page: str | Path) -> set[str]:
    """The anchors a page has: its headings' slugs (GitHub numbers repeats -1, -2, ...) and explicit ids."""
    body = _FENCE.sub("", text(page))
    seen: dict[str, int] = {}
    out = set()
    for m in re.finditer(r"^#{1,6} +(.+?) *#*$", body, re.M):
        s = slug(m.group(1))
        n = seen.get(s, 0)
        out.add(s if n == 0 else f"{s}-{n}")
        seen[s] = n + 1
    out |= set(re.findall(r"<a (?:id|name)=\"([^\"]+)\"", body))
    return out


def links(page: str | Path) -> list[tuple[str, str]]:
    """The Markdown links of a page outside code: (target, the link's text)."""
    body = _without_code(text(page))
    return [(m.group(2), m.group(1)) for m in re.finditer(r"\[([^\]]*)\]\(([^)\s]+)\)", body)]


def _without_code(body: str) -> str:
    body = _FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), body)
    return re.sub(r"`[^`\n]*`", "``", body)
