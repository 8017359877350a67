"""Recipes, latent spaces and protocols agree, for every NanoGen recipe (issue 44's "Done when": `dit-train --config
recipes/nanogen/<any training config>` plans on fitting shards with no departure).

For each of the 54 recipes, its own `recipe.extraction` commands parse against dit-extract's CLI, and the manifests
they write (tests/train/_nanogen_sets.py: each tokenizer's identity from the registries' builders, what dit-extract
decides from it; no image read, no real weight loaded) meet its `requires` with no departure: the latent space by
NanoGen's name with NanoGen's normalization, REG's class tokens (a sibling of the latents), the text set. The model the
recipe trains fits its `sampling.protocol` row (dit/protocol_fit.py, as dit-sample checks the checkpoint). What else
a user could extract for the same space departs, naming how. And `dit-train --protocol` (FID during training)
refuses a row that does not fit the model before any work, naming the rows that do.
"""
from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from dit_pipeline.dit.protocols import PROTOCOLS, fit_problem
from dit_pipeline.shards.siblings import sibling_problems
from dit_pipeline.train import merge_config
from dit_pipeline.train.config_file import load_config_file
from dit_pipeline.train.latents import latent_sample_problem
from dit_pipeline.train.preflight import arch_kwargs, run_traits
from dit_pipeline.train.recipes import extraction_departures
from tests._util import REPO
from tests.train import _nanogen_sets as sets
from tests.train.conftest import invoke_train
from tests.train.helpers import recipe_manifest

NANOGEN = REPO / "recipes" / "nanogen"
FACTS = json.loads((REPO / "tests" / "data" / "nanogen_training.json").read_text(encoding="utf-8"))["configs"]


def _recipe(name: str) -> dict:
    return load_config_file(NANOGEN / f"{name}.yaml")


@pytest.mark.parametrize("name", sorted(FACTS))
def test_the_recipes_extraction_writes_what_it_requires_and_trains_a_model_its_protocol_fits(name, tmp_path):
    values = _recipe(name)
    recipe = values["recipe"]
    cfgs = sets.roles(recipe)  # every command parses (dit-extract's CLI, ExtractConfig.validate)
    f = FACTS[name]
    assert set(cfgs) == {"latents", *(["reg"] if f["values"]["repa.use_reg"] else []),
                         *(["text"] if f["values"]["conditioning.type"] == "text" else [])}
    latents = sets.command_manifest(cfgs["latents"], tmp_path)
    reg = sets.command_manifest(cfgs["reg"], tmp_path) if "reg" in cfgs else None
    text = sets.text_set(cfgs["text"]) if "text" in cfgs else None
    found, met = extraction_departures(recipe["requires"], latents, text, "TEXT", reg, "TOKENS")
    assert found == []
    assert latent_sample_problem(latents, values.get("latent_sample", "sample")) is None
    tok = f["tokenizer"]
    if tok["kind"] != "pixels":  # NanoGen's space by its name, normalized as NanoGen normalizes it
        assert any(m.startswith(f"latent space {tok.get('vae_type') or tok['encoder']}: NanoGen's") for m in met)
    if reg is not None:  # the class tokens of the same images, shard for shard
        assert sibling_problems(latents, reg) == [] and reg.latent_shape == [768, 1, 1]
        assert cfgs["reg"].data_path == cfgs["latents"].data_path
    if text is not None:
        assert cfgs["text"].data_path == cfgs["latents"].out and cfgs["latents"].captions == "sidecar"
    # the model the recipe trains on them fits the protocol row its `sampling` names
    cfg = merge_config(values, {"shards": "s", "run_dir": "r", **({"text": "t"} if text else {}),
                                **({"reg_tokens": "c"} if reg else {})})
    kw = arch_kwargs(cfg, latents, SimpleNamespace(dim=sets.QWEN3_0_6B_DIM, max_length=256) if text else None,
                     reg.latent_shape[0] if reg else None)
    row = PROTOCOLS[recipe["sampling"]["protocol"]]
    assert fit_problem(row, run_traits(cfg, kw, latents)) is None


def _set(name: str, root: Path, role: str = "latents"):
    return sets.command_manifest(sets.roles(_recipe(name)["recipe"])[role], root)


def _requires(name: str) -> dict:
    return _recipe(name)["recipe"]["requires"]


FLUX2 = "ddt-en28d1152hd72-dn2d2048hd128-flux2-vpred-t4c8"
DINOV2 = "ddt-en28d1152hd72-dn2d2048hd128-rae-dinov2-vpred-t4c8"
SDVAE = "ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8"
REG = "ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-reg0.03-rmsnorm-vpred-t4c8"


