"""Settings as data (common.settings): every TrainConfig field is one dit-train option built from the field
(type, default, help, group), the sample-grid and FID settings are their hooks' own types, `dit-train --help`
lists the options in sections, and the stored config keeps its flat version-1 keys."""
from __future__ import annotations

import dataclasses
import re

import pytest
from click.testing import CliRunner

from dit_pipeline.cli import train_main
from dit_pipeline.common.settings import flag_name, setting_help, shown_default
from dit_pipeline.evaluate.hook import FidHook, FidSettings
from dit_pipeline.sample.grid import GridSettings, SampleGridHook
from dit_pipeline.train.config import DEFAULT_MAX_STEPS, GROUPS, TrainConfig

# The keys of config.json / the checkpoint's "config" before the settings moved to their stages.
V1_CONFIG_KEYS = set("""shards run_dir manifest image_size num_workers shuffle_buffer shards_in_flight prefetch_factor
skip_bad_shards verify_shards model depth hidden_size num_heads patch_size class_dropout_prob qk_norm rms_norm swiglu
rope objective t_sampling t_mean t_scale max_steps epochs global_batch_size micro_batch_size lr weight_decay adam_beta1
adam_beta2 adam_eps warmup_steps grad_clip ema_decay seed precision tf32 grad_checkpointing compile attention
ddp_bucket_mb log_every ckpt_every keep_last keep_every resume peak_tflops tensorboard quiet dry_run sample_every vae
vae_config sample_classes sample_steps sample_weights sample_cfg_scale fid_every fid_ref fid_num_samples fid_steps
fid_cfg_scale fid_batch_size inception fid_input_size fid_random_inception extra""".split())


@pytest.fixture(scope="module")
def help_text() -> str:
    r = CliRunner().invoke(train_main, ["--help"], terminal_width=200)
    assert r.exit_code == 0
    return r.output


# settings added compatibly since (a stored config without them has their default)
ADDED_SINCE = {"fid_labels", "repa", "repa_depth", "repa_coeff", "time_shift", "time_shift_base", "cosine_loss",
               "optimizer", "muon_momentum", "muon_adjust_lr", "warmup_epochs", "final_lr", "lr_decay_start_steps",
               "lr_decay_start_epochs", "lr_decay_end_steps", "lr_decay_end_epochs", "recipe",
               "on_divergence", "spike_factor", "spike_window", "max_skips", "skip_window", "wandb", "wandb_project",
               "fd_dinov2", "dinov2", "wo_shift", "encoder_depth", "head_depth",
               "head_hidden_size", "head_num_heads", "mf_t_mean", "mf_t_scale", "mf_data_proportion", "mf_omega",
               "mf_kappa", "mf_t_start", "mf_t_end", "mf_norm_p", "mf_norm_eps", "mf_s_max", "jvp_attention", "init", "cfg_channels",
               "allow_departures", "num_t_tokens", "num_c_tokens", "conditioning", "text_features", "text",
               "protocol", "prediction", "t_eps", "lpips", "percep_t_thresh", "bottleneck_dim", "in_context_len",
               "in_context_start", "pdino", "pdino_weight", "lpips_weight", "v_target", "use_reg", "reg_coeff",
               "reg_tokens", "base_model_depth", "base_model_coeff", "latent_sample", "mf_rule", "parallel",
               "hsdp_shard_size", "gpu_memory", "log_keys",
               # issue 46: data mixes, the key audit and the validation loss
               "source", "mix", "mix_epoch_size", "mix_lanes", "new_mix", "data_mix", "record_keys", "val_shards",
               "val_every", "val_samples", "val_timesteps", "val_batch_size", "val_weights",
               "sample_prompts", "fid_prompts"}  # a text run's grids and FID samples


