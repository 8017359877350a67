"""The facts of NanoGen's sampling configs, as a small JSON fixture (values only) that the protocol table is checked
against (tests/dit/test_nanogen_protocols.py; dit/nanogen_protocols.py holds the rows).

    python scripts/nanogen_sampling.py --repo PATH/TO/diffusion-bench [--out tests/data/nanogen_sampling.json]

PATH is a clone of End2End-Diffusion/diffusion-bench (a bare mirror will do: the files are read with `git show
HEAD:...`). Every file under configs/stage2/sampling becomes one entry, keyed "<task>/<file name without .yaml>": its
YAML merged over the defaults of NanoGen's config dataclasses (src/configs/stage2.py, src/configs/shared.py, read
here with `ast`, so a changed default changes the fixture), then NanoGen's own rules applied, each named at its file
and line:
- guidance mode: src/configs/stage2.py l.80-103 (cfg acts where its scale > 1, internal guidance where its scale > 1
  or its unconditional scale is set and not 1; `disabled` turns both off) and l.167-170 (post_process: a MeanFlow
  transport disables guidance);
- the condition: l.172-173 (the dataset's condition_type replaces the conditioning type "label");
- the grid's shift: src/offline_eval.py l.118-124, sqrt((time_dist_shift_dim or prod(latent_size)) /
  time_dist_shift_base_eval), base_eval defaulting to time_dist_shift_base;
- the null label: src/offline_eval.py l.177 (misc.num_classes);
- a text model's encoder: conditioning.text_encoder over TextEncoderConfig's defaults (src/configs/stage2.py
  l.127-130);
and, beside the configs, NanoGen's table of VAEs (src/stage1/vae.py l.24-95 VAE_CONFIGS: hub path, subfolder, the
scaling and shift factors it fixes, channels, downsampling), which dit/nanogen_protocols.py's DECODERS are checked
against.
`--check` compares with the file instead of writing it (exit 1 on a difference).
"""
from __future__ import annotations

import argparse
import ast
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

RELEASE = "End2End-Diffusion/diffusion-bench"
SAMPLING = "configs/stage2/sampling"
DEFAULTS_FROM = {  # the dataclasses whose defaults a sampling config falls back on, by file
    "src/configs/stage2.py": ("TransportConfig", "SamplerConfig", "CFGConfig", "IGConfig", "RepaConfig",
                              "TextEncoderConfig"),
    "src/configs/shared.py": ("MiscConfig",),
}
FIXTURE = Path(__file__).resolve().parents[1] / "tests" / "data" / "nanogen_sampling.json"


def git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], check=True, capture_output=True, text=True).stdout


