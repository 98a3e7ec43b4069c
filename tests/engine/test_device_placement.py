"""Every tensor the engine makes is on the batch's device.

On a GPU, a tensor created without ``device=`` lands on the CPU and the first operation that
mixes it with the batch's CUDA tensors fails (``actor/kl_coef`` once failed every step of
``--device cuda`` with ``use_kl_loss``). No GPU is needed to find such a tensor: under torch's
default-device context ``torch.device("meta")`` a tensor created without a device is a meta
tensor, while the batch's tensors stay on the CPU, so mixing the two raises, and a meta tensor
that is never mixed shows up in the results. The engine runs so on every bundled sample and with
every entry of every registry it dispatches on, all optional paths switched on."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from rldiag.config.settings import resolve_settings
from rldiag.config.verl_versions import RELEASES
from rldiag.engine.advantage import ESTIMATORS
from rldiag.engine.aggregation import AGG_MODES
from rldiag.engine.batch import pack
from rldiag.engine.kl import KL_ESTIMATORS
from rldiag.engine.pipeline import PresetKLCoefficients, Result, recompute_batch
from rldiag.engine.policy_loss import POLICY_LOSSES
from rldiag.engine.requirements import recompute_columns
from rldiag.engine.rollout_correction import IS_LEVELS, RS_OPTIONS
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir
from rldiag.synth import SynthSpec, write_synth_run

SAMPLES = sorted(p for p in (Path(__file__).resolve().parents[2] / "samples").iterdir() if (p / "run.yaml").is_file())

RC = "algorithm.rollout_correction."
LOSS_RC = "actor_rollout_ref.actor.policy_loss.rollout_correction."
#: every optional path on: reward KL, KL loss, IS weights with batch normalisation, rejection,
#: mini-batches cut into micro-batches over two balanced DP ranks
EVERYTHING = {
    "algorithm.use_kl_in_reward": True,
    "actor_rollout_ref.actor.use_kl_loss": True,
    "actor_rollout_ref.actor.entropy_coeff": 0.001,
    RC + "rollout_is": "token",
    RC + "rollout_is_threshold": 2.0,
    RC + "rollout_is_batch_normalize": True,
    RC + "rollout_rs": "token_k1",
    RC + "rollout_rs_threshold": 4.0,
    "rldiag.dp_size": 2,
    "rldiag.mini_batch_size": 8,
    "rldiag.micro_batch_size": 2,
    "trainer.balance_batch": True,
    "algorithm.gdpo_reward_keys": "acc,fmt",
    "algorithm.gdpo_reward_weights": "1,0.5",
}

CASES: dict[str, dict] = {}
for _name in ESTIMATORS.names():
    CASES[f"estimator={_name}"] = {"algorithm.adv_estimator": _name}
for _name in POLICY_LOSSES.names():
    CASES[f"loss_mode={_name}"] = {
        "actor_rollout_ref.actor.policy_loss.loss_mode": _name,
        LOSS_RC + "rollout_is": "token", LOSS_RC + "rollout_is_batch_normalize": True,
        LOSS_RC + "rollout_rs": "token_k1", LOSS_RC + "rollout_rs_threshold": 4.0,
        "actor_rollout_ref.actor.policy_loss.dro_beta": 0.1,
    }
for _name in KL_ESTIMATORS.names():
    CASES[f"kl={_name}"] = {"algorithm.kl_penalty": _name, "actor_rollout_ref.actor.kl_loss_type": _name}
for _name in AGG_MODES.names():
    CASES[f"agg={_name}"] = {"actor_rollout_ref.actor.loss_agg_mode": _name, "critic.loss_agg_mode": _name}
for _name in IS_LEVELS.names():
    CASES[f"rollout_is={_name}"] = {RC + "rollout_is": _name}
    CASES[f"rollout_is={_name},icepop"] = {RC + "rollout_is": _name, RC + "rollout_is_threshold": "0.5_2.0"}
for _name in RS_OPTIONS.names():
    CASES[f"rollout_rs={_name}"] = {RC + "rollout_rs": _name}
CASES["rollout_rs=all"] = {RC + "rollout_rs": ",".join(RS_OPTIONS.names())}
for _version in RELEASES:
    CASES[f"verl={_version}"] = {"rldiag.verl_version": _version}
CASES["kl_ctrl=adaptive"] = {"algorithm.kl_ctrl.type": "adaptive"}
CASES["bypass_mode"] = {RC + "bypass_mode": True}
CASES["one segment per step"] = {"rldiag.dp_size": 1, "rldiag.mini_batch_size": None, "rldiag.micro_batch_size": None}
CASES["dp ranks only"] = {"rldiag.mini_batch_size": None, "rldiag.micro_batch_size": None}
CASES["no trainer.use_v1"] = {"trainer.use_v1": False}
CASES["filters"] = {"algorithm.filter_groups.enable": True, "algorithm.filter_groups.metric": "acc",
                    "rldiag.filter.gate_column": "fmt", "rldiag.filter.gate_min": 0.5,
                    "rldiag.filter.drop_no_signal_from_denominator": True, "algorithm.adv_estimator": "grpo"}


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory):
    spec = SynthSpec(steps=2, prompts=4, n=4, max_len=40, seed=3, extra_columns=True)
    return write_synth_run(tmp_path_factory.mktemp("device") / "run", spec)


def _assert_on_cpu(result: Result) -> None:
    for kind, tensors in (("metric", result.metrics), ("token output", result.tokens), ("row output", result.rows)):
        for name, t in tensors.items():
            assert t.device.type == "cpu", f"{kind} {name!r} is on {t.device}, not on the batch's device"


def run_on_meta_default(run: Path, overrides: dict, kl_state=None) -> Result:
    """Load every step of ``run`` (on the CPU, as the loader does), then pack and recompute them
    with ``meta`` as torch's default device."""
    settings = resolve_settings(run, overrides)
    batches = [load_step(sf, settings, recompute_columns(settings)).batch for sf in RunDir(run).require_steps()]
    with torch.device("meta"):
        result = recompute_batch(pack(batches), settings, kl_state)
    _assert_on_cpu(result)
    return result


