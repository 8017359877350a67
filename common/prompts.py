"""Prompt files: what `dit-sample --prompts FILE` and `dit-eval --prompts FILE` read and `dit-eval --make-ref
--captions` writes (the prompts of a captioned reference set, in the order of its images).

A prompt file is one of
- JSON Lines (`.jsonl`): one object per line with at least `"prompt"` (a string); other keys travel with it,
  e.g. GenEval's metadata (`"tag"`, `"include"`, `"exclude"`: its `evaluation_metadata.jsonl` is such a file);
- JSON (`.json`): a list of such objects or of strings, or an object keyed by prompt whose values are objects
  (NanoGen's GenEval `metadata.json`: `{"a photo of a bench": {"tag": ..., "include": ..., "prompt": ...}}`);
- anything else: plain text, one prompt per line (blank lines are skipped, surrounding whitespace kept out).
Every record comes back as a dict with a non-empty `"prompt"`; a problem is a `UserError` naming the file and
the line (or entry).
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from dit_pipeline.common.errors import UserError
from dit_pipeline.common.io import atomic_write

PromptRecord = dict[str, Any]


def prompt_record(obj: Any, where: str) -> PromptRecord:
    """A record (dict with a non-empty "prompt") from a record or a bare string; UserError naming `where`."""
    if isinstance(obj, str):
        obj = {"prompt": obj}
    if not isinstance(obj, dict):
        raise UserError(f"{where}: expected an object with \"prompt\" or a string, got {type(obj).__name__}")
    prompt = obj.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise UserError(f"{where}: no \"prompt\" string (keys: {', '.join(sorted(obj)) or 'none'}); every record "
                        "needs its prompt")
    return dict(obj)


def read_prompts(path: str | Path, flag: str = "--prompts") -> list[PromptRecord]:
    """The records of a prompt file (see the module docstring), in file order; at least one."""
    p = Path(path).expanduser()
    try:
        text = p.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise UserError(f"{flag} {p}: cannot read it ({getattr(e, 'strerror', None) or e})") from None
    if p.suffix.lower() == ".jsonl":
        records = []
        for n, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise UserError(f"{flag} {p} line {n}: not JSON ({e}); a .jsonl file holds one object per line") \
                    from None
            records.append(prompt_record(obj, f"{flag} {p} line {n}"))
    elif p.suffix.lower() == ".json":
        try:
            data = json.loads(text)
        except ValueError as e:
            raise UserError(f"{flag} {p}: not JSON ({e})") from None
        if isinstance(data, dict):  # keyed by prompt (NanoGen's GenEval metadata.json)
            records = [prompt_record({"prompt": k, **v} if isinstance(v, dict) else v, f"{flag} {p} entry {k!r}")
                       for k, v in data.items()]
        elif isinstance(data, list):
            records = [prompt_record(v, f"{flag} {p} entry {i}") for i, v in enumerate(data)]
        else:
            raise UserError(f"{flag} {p}: a .json prompt file is a list of records or an object keyed by prompt")
    else:
        records = [{"prompt": line.strip()} for line in text.splitlines() if line.strip()]
    if not records:
        raise UserError(f"{flag} {p} holds no prompts")
    return records


def write_prompts(path: str | Path, records: Iterable[PromptRecord]) -> Path:
    """Write records as JSON Lines, atomically (what `read_prompts` reads back unchanged)."""
    out = Path(path)
    with atomic_write(out) as f:
        for r in records:
            f.write((json.dumps(r, ensure_ascii=False) + "\n").encode("utf-8"))
    return out
