"""NanoGen's training configs as facts: every file of configs/stage2/training in a NanoGen checkout (End2End-Diffusion/
diffusion-bench), its values merged over the defaults of src/configs/*.py, written to tests/data/nanogen_training.json,
which tests/train/test_nanogen_recipes.py compares with recipes/nanogen/ (CI has no NanoGen checkout; with one named
by NANOGEN_REPO the test runs this script again and compares, so a new or changed NanoGen config fails it).

    python scripts/nanogen_configs.py --repo PATH [--out tests/data/nanogen_training.json] [--check]

PATH: a NanoGen checkout, or a bare git repository of it (read at HEAD). Only values are read: the YAML files, and
the dataclass defaults and the tokenizer table of NanoGen's Python files through `ast` (never run). For each config:

- `values`: the config flattened to dotted keys ("training.optimizer.lr"), each value the YAML's or, where the YAML
  does not set it, the default of the field's dataclass in src/configs/shared.py and src/configs/stage2.py; then the
  rules of `Stage2Config.post_process` (src/configs/stage2.py): a dataset condition type sets the conditioning type,
  a text model's `num_c_tokens` is its text encoder's `max_length`, and a MeanFlow transport disables the guidance.
  The `eval` section (what is evaluated during training) is left out.
- `tokenizer`: what its stage-1 class loads (src/stage1/vae.py `VAE_CONFIGS`: the hub id and subfolder of a VAE
  type; the class's own `vae_type` where the YAML gives none; `sample_mode`, the YAML's or the class's default:
  "mode" encodes the posterior's mean, "sample" a draw), or the RAE encoder name, or "pixels".
- `sampling`: its sampling configs (configs/stage2/sampling/<task>/<name>*.yaml): guidance scale and interval, steps,
  and the evaluation shift base.
"""
from __future__ import annotations

import argparse
import ast
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

TRAINING = "configs/stage2/training"
SAMPLING = "configs/stage2/sampling"
DEFAULT_FILES = ("src/configs/shared.py", "src/configs/stage2.py")
STAGE1_VAE = "src/stage1/vae.py"
ROOT_CLASS = "Stage2Config"
SKIPPED_SECTIONS = ("eval",)
SAMPLING_KEYS = ("guidance.cfg.scale", "guidance.cfg.t_min", "guidance.cfg.t_max", "sampler.num_steps",
                 "misc.time_dist_shift_base_eval")