def test_the_stored_config_keeps_its_flat_keys():
    cfg = TrainConfig(shards="s", run_dir="r", sample_every=5, fid_every=7)
    assert set(cfg.to_dict()) == V1_CONFIG_KEYS | ADDED_SINCE
    assert TrainConfig(**cfg.to_dict()) == cfg          # a stored config loads back unchanged
    assert isinstance(cfg, GridSettings) and isinstance(cfg, FidSettings)


def test_every_field_is_an_option_with_its_help_and_default(help_text):
    grid_fields = {f.name for f in dataclasses.fields(GridSettings)}
    fid_fields = {f.name for f in dataclasses.fields(FidSettings)}
    for f in dataclasses.fields(TrainConfig):
        h = setting_help(f)
        assert h is not None and h.text and h.group in GROUPS, f.name
        if f.name in grid_fields | fid_fields:
            assert h.group == "Sample grids and FID during training", f.name
        line = re.search(rf"^\s+{re.escape(flag_name(f.name))}[ /,].*?(?=^\s+--|\Z)", help_text, re.M | re.S)
        if not h.cli or h.hidden:
            assert line is None, f.name
            continue
        assert line is not None, f.name
        shown = shown_default(f)
        body = " ".join(line.group(0).split())
        if shown is not None:
            assert body.endswith(f"[{' '.join(shown.split())}].") or f"[{shown}]" in body, (f.name, body)
    assert f"[{DEFAULT_MAX_STEPS}, the DiT paper's length" in help_text  # from the constant, not a literal


def test_help_lists_the_options_in_sections(help_text):
    sections = [s.rstrip(":") for s in re.findall(r"^(\S[^\n]*):$", help_text, re.M)]
    assert sections[:len(GROUPS)] == list(GROUPS) and sections[-1] == "Command"

    def section_of(flag: str) -> str:
        before = help_text[:help_text.index(f"  {flag} ")]
        return re.findall(r"^(\S[^\n]*):$", before, re.M)[-1]

    assert section_of("--lr") == "Optimisation" and section_of("--shards") == "Data"
    assert section_of("--fid-every") == section_of("--sample-every") == "Sample grids and FID during training"
    assert section_of("--compile") == "Speed and memory" and section_of("--nproc-per-node") == "Command"


def test_hooks_are_built_from_their_settings():
    cfg = TrainConfig(shards="s", run_dir="r", objective="flow", sample_every=10, sample_classes="3,1",
                      sample_steps=25, fid_every=20, fid_ref="ref.npz", fid_steps=40, vae="v", seed=4)
    grid = SampleGridHook.from_settings(cfg, vae="v", vae_config=None, seed=cfg.seed, objective=cfg.objective)
    assert (grid.every, grid.class_labels, grid.steps, grid.sampler, grid.seed) == (10, [3, 1], 25, "euler", 4)
    fid = FidHook.from_settings(cfg, vae="v", vae_config=None, seed=cfg.seed, objective=cfg.objective)
    assert (fid.every, fid.ref, fid.steps, fid.sampler) == (20, "ref.npz", 40, "euler")
    ddpm = dataclasses.replace(cfg, objective="ddpm")
    assert SampleGridHook.from_settings(ddpm, vae="v", vae_config=None, seed=0, objective="ddpm").sampler == "ddim"
    assert FidHook.from_settings(ddpm, vae="v", vae_config=None, seed=0, objective="ddpm").sampler == "ddpm"


def test_a_setting_added_since_a_checkpoint_counts_as_its_default():
    from dit_pipeline.train.resume import config_changes

    old = TrainConfig(shards="s", run_dir="r").to_dict()
    del old["fid_labels"]                      # written before the setting existed
    assert config_changes(old, TrainConfig(shards="s", run_dir="r").to_dict()) == {}
    new = TrainConfig(shards="s", run_dir="r", fid_labels="equal", lr=2e-4).to_dict()
    assert config_changes(old, new) == {"fid_labels": [None, "equal"], "lr": [1e-4, 2e-4]}