@pytest.mark.parametrize("case", list(CASES))
def test_engine_creates_every_tensor_on_the_batch_device(synth_run, case):
    result = run_on_meta_default(synth_run, {**EVERYTHING, **CASES[case]})
    assert "actor/pg_loss" in result.metrics and "advantages" in result.tokens
    assert "rldiag/turns/1/tokens" in result.metrics and "turn" in result.tokens and "loss_weight" in result.rows


@pytest.mark.parametrize("sample", SAMPLES, ids=lambda p: p.name)
@pytest.mark.parametrize("extra", [False, True], ids=["own settings", "everything on"])
def test_engine_on_every_sample(sample, extra):
    settings = resolve_settings(sample, {})
    result = run_on_meta_default(sample, EVERYTHING if extra else {})
    if settings["actor_rollout_ref.actor.use_kl_loss"] or extra:
        assert "actor/kl_coef" in result.metrics


def test_preset_kl_coefficients_on_the_batch_device(synth_run):
    result = run_on_meta_default(synth_run, EVERYTHING, PresetKLCoefficients([0.01, 0.02]))
    assert result.metrics["actor/reward_kl_penalty_coeff"].tolist() == pytest.approx([0.01, 0.02])


def test_a_tensor_without_a_device_is_caught():
    """The premise of this module: under the meta default, a tensor made without ``device=`` and
    mixed with the CPU batch's tensors raises."""
    x = torch.ones(3)
    with torch.device("meta"), pytest.raises(RuntimeError):
        _ = torch.full((3,), 2.0) * x
    with torch.device("meta"):
        assert (torch.full((3,), 2.0, device=x.device) * x).device == x.device