class Repo:
    """Files of a NanoGen checkout (a folder) or of a bare git repository at HEAD."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        self.bare = not (self.path / "configs").is_dir()
        if self.bare and not (self.path / "HEAD").is_file():
            raise SystemExit(f"--repo {self.path}: neither a NanoGen checkout (no configs/) nor a git repository")

    def _git(self, *args: str) -> str:
        return subprocess.run(["git", "--git-dir", str(self.path), *args], check=True, capture_output=True,
                              text=True).stdout

    def files(self, folder: str) -> list[str]:
        if self.bare:
            return sorted(self._git("ls-tree", "-r", "--name-only", "HEAD", folder).split())
        return sorted(p.relative_to(self.path).as_posix() for p in (self.path / folder).rglob("*") if p.is_file())

    def read(self, name: str) -> str:
        return self._git("show", f"HEAD:{name}") if self.bare else (self.path / name).read_text(encoding="utf-8")

    def commit(self) -> str | None:
        try:
            return (self._git("rev-parse", "HEAD") if self.bare else subprocess.run(
                ["git", "-C", str(self.path), "rev-parse", "HEAD"], check=True, capture_output=True,
                text=True).stdout).strip()
        except (subprocess.CalledProcessError, FileNotFoundError):
            return None


# ---------------------------------------------------------------------------------------------------------------
# The dataclass defaults of src/configs, read with ast

def _literal(node: ast.AST | None) -> Any:
    if node is None:
        return None
    if isinstance(node, ast.Name) and node.id == "MISSING":
        return None
    return ast.literal_eval(node)


def dataclass_fields(sources: list[str]) -> dict[str, dict[str, tuple[str | None, Any]]]:
    """{class: {field: (nested class or None, default)}} of the dataclasses in `sources`; a field whose annotation
    names another of these classes is nested (its default: that class's defaults, or None when it defaults to None)."""
    classes: dict[str, list[ast.AnnAssign]] = {}
    for text in sources:
        for node in ast.parse(text).body:
            if isinstance(node, ast.ClassDef):
                classes[node.name] = [s for s in node.body if isinstance(s, ast.AnnAssign)
                                      and isinstance(s.target, ast.Name)]
    out: dict[str, dict[str, tuple[str | None, Any]]] = {}
    for name, fields in classes.items():
        table: dict[str, tuple[str | None, Any]] = {}
        for f in fields:
            assert isinstance(f.target, ast.Name)
            words = {n.id for n in ast.walk(f.annotation) if isinstance(n, ast.Name)}
            nested = next((w for w in words if w in classes), None)
            value = f.value
            if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "field":
                kw = {k.arg: k.value for k in value.keywords}
                if "default_factory" in kw:
                    factory = kw["default_factory"]
                    if isinstance(factory, ast.Name) and factory.id in classes:
                        table[f.target.id] = (factory.id, "factory")
                        continue
                    if isinstance(factory, ast.Name):  # list, dict
                        table[f.target.id] = (None, {"list": [], "dict": {}}[factory.id])
                        continue
                    assert isinstance(factory, ast.Lambda)
                    table[f.target.id] = (None, _literal(factory.body))
                    continue
                value = kw.get("default")
            table[f.target.id] = (nested, _literal(value))
        out[name] = table
    return out


def resolve(classes: dict, cls: str, given: Any) -> dict[str, Any]:
    """The YAML mapping `given` over the defaults of dataclass `cls` (nested sections resolved the same way; keys
    the YAML sets that the dataclass lacks kept as they are)."""
    given = dict(given or {})
    out: dict[str, Any] = {}
    for name, (nested, default) in classes[cls].items():
        if nested is not None and (name in given or default == "factory"):
            sub = given.pop(name, None)
            out[name] = None if (sub is None and default != "factory") else resolve(classes, nested, sub)
        else:
            out[name] = given.pop(name, None if default == "factory" else default)
    out.update(given)
    return out


def post_process(cfg: dict[str, Any]) -> None:
    """Stage2Config.post_process (src/configs/stage2.py)."""
    if cfg["transport"].get("meanflow") is not None:
        cfg["guidance"]["disabled"] = True
    if cfg["conditioning"]["type"] == "label" and cfg["dataset"].get("condition_type") is not None:
        cfg["conditioning"]["type"] = cfg["dataset"]["condition_type"]
    if cfg["conditioning"]["type"] == "text":
        cfg["conditioning"]["arch"]["num_c_tokens"] = cfg["conditioning"]["text_encoder"]["max_length"]


def flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = list(v) if isinstance(v, tuple) else v
    return out


# ---------------------------------------------------------------------------------------------------------------
# What the stage-1 class loads (src/stage1/vae.py), read with ast

def vae_table(text: str) -> tuple[dict[str, dict[str, Any]], dict[str, str], dict[str, str]]:
    """({vae_type: {pretrained_path, subfolder, latent_channels, downsample_factor, ...}}, {class: its own
    vae_type}, {class: its default sample_mode}) of src/stage1/vae.py."""
    tree = ast.parse(text)
    table: dict[str, dict[str, Any]] = {}
    own: dict[str, str] = {}
    modes: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, (ast.Assign, ast.AnnAssign)):
            target = node.targets[0] if isinstance(node, ast.Assign) else node.target
            if isinstance(target, ast.Name) and target.id == "VAE_CONFIGS" and isinstance(node.value, ast.Dict):
                for k, v in zip(node.value.keys, node.value.values):
                    assert isinstance(v, ast.Call)
                    table[_literal(k)] = {kw.arg: _literal(kw.value) for kw in v.keywords}
        if isinstance(node, ast.ClassDef):  # Flux2VAE: super().__init__(vae_type="flux2"); QwenVAE: its default
            for sub in ast.walk(node):
                if isinstance(sub, ast.Call):
                    for kw in sub.keywords:
                        if kw.arg == "vae_type" and isinstance(kw.value, ast.Constant):
                            own.setdefault(node.name, kw.value.value)
                if isinstance(sub, ast.FunctionDef) and sub.name == "__init__":
                    args = sub.args.args[-len(sub.args.defaults):] if sub.args.defaults else []
                    for a, d in zip(args, sub.args.defaults):
                        if a.arg == "vae_type" and isinstance(d, ast.Constant):
                            own.setdefault(node.name, d.value)
                        if a.arg == "sample_mode" and isinstance(d, ast.Constant):
                            modes.setdefault(node.name, d.value)
    return table, own, modes