def test_other_extractions_of_the_same_space_depart(tmp_path):
    """What a user could extract instead, each a departure naming the command that makes NanoGen's: FLUX.2 by its
    hub folder (the diffusers pipeline's BatchNorm eps 1e-4, not NanoGen's 1e-5); DINOv2-B through RAE's preset
    (resize before normalizing); NanoGen's space with statistics computed from the shards (dit-shards stats --write)
    or a VAE space whose own normalization --latent-stats replaced; REG's class tokens of DINOv2-B without
    registers."""
    m = _set(FLUX2, tmp_path)
    vae = dict(m.extraction["vae"])
    del vae["latent_space"]
    folder = {**vae, "source": "/models/FLUX.2-dev/vae", "kind": "folder",
              "normalization": sets.stand_in_vae("flux2").describe()["normalization"]}
    assert folder["normalization"]["source"]["eps"] == 1e-4
    moved = dataclasses.replace(m, extraction={**m.extraction, "vae": folder}, normalization=folder["normalization"])
    found, _ = extraction_departures(_requires(FLUX2), moved)
    assert found == ["latent space none of NanoGen's where the recipe needs NanoGen's flux2 (dit-extract --vae flux2)"]

    revised = dataclasses.replace(m, normalization={**m.normalization, "std": [1.0] * 128,
                                                    "source": {"kind": "file", "path": "/s.pt"}})
    found, _ = extraction_departures(_requires(FLUX2), revised)
    assert len(found) == 1 and found[0].startswith("normalization ") and \
        "where NanoGen normalizes flux2 by the VAE's own" in found[0]

    d = _set(DINOV2, tmp_path)
    rae = {**d.extraction["encoder"], "formula_name": "rae", "spec": "dinov2-b-reg"}
    del rae["latent_space"]
    found, _ = extraction_departures(_requires(DINOV2), dataclasses.replace(d, extraction={**d.extraction,
                                                                                          "encoder": rae}))
    assert found == ["latent space none of NanoGen's where the recipe needs NanoGen's dinov2-vit-b (dit-extract "
                     "--encoder dinov2-vit-b)"]
    computed = {**d.normalization, "source": {"kind": "stats", "samples_used": 10000, "seed": 0}}
    found, _ = extraction_departures(_requires(DINOV2), dataclasses.replace(d, normalization=computed))
    assert found == ["normalization from dit-shards stats over 10000 samples (seed 0) where NanoGen normalizes "
                     "dinov2-vit-b by its release's statistics file (dit-extract --encoder dinov2-vit-b --latent-stats "
                     ".../stats/dinov2-vit-b/stats.pt)"]

    tokens = _set(REG, tmp_path, "reg")
    plain = {**{k: v for k, v in tokens.extraction["encoder"].items() if not k.startswith("target_encoder")},
             "model": "vit_base_patch14_dinov2"}  # dit-extract --encoder dinov2-b --encoder-formula reg
    found, _ = extraction_departures(_requires(REG), _set(REG, tmp_path),
                                     reg=dataclasses.replace(tokens, extraction={**tokens.extraction,
                                                                                 "encoder": plain}),
                                     reg_folder="T")
    assert found == ["REG class tokens T: vit_base_patch14_dinov2, formula reg, 224 px input where the recipe needs "
                     "the class tokens of dinov2-vit-b at 256 px (dit-extract --encoder dinov2-vit-b "
                     "--encoder-formula reg), a 224 px input"]


def test_the_vae_stores_that_hold_nanogens_latent(tmp_path):
    """NanoGen trains on the posterior's mode: a --store mode set (the recipes' command) and a --store posterior set
    (the run takes the mean: latent_sample mean) both plan; a set of one draw (--store sample) is refused. An SD-VAE
    set made from the hub id or a copy named after it is NanoGen's sdvae-ema (NanoGen fixes its factors by name)."""
    cfg = sets.roles(_recipe(SDVAE)["recipe"])["latents"]
    made = {store: sets.command_manifest(dataclasses.replace(cfg, store=store), tmp_path)
            for store in ("mode", "posterior", "sample")}
    assert latent_sample_problem(made["mode"], "mean") is None and made["mode"].extraction["store"] == "mode"
    assert latent_sample_problem(made["posterior"], "mean") is None
    assert "this set stores one draw of the posterior (store sample)" in latent_sample_problem(made["sample"], "mean")
    m = made["mode"]
    for source, kind, how in (("stabilityai/sd-vae-ft-ema", "hub", "its hub id"),
                              ("/data/models/sd-vae-ft-ema", "folder", "its folder name")):
        vae = {k: v for k, v in m.extraction["vae"].items() if k not in ("latent_space", "subfolder")}
        found, met = extraction_departures(_requires(SDVAE), dataclasses.replace(
            m, extraction={**m.extraction, "vae": {**vae, "source": source, "kind": kind}}))
        assert found == [] and f"VAE stabilityai/sd-vae-ft-ema: {how}" in met
        assert "latent space sdvae-ema: NanoGen's, normalized by the VAE's own" in met
    mse = {**m.extraction["vae"], "source": "stabilityai/sd-vae-ft-mse", "latent_space": "sdvae-mse"}
    found, _ = extraction_departures(_requires(SDVAE), dataclasses.replace(m, extraction={**m.extraction,
                                                                                         "vae": mse}))
    assert "latent space sdvae-mse where the recipe needs NanoGen's sdvae-ema (dit-extract --vae sdvae-ema)" in found


# ---------------------------------------------------------------------------------------------------------------
# dit-train --protocol: the row must fit the model, as dit-sample checks it

