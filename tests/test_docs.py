"""The documentation checked as a whole (README.md, docs/**/*.md):

- every shell block's commands parse against the real commands (dit-* through their click parsers, make targets
  against the Makefile, bench scripts against their flags); other programs are the exceptions listed below;
- the blocks that run at tiny sizes, and the tests that run them (EXECUTED);
- every relative link and #anchor between the pages resolves, and every page is reachable from the README;
- the command-line reference (docs/cli/) is what `python -m dit_pipeline.cli_docs` generates;
- the README stays a landing page, and each guide opens with a command.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import click
import pytest

from tests import _docs
from tests._util import REPO

REGENERATE = ".venv/bin/python -m dit_pipeline.cli_docs   (or: make cli-docs)"

# The blocks that run as written (with tiny sizes substituted): page -> {a line of the block: the test that runs it}.
EXECUTED = {
    "README.md": {
        "dit-extract --data-path imagenet/train --out shards/ --vae stabilityai/sd-vae-ft-ema":
            "tests.test_readme::test_quickstart_commands_run_as_pasted",
        "dit-train --nproc-per-node 8 --shards shards/in1k-256 --model DiT-XL/2 \\":
            "tests.test_readme::test_eight_gpu_training_commands_pass_every_check",
    },
    "docs/python-api.md": {"from dit_pipeline import dit": "tests.test_readme::test_python_api_snippet_runs"},
    "docs/FORMAT.md": {"import numpy as np, webdataset as wds": "tests.test_readme::test_format_reading_snippet_runs"},
    "docs/evaluation.md": {
        "# 3. the metrics (printed, and written to samples/dit-xl2-256-cfg1.5.npz.eval.json)":
            "tests.test_readme::test_fid_recipe_runs_as_pasted",
        "dit-eval samples/trial.npz --ref samples/trial.npz --random-inception 0 --input-size 75 --no-cache":
            "tests.evaluate.test_run::test_the_readme_trial_without_weights_runs_offline",
    },
    "docs/vaes.md": {"dit-shards stats shards/in1k-256-vavae --write per-channel":
                     "tests.test_readme::test_other_vaes_disk_table_and_training_lines"},
    "docs/clusters.md": {"trap signal_ranks USR1": "tests.test_readme_slurm::test_usr1_reaches_only_this_jobs_ranks_"
                                                   "and_the_script_exits_with_sruns_status"},
    "docs/repa.md": {"--sampler euler-maruyama --steps 250 --cfg-scale 1.8 --cfg-channels all":
                     "tests.sample.test_repa_sample::test_dit_sample_with_the_readme_repa_flags"},
}

# Shell blocks that are scripts rather than lists of commands: their own lines (functions, traps, loops) are shell
# syntax that the test named in EXECUTED runs; only their dit-* lines are parsed here.
SCRIPTS = {("docs/clusters.md", "#!/bin/bash")}

# Programs other than ours that the docs' shell blocks run, and why they are not checked here.
OTHER_PROGRAMS = {
    "huggingface-cli": "downloads a VAE from the hub (no network in the tests)",
    "awk": "repeats a prompts file's lines; plain POSIX awk",
    "python -m pytest": "the project's own tests, run against a NanoGen checkout only a developer has",
}

_COMMANDS = {"dit-extract": "extract_main", "dit-train": "train_main", "dit-shards": "shards_main",
             "dit-sample": "sample_main", "dit-eval": "eval_main", "dit-report": "report_main"}


def _shell_blocks():
    return [b for p in _docs.pages() for b in _docs.blocks(p) if b.lang in _docs.SHELL]


def _make_targets() -> set[str]:
    return set(re.findall(r"^([\w-]+):", (REPO / "Makefile").read_text(), re.M))


def _parse(name: str, args: list[str], where: str, tmp_path: Path) -> None:
    """`name args` through its click parser (no callback runs); the folders it names are created first, since the
    parser checks that a shard folder exists."""
    from dit_pipeline import cli

    for a in args:
        if a.startswith(("shards/", "/shared/shards/")):
            (tmp_path / a.lstrip("/")).mkdir(parents=True, exist_ok=True)
    args = [a[1:] if a.startswith("/shared/") else a for a in args]
    cmd = getattr(cli, _COMMANDS[name])
    try:
        if isinstance(cmd, click.Group):
            default = getattr(cmd, "default_command", None)
            sub, rest = (args[0], args[1:]) if args and args[0] in cmd.commands else (default, args)
            assert sub is not None, f"{where}: `{name} {' '.join(args)}` names no subcommand"
            cmd.commands[sub].make_context(f"{name} {sub}", list(rest))
        else:
            cmd.make_context(name, list(args))
    except click.exceptions.Exit:  # --help, --version
        pass
    except click.ClickException as e:
        pytest.fail(f"{where}: `{name} {' '.join(args)}` does not parse: {e.format_message()}")


def test_every_shell_command_parses(tmp_path, monkeypatch):
    """Each command line of every shell block, as written: a dit-* command is accepted by its parser (no unknown or
    misspelt flag, no missing required option, no invalid choice); a `make` target exists; a bench script exists
    (bench/ or scripts/) and takes the flags given; anything else is a program listed in OTHER_PROGRAMS, or a line of a listed script."""
    monkeypatch.chdir(tmp_path)
    targets = _make_targets()
    seen, problems = set(), []
    for b in _shell_blocks():
        script = any(b.page == page and b.body.startswith(first) for page, first in SCRIPTS)
        for words in _docs._script_safe_lines(b):
            found = _docs.invocation(words)
            if found:
                _parse(*found, b.where, tmp_path)
                seen.add(found[0])
                continue
            at = next((i for i, w in enumerate(words) if "=" not in w), 0)  # after VAR=value words
            program, args = words[at], words[at + 1:]
            if program == "make":
                missing = [w for w in args if not w.startswith("-") and "=" not in w and w not in targets]
                if missing:
                    problems.append(f"{b.where}: make has no target {missing}")
            elif program.startswith("python") and args and args[0].startswith(("bench/", "scripts/")):
                script_path = REPO / args[0]
                source = script_path.read_text() if script_path.is_file() else ""
                unknown = [w for w in args if w.startswith("--") and f'"{w}"' not in source]
                if not source or unknown:
                    problems.append(f"{b.where}: {script_path.name} missing or without {unknown}")
            elif not script and not {program, " ".join([program, *args[:2]])} & set(OTHER_PROGRAMS):
                problems.append(f"{b.where}: `{' '.join(words)}`: a command that is neither ours nor listed in "
                                "OTHER_PROGRAMS (say why it cannot be checked there)")
    assert problems == []
    assert seen == set(_COMMANDS), f"no shell block runs {set(_COMMANDS) - seen}"


def test_code_blocks_are_shell_or_executed():
    """A Python block runs in a test listed in EXECUTED; a block without a language holds no command."""
    executed = {(page, line) for page, lines in EXECUTED.items() for line in lines}
    for p in _docs.pages():
        for b in _docs.blocks(p):
            if b.lang == "python":
                assert any(b.page == page and line in b.body for page, line in executed), \
                    f"{b.where}: a Python block no test runs (add its test to EXECUTED)"
            elif b.lang in ("", "text"):
                assert not any(re.match(r"\s*(torchrun|srun|dit-[a-z]+ )", ln) for ln in b.body.splitlines()), \
                    f"{b.where}: commands in a block without a shell language are never checked: mark it bash"


def test_executed_blocks_exist_and_so_do_their_tests():
    """EXECUTED names blocks that are on their pages and tests that exist (a renamed test or a moved block fails
    here, not silently)."""
    for page, lines in EXECUTED.items():
        bodies = [b.body for b in _docs.blocks(page)]
        for line, test in lines.items():
            assert any(line in body for body in bodies), f"{page}: no block holds {line!r}"
            module, func = test.split("::")
            assert hasattr(importlib.import_module(module), func), f"{test} does not exist"


def test_links_and_anchors_resolve():
    """Every relative link of README.md and docs/ names a file of the repository, and its #anchor a heading (or an
    explicit id) of that page, as GitHub renders them."""
    bad = []
    for page in _docs.pages():
        for target, label in _docs.links(page):
            if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists() or REPO not in dest.parents:
                bad.append(f"{_docs.rel(page)}: [{label}]({target}): no such file")
            elif anchor and (dest.suffix != ".md" or anchor not in _docs.anchors(dest)):
                bad.append(f"{_docs.rel(page)}: [{label}]({target}): no heading with that anchor")
    assert bad == []


def test_every_page_is_reachable_from_the_readme():
    """Each page under docs/ is linked from README.md or from a page linked from it (a new guide must be linked
    where a reader finds it: README.md's tables or "Where to go next")."""
    reached, todo = set(), [REPO / "README.md"]
    while todo:
        page = todo.pop()
        if page in reached:
            continue
        reached.add(page)
        for target, _ in _docs.links(page):
            path = target.partition("#")[0]
            if path.endswith(".md") and not re.match(r"[a-z]+:", path):
                dest = (page.parent / path).resolve()
                if dest.is_file():
                    todo.append(dest)
    orphans = [_docs.rel(p) for p in _docs.pages() if p not in reached]
    assert orphans == [], f"pages no link from README.md leads to: {orphans}"


def test_cli_reference_is_current():
    """docs/cli/ holds exactly what the generator renders from the click commands today."""
    from dit_pipeline import cli_docs

    stale = cli_docs.stale(REPO / "docs" / "cli")
    assert stale == [], f"docs/cli/ is stale ({', '.join(stale)}): regenerate it with {REGENERATE}"


def test_cli_reference_lists_every_option():
    """Two clicks to any option: the README's command table links each command's page, and the page names every
    visible option of the command and of its subcommands."""
    from dit_pipeline import cli

    readme = _docs.text("README.md")
    for name, main in _COMMANDS.items():
        assert f"(docs/cli/{name}.md)" in readme, f"README.md's command table does not link docs/cli/{name}.md"
        page = _docs.text(f"docs/cli/{name}.md")
        cmd = getattr(cli, main)
        subs = cmd.commands.values() if isinstance(cmd, click.Group) else [cmd]
        for sub in subs:
            for p in sub.params:
                if isinstance(p, click.Option) and not p.hidden:
                    assert f"`{', '.join(p.opts)}" in page, f"docs/cli/{name}.md lacks {p.opts}"


def test_cli_reference_is_independent_of_the_terminal_and_folder(monkeypatch, tmp_path):
    """The pages do not depend on where or how they are generated (terminal width, current folder)."""
    from dit_pipeline import cli_docs

    want = cli_docs.pages()
    monkeypatch.setenv("COLUMNS", "37")
    monkeypatch.chdir(tmp_path)
    assert cli_docs.pages() == want


def test_readme_is_a_landing_page():
    """At most about 300 lines, the set-up's two commands in a shell block, the six commands in its table."""
    readme = _docs.text("README.md")
    assert len(readme.splitlines()) <= 300
    setup = _docs.block_after("README.md", "## Set-up")
    assert [w[:2] for w in _docs.command_lines(setup)] == [["make", "demo"], ["make", "test"]]
    assert "## Where to go next" in readme


def test_guides_open_with_a_command():
    """Each task guide (docs/*.md but the reference pages) has a shell or Python block before its first section."""
    reference = {"docs/ARCHITECTURE.md", "docs/FORMAT.md", "docs/RELIABILITY.md", "docs/REFERENCE.md"}
    for page in sorted((REPO / "docs").glob("*.md")):
        if f"docs/{page.name}" in reference:
            continue
        body = page.read_text(encoding="utf-8")
        first = _docs.blocks(page)[0] if _docs.blocks(page) else None
        heading = re.search(r"^## ", body, re.M)
        assert first is not None and first.lang in (*_docs.SHELL, "python"), f"{page.name}: no command block"
        assert heading is None or body.index("```") < heading.start(), f"{page.name}: no command before its sections"


def test_demo_paths_match_the_docs():
    """What the README and docs/install.md say `make demo` writes is where examples/demo.py writes it: the default
    folder demo-out/ (which `make clean` removes), its sub-folders by name, the report in the run folder and the
    grid in the samples folder."""
    demo = (REPO / "examples" / "demo.py").read_text()
    make = (REPO / "Makefile").read_text()
    assert 'default="demo-out"' in demo
    assert re.search(r"^demo:.*\n\t.*examples/demo\.py", make, re.M) and re.search(r"^clean:\n\t.*demo-out", make, re.M)
    m = re.search(r"images, vae, shards, run_dir, samples = \(out / n for n in \(([^)]*)\)\)", demo)
    assert m, "examples/demo.py names its folders otherwise: update this test and the docs"
    folders = dict(zip(("images", "vae", "shards", "run_dir", "samples"), re.findall(r'"(\w+)"', m.group(1))))
    assert '["dit-report", run_dir]' in demo and '"--out", samples' in demo  # report.md in run/, grid.png in samples/
    for page in ("README.md", "docs/install.md"):
        body = _docs.text(page)
        assert "demo-out/" in body
        for path in re.findall(r"demo-out/([\w.-]+)/", body):
            assert path in folders.values(), f"{page}: demo-out/{path}/ is not a folder examples/demo.py makes"
    assert "demo-out/run/report.md" in _docs.text("docs/install.md") and folders["run_dir"] == "run"


def test_cli_docs_check_names_stale_pages_and_the_fix(tmp_path, capsys):
    """`python -m dit_pipeline.cli_docs --check` exits 1 naming each stale, missing or left-over page and the
    command that regenerates them; writing them makes the check pass."""
    from dit_pipeline import cli_docs

    assert cli_docs.main(["--out", str(tmp_path)]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{c}.md" for c in cli_docs.COMMANDS)
    assert cli_docs.main(["--check", "--out", str(tmp_path)]) == 0
    (tmp_path / "dit-train.md").write_text("edited by hand\n")
    (tmp_path / "dit-report.md").unlink()
    (tmp_path / "old-command.md").write_text("left over\n")
    capsys.readouterr()
    assert cli_docs.main(["--check", "--out", str(tmp_path)]) == 1
    assert capsys.readouterr().out.splitlines() == [
        f"stale: {tmp_path / 'dit-report.md'}", f"stale: {tmp_path / 'dit-train.md'}",
        f"stale: {tmp_path / 'old-command.md'}", "regenerate with: python -m dit_pipeline.cli_docs"]
    assert cli_docs.main(["--out", str(tmp_path)]) == 0 and cli_docs.stale(tmp_path) == []
