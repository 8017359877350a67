"""NanoGen's sampling configs as protocol rows (dit/nanogen_protocols.py) against the facts read from its files
(tests/data/nanogen_sampling.json, written by scripts/nanogen_sampling.py from End2End-Diffusion/diffusion-bench
configs/stage2/sampling and its config defaults): every config is a row `nanogen/<file name>` and every such row a
config, with its steps, grid, guidance, conversion and what it applies to. Where a clone of NanoGen is at hand
(NANOGEN_REPO, else the development machines' mirror), the facts are read anew and must equal the fixture, so a new,
removed or changed NanoGen config fails here. And what a protocol applies to, as the refusals state it."""
from __future__ import annotations

import importlib.util
import json
import math
import os
import shutil
from pathlib import Path

import pytest
import torch

from dit_pipeline.dit import protocols
from dit_pipeline.common.text_encoders import PRESETS
from dit_pipeline.dit.nanogen_protocols import DECODERS, MODELS, TOKENIZERS
from dit_pipeline.dit.protocol_fit import ModelTraits
from dit_pipeline.dit.protocols import PROTOCOLS
from tests._util import REPO

FIXTURE = REPO / "tests" / "data" / "nanogen_sampling.json"
MIRROR = Path(os.environ.get("NANOGEN_REPO", "/work/.mirror/End2End-Diffusion+diffusion-bench/repo"))
STAGE_1 = {"Flux2VAE": "flux2", "PixelEncoder": "pixels"}  # the tokenizers a config names by class only
MODES = {"cfg": "cfg", "none": "none", "internal": "ig", "internal+cfg": "ig+cfg"}  # Guidance.kind -> NanoGen's mode