def tokenizer(stage1: dict[str, Any], vaes: dict[str, dict[str, Any]], own: dict[str, str],
              modes: dict[str, str]) -> dict[str, Any]:
    target = str(stage1.get("target", ""))
    params = stage1.get("params") or {}
    cls = target.rsplit(".", 1)[-1]
    if cls == "PixelEncoder":
        return {"kind": "pixels"}
    if cls == "RAE":
        return {"kind": "rae", "encoder": params.get("encoder_name")}
    vae_type = params.get("vae_type") or own.get(cls)
    entry = vaes[vae_type]
    return {"kind": "vae", "class": cls, "vae_type": vae_type, "hub": entry["pretrained_path"],
            "subfolder": entry.get("subfolder") or None,
            **{k: entry[k] for k in ("latent_channels", "downsample_factor", "scaling_factor", "shift_factor")
               if k in entry}, "sample_mode": params.get("sample_mode") or modes[cls]}


# ---------------------------------------------------------------------------------------------------------------

def build(repo: Repo) -> dict[str, Any]:
    classes = dataclass_fields([repo.read(f) for f in DEFAULT_FILES])
    vaes, own, modes = vae_table(repo.read(STAGE1_VAE))
    sampling_files = [f for f in repo.files(SAMPLING) if f.endswith(".yaml")]
    configs: dict[str, Any] = {}
    for f in repo.files(TRAINING):
        if not f.endswith(".yaml"):
            continue
        rel = f[len(TRAINING) + 1:]
        name = Path(rel).stem
        raw = yaml.safe_load(repo.read(f))
        cfg = resolve(classes, ROOT_CLASS, {k: v for k, v in raw.items() if k not in SKIPPED_SECTIONS})
        post_process(cfg)
        for k in SKIPPED_SECTIONS:
            cfg.pop(k, None)
        task = rel.split("/")[0]
        samplings = []
        for s in sampling_files:
            stem = Path(s).stem
            if s.startswith(f"{SAMPLING}/{task}/") and (stem == name or stem.startswith(name + "-cfg")):
                flat = flatten(yaml.safe_load(repo.read(s)))
                samplings.append({"name": stem, **{k: flat.get(k) for k in SAMPLING_KEYS}})
        configs[name] = {"file": f, "task": task, "tokenizer": tokenizer(cfg["stage_1"], vaes, own, modes),
                         "values": dict(sorted(flatten(cfg).items())), "sampling": samplings}
    return {"source": {"repo": "End2End-Diffusion/diffusion-bench", "commit": repo.commit(),
                       "read": [TRAINING, SAMPLING, *DEFAULT_FILES, STAGE1_VAE]},
            "configs": dict(sorted(configs.items()))}


def dumps(facts: dict[str, Any]) -> str:
    """JSON with one config value per line (lists and small mappings inline), for readable diffs."""
    def inline(v: Any) -> str:
        return json.dumps(v, separators=(", ", ": "))

    lines = ["{", f' "source": {inline(facts["source"])},', ' "configs": {']
    names = list(facts["configs"])
    for i, name in enumerate(names):
        c = facts["configs"][name]
        lines.append(f'  {inline(name)}: {{')
        for key in ("file", "task", "tokenizer"):
            lines.append(f'   {inline(key)}: {inline(c[key])},')
        lines.append('   "sampling": [' + ", ".join(inline(s) for s in c["sampling"]) + '],')
        values = list(c["values"].items())
        lines.append('   "values": {')
        lines += [f'    {inline(k)}: {inline(v)}{"," if j < len(values) - 1 else ""}' for j, (k, v) in enumerate(values)]
        lines.append("   }")
        lines.append("  }" + ("," if i < len(names) - 1 else ""))
    lines += [" }", "}"]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True, help="a NanoGen checkout, or a bare git repository of it")
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/data/nanogen_training.json"))
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it (exit 1 when the "
                    "configs differ)")
    args = ap.parse_args(argv)
    facts = build(Repo(args.repo))
    out = Path(args.out)
    if args.check:
        have = json.loads(out.read_text(encoding="utf-8"))
        if have["configs"] != json.loads(dumps(facts))["configs"]:
            print(f"{out} differs from {args.repo}: run without --check to rewrite it", file=sys.stderr)
            return 1
        print(f"{out}: the {len(facts['configs'])} configs of {args.repo} as recorded")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(facts), encoding="utf-8")
    print(f"wrote {out}: {len(facts['configs'])} training configs of {args.repo}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