def dataclass_defaults(source: str, names: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """{class: {field: default}} for the fields with a literal default (a default_factory of a literal list too)."""
    out: dict[str, dict[str, Any]] = {}
    for node in ast.parse(source).body:
        if not isinstance(node, ast.ClassDef) or node.name not in names:
            continue
        fields: dict[str, Any] = {}
        for item in node.body:
            if not isinstance(item, ast.AnnAssign) or not isinstance(item.target, ast.Name) or item.value is None:
                continue
            value = item.value
            if isinstance(value, ast.Call) and value.keywords and value.keywords[0].arg == "default_factory" \
                    and isinstance(value.keywords[0].value, ast.Lambda):
                value = value.keywords[0].value.body
            try:
                fields[item.target.id] = ast.literal_eval(value)
            except ValueError:
                continue  # a nested config (field(default_factory=CFGConfig)): its own class gives its defaults
        out[node.name] = fields
    missing = set(names) - set(out)
    if missing:
        raise SystemExit(f"NanoGen's config classes {sorted(missing)} were not found; the script needs updating")
    return out


def guidance_mode(cfg: dict[str, Any] | None, ig: dict[str, Any] | None, disabled: bool) -> str:
    """src/configs/stage2.py l.80-101: use_cfg, use_ig, get_mode_string."""
    use_cfg = not disabled and cfg is not None and cfg["scale"] > 1.0
    use_ig = not disabled and ig is not None and (ig["scale"] > 1.0 or ig["unconditional_scale"] is not None
                                                  and ig["unconditional_scale"] != 1.0)
    return {(True, True): "ig+cfg", (True, False): "ig", (False, True): "cfg"}.get((use_ig, use_cfg), "none")


def facts(path: str, data: dict[str, Any], defaults: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """One sampling config's facts (module docstring)."""
    misc = {**defaults["MiscConfig"], **(data.get("misc") or {})}
    transport = {**defaults["TransportConfig"], **(data.get("transport") or {})}
    sampler = {**defaults["SamplerConfig"], **(data.get("sampler") or {})}
    given = data.get("guidance") or {}
    cfg = None if "cfg" in given and given["cfg"] is None else {**defaults["CFGConfig"], **(given.get("cfg") or {})}
    ig = None if "ig" in given and given["ig"] is None else {**defaults["IGConfig"], **(given.get("ig") or {})}
    repa = {**defaults["RepaConfig"], **(data.get("repa") or {})}
    meanflow = transport.get("meanflow") is not None
    condition = (data.get("conditioning") or {}).get("type", "label")
    if condition == "label" and (data.get("dataset") or {}).get("condition_type") is not None:  # l.172-173
        condition = data["dataset"]["condition_type"]
    latent = [int(v) for v in misc["latent_size"]]
    base_eval = misc["time_dist_shift_base"] if misc.get("time_dist_shift_base_eval") is None \
        else misc["time_dist_shift_base_eval"]
    shift = math.sqrt((misc["time_dist_shift_dim"] or math.prod(latent)) / base_eval)
    text = {**defaults["TextEncoderConfig"], **((data.get("conditioning") or {}).get("text_encoder") or {})}
    stage_1 = data["stage_1"]
    params = stage_1.get("params") or {}
    datasets = ((data.get("eval") or {}).get("datasets")) or {}
    return {
        "task": path.split("/")[-2],
        "condition": condition,
        "stage_1": stage_1["target"].split(".")[-1],
        "tokenizer": params.get("vae_type") or params.get("encoder_name"),
        "resolution": params.get("resolution"),
        "latent_size": latent,
        "network": data["stage_2"]["target"].split(".")[-1],
        "checkpoint": Path(str(data["stage_2"].get("ckpt") or "")).name,
        "prediction": transport["prediction"],
        "t_eps": transport["t_eps"],
        "meanflow": meanflow,
        "reg": bool(repa["use_reg"]),
        "repa": bool(repa["use_repa"]),
        "num_steps": sampler["num_steps"],
        "shift_eval": shift,
        "guidance": guidance_mode(cfg, ig, bool(given.get("disabled", False)) or meanflow),
        "cfg": None if cfg is None else [cfg["scale"], cfg["t_min"], cfg["t_max"]],
        "ig": None if ig is None else [ig["scale"], ig["t_min"], ig["t_max"], ig["unconditional_scale"]],
        "null_label": misc["num_classes"],
        "text_encoder": [text["model_name"], text["max_length"]] if condition == "text" else None,
        "eval": {name: {"metrics": ds.get("metrics"), "reference": Path(str(ds.get("reference_npz") or "")).name
                        or None} for name, ds in sorted(datasets.items())},
    }


def vae_configs(source: str) -> dict[str, dict[str, Any]]:
    """src/stage1/vae.py's VAE_CONFIGS: {vae_type: the keywords of its VAEConfig(...), literal values}."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == "VAE_CONFIGS":
            table = node.value
            assert isinstance(table, ast.Dict)
            return {ast.literal_eval(k): {kw.arg: ast.literal_eval(kw.value) for kw in v.keywords}  # type: ignore
                    for k, v in zip(table.keys, table.values)}
    raise SystemExit("NanoGen's VAE_CONFIGS was not found in src/stage1/vae.py; the script needs updating")


def collect(repo: str) -> dict[str, Any]:
    """The fixture's content for the NanoGen clone at `repo`."""
    defaults: dict[str, dict[str, Any]] = {}
    for source, names in DEFAULTS_FROM.items():
        defaults.update(dataclass_defaults(git(repo, "show", f"HEAD:{source}"), names))
    files = sorted(f for f in git(repo, "ls-tree", "-r", "--name-only", "HEAD", SAMPLING).split()
                   if f.endswith((".yaml", ".yml")))
    configs = {}
    for f in files:
        key = f[len(SAMPLING) + 1:].rsplit(".", 1)[0]
        configs[key] = facts(f, yaml.safe_load(git(repo, "show", f"HEAD:{f}")), defaults)
    return {"release": RELEASE, "commit": git(repo, "rev-parse", "HEAD").strip(), "defaults": defaults,
            "vaes": vae_configs(git(repo, "show", "HEAD:src/stage1/vae.py")), "configs": configs}


def dumps(content: dict[str, Any]) -> str:
    """JSON with one line per config (small diffs when NanoGen adds or changes one)."""
    head = {k: v for k, v in content.items() if k != "configs"}
    lines = [json.dumps(head, sort_keys=True)[:-1] + ', "configs": {']
    rows = [f"  {json.dumps(k)}: {json.dumps(v, sort_keys=True)}" for k, v in content["configs"].items()]
    return "\n".join(lines + [",\n".join(rows), "}}"]) + "\n"


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repo", required=True, help="a clone (or bare mirror) of End2End-Diffusion/diffusion-bench")
    ap.add_argument("--out", default=str(FIXTURE), help="the fixture to write [%(default)s]")
    ap.add_argument("--check", action="store_true", help="compare with --out instead of writing it")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    content = collect(args.repo)
    out = Path(args.out)
    if args.check:
        old = json.loads(out.read_text())
        same = {k: v for k, v in old.items() if k != "commit"} == {k: v for k, v in content.items() if k != "commit"}
        print(f"{out}: {'up to date' if same else 'differs from'} {args.repo} ({len(content['configs'])} configs)")
        return 0 if same else 1
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(dumps(content))
    print(f"wrote {out}: {len(content['configs'])} sampling configs of {RELEASE} at {content['commit'][:12]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