def script():
    spec = importlib.util.spec_from_file_location("nanogen_sampling", REPO / "scripts" / "nanogen_sampling.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def fixture():
    return json.loads(FIXTURE.read_text())


def row_differences(key: str, f: dict) -> list[str]:
    """Where the row nanogen/<name> differs from the config's facts `f` (one line each)."""
    name = "nanogen/" + key.split("/", 1)[1]
    if name not in PROTOCOLS:
        return [f"{key}: no protocol {name}"]
    p, a = PROTOCOLS[name], PROTOCOLS[name].applies_to
    model = next(m for m in MODELS if name[len("nanogen/"):] in dict(m.sampling_names()))
    g = p.guidance
    ours = {
        "config file": p.sources[0], "condition": {("class",): "label", ("text",): "text"}[a.conditioning],
        "space": a.space, "tokenizer": model.tokenizer, "resolution": model.resolution,
        "latent_size": list(a.latent_shape), "checkpoint": p.model.split(" ")[0], "prediction": a.prediction,
        "meanflow": (p.solver, a.objectives) == ("meanflow", ("meanflow",)), "reg": "reg" in a.requires,
        "num_steps": p.count, "guidance": MODES[g.kind], "ig": g.internal,
        "cfg": [g.scale, *g.interval] if g.rule == "cfg" else f["cfg"] if f["guidance"] == "none" else None,
        "labels": p.labels, "null": p.null_label, "conversion": p.conversion,
        # what the row supplies for a NanoGen file, which records none of it (sample/facts.py)
        "facts": (p.facts.source, p.facts.prediction, p.facts.t_eps),
        "text_encoder": None if p.facts.text_encoder is None else
        [PRESETS[p.facts.text_encoder].source, PRESETS[p.facts.text_encoder].max_length],
    }
    theirs = {
        "config file": f"configs/stage2/sampling/{key}.yaml", "condition": f["condition"],
        "space": ("pixels",) if f["stage_1"] == "PixelEncoder" else ("latent",),
        "tokenizer": f["tokenizer"] or STAGE_1[f["stage_1"]], "resolution": f["resolution"],
        "latent_size": f["latent_size"], "checkpoint": f["checkpoint"], "prediction": f["prediction"],
        "meanflow": f["meanflow"], "reg": f["reg"], "num_steps": f["num_steps"], "guidance": f["guidance"],
        "ig": None if "ig" not in f["guidance"] else tuple(f["ig"][:3]), "cfg": f["cfg"],
        # src/eval/distributed.py l.35-58: one sample per validation image (equal counts); T2I: the prompts
        "labels": "equal" if f["condition"] == "label" else "uniform",
        "null": "num_classes" if f["condition"] == "label" else "the empty prompt", "conversion": "nanogen",
        "facts": (f"configs/stage2/sampling/{key}.yaml", f["prediction"], f["t_eps"]),
        "text_encoder": f["text_encoder"],
    }
    out = [f"{key}: {k} {ours[k]!r} (NanoGen: {theirs[k]!r})" for k in theirs if ours[k] != theirs[k]]
    if p.grid is None or abs(p.grid.shift - f["shift_eval"]) > 1e-12 * f["shift_eval"]:
        out.append(f"{key}: grid shift {p.grid and p.grid.shift} (NanoGen: {f['shift_eval']})")
    for dataset, ev in f["eval"].items():  # what the samples are scored with
        if ev["reference"] and ev["reference"] not in p.fid_reference or \
                not ev["reference"] and dataset not in p.fid_reference.lower().replace("-", ""):
            out.append(f"{key}: evaluation {dataset} ({ev}) not named in {p.fid_reference!r}")
    return out


def test_every_nanogen_sampling_config_is_a_protocol_with_its_values(fixture):
    configs = fixture["configs"]
    assert len(configs) == 78 and {f["network"] for f in configs.values()} == {"DiTwDDTHead"}
    rows = {n for n in PROTOCOLS if n.startswith("nanogen/")}
    assert rows == {"nanogen/" + k.split("/", 1)[1] for k in configs}, "a NanoGen config without a row, or a row " \
                                                                        "without a config"
    assert [d for key, f in configs.items() for d in row_differences(key, f)] == []


def test_the_comparison_catches_a_differing_config(fixture):
    """The table test above is not vacuous: a config whose scale, shift, steps or REG differs is reported."""
    key = "imagenet/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8-cfg1.6-t0.0-0.9"
    f = fixture["configs"][key]
    changed = {**f, "cfg": [1.7, 0.0, 0.9], "shift_eval": 2.0, "num_steps": 40, "reg": True, "prediction": "x"}
    assert [d.split(": ", 1)[1].split(" ")[0] for d in row_differences(key, changed)] == \
        ["prediction", "reg", "num_steps", "cfg", "facts", "grid"]
    assert row_differences("imagenet/new-config", f) == ["imagenet/new-config: no protocol nanogen/new-config"]


def test_the_decoders_named_are_nanogens_vaes(fixture):
    """DECODERS names a --vae only where it decodes as NanoGen's stage_1 does: an AutoencoderKL hub id without a
    subfolder whose scaling and shift NanoGen's own table fixes (src/stage1/vae.py l.24-95, l.137-149: otherwise it
    reads them from the VAE's config, per channel as latents_mean / latents_std without diffusers' multiplier), and
    the pixel space; every other latent space is named by NanoGen's path for the refusal."""
    vaes = fixture["vaes"]
    assert set(DECODERS) == set(TOKENIZERS) and set(vaes) <= set(DECODERS) | {"e2e-sdvae-mse"}
    named = {t: spec for t, (spec, _, _) in DECODERS.items() if spec}
    assert named == {"sdvae-ema": "stabilityai/sd-vae-ft-ema", "sdvae-mse": "stabilityai/sd-vae-ft-mse",
                     "sdxl-vae": "madebyollin/sdxl-vae-fp16-fix", "pixels": "pixels"}
    for tokenizer, (spec, latent, how) in DECODERS.items():
        v = vaes.get(tokenizer)
        if spec and v is not None:
            assert (spec, latent, v.get("subfolder", "")) == (v["pretrained_path"],
                                                              (v["scaling_factor"], v["shift_factor"]), ""), tokenizer
        elif v is not None:
            assert v["pretrained_path"] in how and spec is None and latent is None, tokenizer
        # a latent space's channels and downsampling are the protocol table's too
        if v is not None:
            assert TOKENIZERS[tokenizer] == (v["latent_channels"], v["downsample_factor"]), tokenizer


def test_the_generic_rows_state_what_all_their_configs_share(fixture):
    """nanogen, nanogen-pixels, nanogen-t2i and nanogen-t2i-pixels supply a NanoGen file's setting only where every
    config of their task and space agrees on it: the velocity of the latent models (not of the pixel ones: JiT and
    PixelGen predict x, PixNerd the velocity), the pixel space, Qwen3-0.6B for T2I."""
    for name, task, pixels in (("nanogen", "imagenet", False), ("nanogen-pixels", "imagenet", True),
                               ("nanogen-t2i", "t2i", False), ("nanogen-t2i-pixels", "t2i", True)):
        configs = [f for f in fixture["configs"].values()
                   if f["task"] == task and (f["stage_1"] == "PixelEncoder") == pixels]
        facts = PROTOCOLS[name].facts
        shared = {k: {json.dumps(f[k]) for f in configs} for k in ("prediction", "text_encoder")}
        want_prediction = json.loads(next(iter(shared["prediction"]))) if len(shared["prediction"]) == 1 else None
        assert facts.prediction == want_prediction, name
        text = None if facts.text_encoder is None else [PRESETS[facts.text_encoder].source,
                                                        PRESETS[facts.text_encoder].max_length]
        assert shared["text_encoder"] == {json.dumps(text)}, name
        assert facts.vae == ("pixels" if pixels else None), name
    assert PROTOCOLS["nanogen-pixels"].facts.prediction is None  # the case of issue 44 item 5


def test_each_rows_grid_is_nanogens(fixture):
    # End2End-Diffusion/diffusion-bench src/stage2/transport/sampler.py l.11-13: t = linspace(1, 0, num_steps + 1),
    # then s t / (1 + (s - 1) t), NanoGen's t = noise level; src/offline_eval.py l.118-124: s = shift_eval
    for key, f in fixture["configs"].items():
        s = f["shift_eval"]
        t = torch.linspace(1.0, 0.0, f["num_steps"] + 1, dtype=torch.float64)
        t = s * t / (1 + (s - 1) * t)
        ours = torch.tensor(PROTOCOLS["nanogen/" + key.split("/", 1)[1]].times(tuple(f["latent_size"])),
                            dtype=torch.float64)
        assert (ours - (1 - t)).abs().max() < 1e-12, key


def test_the_fixture_is_the_scripts_output_and_nanogens_files():
    text = FIXTURE.read_text()
    tool = script()
    assert tool.dumps(json.loads(text)) == text  # written by the script, not by hand
    if not (MIRROR / "HEAD").exists() and not (MIRROR / ".git").exists() or shutil.which("git") is None:
        pytest.skip(f"no clone of NanoGen at {MIRROR} (set NANOGEN_REPO): the fixture is not re-read")
    fresh, kept = tool.collect(str(MIRROR)), json.loads(text)
    assert sorted(fresh["configs"]) == sorted(kept["configs"]), "NanoGen's sampling configs changed: rerun " \
                                                                "scripts/nanogen_sampling.py and add their rows"
    assert {k: v for k, v in fresh.items() if k != "commit"} == {k: v for k, v in kept.items() if k != "commit"}


# ---- what a protocol applies to -----------------------------------------------------------------------------------

def traits(space="latent", conditioning="class", objective="flow", prediction="velocity", shape=(4, 32, 32),
           features=()):
    return ModelTraits(space, conditioning, objective, prediction, shape, frozenset(features))


def test_a_mismatch_names_the_rows_that_fit():
    pixel_text = traits("pixels", "text", prediction="x", shape=(3, 256, 256))
    msg = protocols.fit_problem(PROTOCOLS["nanogen-t2i"], pixel_text)
    assert msg == (
        "--protocol nanogen-t2i applies to text-conditional flow models on latents; this is a text-conditional flow "
        "model (x prediction) on 3x256x256 pixels (space pixels (the protocol's: latent)). Protocols that fit it: "
        "nanogen-t2i-pixels, nanogen/t2i-jit-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4, "
        "nanogen/t2i-pixelgen-ddt-en28d1152hd72-dn2d2048hd128-xpred-t4-0.1lpips-0.01pdino-thresh0.7; or drop "
        "--protocol and choose the sampler with dit-sample's flags")
    assert protocols.fitting(traits("pixels", "text", shape=(3, 256, 256))) == [
        "nanogen-t2i-pixels", "nanogen/t2i-pixnerd-ddt-en28d1152hd72-dn2d2048hd128-vpred-t4"]
    # a class model under a text protocol; the REG rows need REG's class token, which this model lacks
    fits = protocols.fitting(traits())
    assert fits[:7] == ["sit", "repa", "lightningdit", "ddt", "rae", "rae-ag", "nanogen"]
    assert not any("reg0.03" in n for n in fits) and len(fits) == 7 + 6  # sdvae-ema, sdvae-mse, sdxl-vae: 2 each
    assert protocols.fit_problem(PROTOCOLS["nanogen-t2i"], traits()).endswith(
        "Protocols that fit it: sit, repa, lightningdit, ddt, rae, rae-ag, nanogen, "
        "nanogen/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8 and 5 more; or drop --protocol and choose the "
        "sampler with dit-sample's flags")
    assert "latent shape 4x32x32 (the protocol's: 16x32x32)" in protocols.fit_problem(
        PROTOCOLS["nanogen/ddt-en28d1152hd72-dn2d2048hd128-flux-vpred-t4c8"], traits())
    assert "prediction x (the protocol's: velocity)" in protocols.fit_problem(
        PROTOCOLS["nanogen/pixnerd-ddt-en28d1152hd72-dn2d2048hd128-vpred-t4c8"],
        traits("pixels", prediction="x", shape=(3, 256, 256)))
    text_ddpm = protocols.fit_problem(PROTOCOLS["dit"], traits(conditioning="text", objective="ddpm"))
    assert "(conditioning text (the protocol's: class)). No protocol fits it; or drop --protocol" in text_ddpm
    assert "objective meanflow (the protocol's: imf or imf-adaln)). Protocols that fit it: meanflow;" in \
        protocols.fit_problem(PROTOCOLS["imf"], traits(objective="meanflow", shape=(4, 8, 8)))
    for name, p in PROTOCOLS.items():  # every row fits the model it describes
        if p.applies_to.latent_shape:
            a = p.applies_to
            assert protocols.fit_problem(p, traits(a.space[0], a.conditioning[0], a.objectives[0], a.prediction,
                                                   a.latent_shape, a.requires)) is None, name


def test_rows_needing_reg_fit_only_models_with_its_token():
    """The 12 REG rows (NanoGen's `repa.use_reg` configs) apply to models with REG's class token (model_config
    reg_dim, dit/incontext.py), which the samplers evolve beside the image; a model without it is refused naming it,
    and a REG model fits the generic rows too (its record decides that the token is evolved)."""
    reg = [n for n, p in PROTOCOLS.items() if "reg" in p.applies_to.requires]
    assert len(reg) == 12 and all("reg0.03" in n for n in reg)  # 4 latent spaces: ImageNet (x2) and T2I
    assert all(protocols.missing_features(p) is None for p in PROTOCOLS.values())  # this build has REG
    tuned = PROTOCOLS["nanogen/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-reg0.03-rmsnorm-vpred-t4c8-cfg2.2-t0.0-0.9"]
    assert math.isclose(tuned.guidance.scale, 2.2) and tuned.guidance.interval == (0.0, 0.9)
    assert "(no REG's class token (model_config reg_dim) (the protocol's model has one))" in \
        protocols.fit_problem(tuned, traits())
    assert protocols.fit_problem(tuned, traits(features={"reg"})) is None
    assert protocols.fit_problem(PROTOCOLS["nanogen"], traits(features={"reg"})) is None


# ---- the guide's table (docs/nanogen-protocols.md) ---------------------------------------------------------------

def guide_table() -> str:
    """The guide's table of NanoGen's models and their protocols, rendered from the rows."""
    lines = ["| NanoGen model: `nanogen/<name>` | data | latent | grid shift | guidance of `nanogen/<name>` | tuned "
             "ImageNet protocol `nanogen/<name>-cfg<s>-t0.0-0.9` |", "|---|---|---|---|---|---|"]
    for m in MODELS:
        p = PROTOCOLS[f"nanogen/{m.name}"]
        g, shift = p.guidance, p.grid.shift
        own = ("none: trained in, 1 step" if g.rule == "none" else
               "none (cfg 1.0)" if g.scale == 1.0 else f"cfg {g.scale:.1f} on [{g.interval[0]:g}, {g.interval[1]:g}]")
        tuned = dict(m.sampling_names())
        scale = next((f"cfg {s:.1f} on [0, 0.9]" for s in tuned.values() if s), "")
        space = f"{m.tokenizer} {'x'.join(map(str, m.latent_shape))}"
        data = ("ImageNet" if m.task == "imagenet" else "T2I") + (f" {m.resolution} px" if m.resolution != 256 else "")
        extra = " (needs REG)" if m.reg else (" (x prediction)" if m.prediction == "x" else "")
        lines.append(f"| `{m.name}`{extra} | {data} | {space} | {shift:.4g} | {own} | {scale} |")
    return "\n".join(lines)


def test_the_guide_states_the_rows():
    guide = (REPO / "docs" / "nanogen-protocols.md").read_text()
    assert guide_table() in guide
    import re

    named = set(re.findall(r"`(nanogen[\w./-]*)`", guide) + re.findall(r"--protocol (nanogen\S*)", guide))
    named = {n for n in named if not ("<" in n or "..." in n or n.endswith("/"))}  # patterns, not names
    assert named and all(n in PROTOCOLS for n in named), sorted(n for n in named if n not in PROTOCOLS)


def test_the_guides_commands_parse(tmp_path, monkeypatch):
    """Every dit-* line of the guide's bash blocks is accepted by its command's parser (no unknown flag or value)."""
    import re
    import shlex

    import click

    from dit_pipeline import cli

    commands = {"dit-sample": cli.sample_main, "dit-eval": cli.eval_main}
    guide = (REPO / "docs" / "nanogen-protocols.md").read_text()
    lines = [shlex.split(line) for block in re.findall(r"```bash\n(.*?)```", guide, re.S)
             for line in block.replace("\\\n", " ").splitlines() if line.strip()]
    assert [w[0] for w in lines] == ["dit-sample", "dit-eval", "dit-sample", "dit-sample", "dit-sample", "python"]
    monkeypatch.chdir(tmp_path)
    for words in lines[:-1]:
        cmd = commands[words[0]]
        try:
            if isinstance(cmd, click.Group):
                cmd.commands["run"].make_context(words[0], words[1:])
            else:
                cmd.make_context(words[0], words[1:])
        except click.ClickException as e:
            pytest.fail(f"docs/nanogen-protocols.md: `{' '.join(words)}` does not parse: {e.format_message()}")
        for i, w in enumerate(words[:-1]):
            if w == "--protocol" and words[0] == "dit-sample":
                assert words[i + 1] in PROTOCOLS
    python = lines[-1]
    assert python[1] == "scripts/nanogen_sampling.py" and script().parser().parse_args(python[2:]).check