IC = ["--model", "ddt-en28d1152hd72-dn2d2048hd128", "--depth", "1", "--hidden-size", "32", "--num-heads", "2",
      "--head-depth", "1", "--head-hidden-size", "32", "--head-num-heads", "2", "--patch-size", "2",
      "--objective", "flow", "--global-batch-size", "8", "--max-steps", "10"]
ROW = "nanogen/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8-cfg1.6-t0.0-0.9"


def _fid_plan(tmp_path: Path, protocol: str, ok: bool) -> str:
    manifest = recipe_manifest(tmp_path / f"set-{len(list(tmp_path.iterdir()))}", (4, 32, 32), total=64,
                               per_shard=8, num_classes=10)
    r = invoke_train(["--shards", "shard-{000000..000007}.tar", "--manifest", str(manifest), "--run-dir",
                      str(tmp_path / "run"), *IC, "--fid-every", "5", "--fid-ref", "ref.npz", "--vae", "tiny-vae",
                      "--protocol", protocol, "--dry-run", "--quiet"])
    assert (r.exit_code == 0) == ok, r.output
    return r.output


def test_dit_train_refuses_a_protocol_that_does_not_fit_the_model_before_any_work(tmp_path):
    """The FID samples' --protocol is checked as dit-sample checks a checkpoint (dit.protocols.fit_problem): a
    text row, a pixel row and a REG row on a class-conditional flow model without REG's token on 4x32x32 latents
    are refused in the dry run, in one line naming the rows that fit; a row that fits plans."""
    out = _fid_plan(tmp_path, "nanogen-t2i", ok=False)
    assert "--protocol nanogen-t2i applies to text-conditional flow models on latents; this is a class-conditional " \
           "flow model on 4x32x32 latents (conditioning class (the protocol's: text)). Protocols that fit it: " in out
    assert "or drop --protocol (the FID samples then take --fid-steps, --fid-cfg-scale and the objective's FID " \
           "sampler)" in out and "Traceback" not in out
    assert "space latent (the protocol's: pixels)" in _fid_plan(tmp_path, "nanogen-pixels", ok=False)
    out = _fid_plan(tmp_path, ROW.replace("vpred-t4c8-cfg1.6", "reg0.03-rmsnorm-vpred-t4c8-cfg2.2"), ok=False)
    assert "(no REG's class token (model_config reg_dim) (the protocol's model has one))" in out
    assert "Protocols that fit it: sit, repa, lightningdit, ddt, rae, rae-ag, nanogen, " \
           "nanogen/ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-vpred-t4c8 and 5 more; or drop --protocol" in out
    assert "dit-train plan (dry run" in _fid_plan(tmp_path, ROW, ok=True)


def test_a_t2i_recipe_plans_on_a_mix_of_fitting_sources_and_names_a_source_that_departs(tmp_path):
    """NanoGen trains its T2I configs on BLIP3o's journeydb, long-caption and short-caption splits at once: as a data
    mix (issue 46) of three sources, each with its own text set and class tokens (text=, reg=), the REG recipe plans
    with no departure; a source without its text set or its class tokens departs, named (train.recipes
    .data_departures, which `dit-train --config` runs on every source of a mix)."""
    from dit_pipeline.train.mixplan import Weight
    from dit_pipeline.train.recipes import data_departures

    recipe = _recipe("t2i-ddt-en28d1152hd72-dn2d2048hd128-sdvae-ema-reg0.03-rmsnorm-vpred-t4")["recipe"]
    cfgs = sets.roles(recipe)
    latents, reg = sets.command_manifest(cfgs["latents"], tmp_path), sets.command_manifest(cfgs["reg"], tmp_path)
    text = sets.text_set(cfgs["text"])
    splits = ("journeydb", "long-caption", "short-caption")
    mix = SimpleNamespace(sources=[
        SimpleNamespace(name=n, manifest=latents, text=text, reg=SimpleNamespace(manifest=reg),
                        spec=SimpleNamespace(text=f"{n}-qwen3", reg=f"{n}-dinov2-cls", weight=Weight()))
        for n in splits])
    found, met = data_departures(None, recipe["requires"], None, mix)
    assert found == [] and any(m.startswith("latent space sdvae-ema: NanoGen's") for m in met)
    assert any(m.startswith("text encoder Qwen/Qwen3-0.6B:") for m in met)
    mix.sources[0].spec.weight = Weight(repeat=1)  # every sample once per epoch: NanoGen's concatenation
    assert data_departures(None, recipe["requires"], None, mix)[0] == []
    mix.sources[0].spec.weight = Weight(proportion=0.5)
    mix.sources[1].text, mix.sources[2].reg = None, None
    found, _ = data_departures(None, recipe["requires"], None, mix)
    assert len(found) == 3 and found[0] == ("source journeydb: weighted (proportion 0.5) where the recipe reads each "
                                            "sample once per epoch")
    assert found[1] == ("source long-caption: no text set where the recipe needs the features of Qwen/Qwen3-0.6B "
                        "(width 1024, max length 256)")
    assert found[2].startswith("source short-caption: ") and "class tokens" in found[2]
