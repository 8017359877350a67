"""`--v-target clamped` (dit.flow_predictions.ClampedVelocityPrediction, NanoGen's velocity target): the option, its
refusals with the exact messages, the plan's line, and the resume rule through the checkpoint parts (a checkpoint
records the target; a run asking for another one is refused, old checkpoints read as the plain target)."""
from __future__ import annotations

import pytest

from dit_pipeline.common.errors import ConfigError, UserError
from dit_pipeline.sample.grid import run_prediction
from dit_pipeline.train.config import TrainConfig
from dit_pipeline.train.setting_parts import ObjectivePart
from dit_pipeline.train.plan import objective_line
from tests.train.conftest import invoke_train

FLOW_ONLY = ("--v-target clamped is the velocity target of the flow and meanflow objectives (NanoGen's): add "
             "--objective flow or meanflow, or drop --v-target (--objective {} has its own)")
NOT_X = ("--v-target clamped is a velocity-predicting network's target; --prediction x already trains toward "
         "(x - x_t) / max(1 - t, --t-eps): drop --v-target")


def _cfg(**kw) -> TrainConfig:
    return TrainConfig(shards="s", run_dir="r", **kw)


@pytest.mark.parametrize("settings,problems", [
    ({"v_target": "clamped"}, [FLOW_ONLY.format("ddpm")]),
    ({"v_target": "clamped", "objective": "imf", "model": "iMF-B/2"}, [FLOW_ONLY.format("imf")]),
    ({"v_target": "clamped", "objective": "flow", "prediction": "x"}, [NOT_X]),
    ({"v_target": "nano", "objective": "flow"}, ["--v-target must be one of plain, clamped, got 'nano'"]),
    ({"v_target": "clamped", "objective": "flow", "t_eps": 0.0}, ["--t-eps must be in (0, 1), got 0.0"]),
])
def test_the_target_is_refused_where_it_means_nothing(settings, problems):
    with pytest.raises(ConfigError) as e:
        _cfg(**settings).validate()
    assert e.value.problems == problems


def test_the_cli_option_reaches_the_config_and_its_refusal_is_a_usage_error(tmp_path):
    r = invoke_train(["--shards", tmp_path / "none", "--run-dir", tmp_path / "run", "--objective", "flow",
                      "--prediction", "x", "--v-target", "clamped"])
    assert r.exit_code == 2 and NOT_X in r.output and "Traceback" not in r.output
    assert not (tmp_path / "run").exists()
    _cfg(objective="flow", v_target="clamped", t_eps=0.05).validate()  # NanoGen's setting is valid


def test_the_plan_states_the_target():
    assert objective_line(_cfg(objective="flow", v_target="clamped")) == (
        "  objective   flow (linear interpolant, velocity prediction, target (x - x_t) / max(1 - t, 0.05); training "
        "times uniform); blocks as in DiT")
    assert "velocity prediction; training" in objective_line(_cfg(objective="flow"))


def test_a_resume_with_another_target_is_refused_and_old_checkpoints_read_as_plain():
    clamped = _cfg(objective="flow", v_target="clamped").to_dict()
    plain = _cfg(objective="flow").to_dict()
    saved_clamped = ObjectivePart("flow", clamped).state_dict()
    saved_plain = ObjectivePart("flow", plain).state_dict()
    assert saved_clamped == {"objective": "flow", "time_shift": 1.0, "prediction": {"kind": "v", "t_eps": 0.05}}
    assert saved_plain == {"objective": "flow", "time_shift": 1.0}
    ObjectivePart("flow", clamped).check(saved_clamped, "c.pt")  # the same target continues
    ObjectivePart("flow", plain).check({"objective": "flow"}, "c.pt")  # a checkpoint from before the key: plain
    with pytest.raises(UserError) as e:
        ObjectivePart("flow", clamped).check(saved_plain, "c.pt")
    assert str(e.value) == (
        "checkpoint c.pt was trained with --prediction v (recorded None), this run asks for --prediction v "
        "--v-target clamped --t-eps 0.05; resume with the recorded --prediction, --v-target and --t-eps or use a "
        "new --run-dir")
    with pytest.raises(UserError) as e:
        ObjectivePart("flow", _cfg(objective="flow", v_target="clamped", t_eps=0.1).to_dict()).check(saved_clamped,
                                                                                                      "c.pt")
    assert str(e.value).startswith(
        "checkpoint c.pt was trained with --prediction v --v-target clamped --t-eps 0.05 (recorded {'kind': 'v', "
        "'t_eps': 0.05}), this run asks for --prediction v --v-target clamped --t-eps 0.1; ")
    with pytest.raises(UserError, match=r"^checkpoint c.pt was trained with --prediction x --t-eps 0.05 \(recorded "):
        ObjectivePart("flow", clamped).check({**saved_clamped, "prediction": {"kind": "x", "t_eps": 0.05}}, "c.pt")


def test_the_trainers_grids_read_the_runs_record():
    assert run_prediction(_cfg(objective="flow", v_target="clamped").to_dict()) == {"kind": "v", "t_eps": 0.05}
    assert run_prediction(_cfg(objective="flow").to_dict()) is None
