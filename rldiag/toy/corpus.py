"""A calibration corpus of real toy training runs, each with its labels.

``python -m rldiag.toy.corpus OUT [--size small|full] [--seed S]`` trains the toy trainer
(:class:`rldiag.toy.trainer.ToyTrainer`: a real transformer, real GRPO / PPO updates, sampling on a
bfloat16 copy of the policy) into one run directory per case, ``OUT/<case>/``, each with
``labels.json``, and writes ``OUT/manifest.json``. A pathology is produced by the training itself
(its settings), never by editing tensors afterwards, and its onset is read from the run's own
logged series by the rule its label states.

Cases (:func:`cases`):

- ``healthy``: GRPO and GAE, KL loss / KL in reward / none, learning rates inside the stable
  range, temperature 1.0 and 0.8 (the trainer recomputes its log-probs at the rollout's
  temperature: processed log-probs), the calculator tool on and off;
- ``entropy_collapse``: no entropy bonus, a learning rate 30 times the default and a colder
  rollout (temperature 0.7): the policy's entropy falls within a few steps. Onset: the first step
  whose 3-step rolling mean of ``actor/entropy_loss`` is below :data:`COLLAPSE_SHARE` of the mean
  of the first two steps;
- ``divergence``: a learning rate 300 times the default (0.3): the policy degenerates and the
  reward falls to nothing. Onset: the first step from which, to the end of the run,
  ``actor/entropy_loss`` stays below :data:`DIVERGED_ENTROPY` and ``critic/score/mean`` below its
  first step's value.

Every run's rollout copy is bfloat16, so every label lists the ``precision`` gap cause at
severity ``info`` (the expected diagnosis, not a health finding). The split is by seed: odd seeds
``test``, even ``train``.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldiag.errors import RldiagError
from rldiag.toy.config import ToyConfig, grpo_tool, ppo_gae

#: ``entropy_collapse`` onset: the rolling mean below this share of the first two steps' mean
COLLAPSE_SHARE = 0.75
#: ``divergence`` onset: the policy's entropy below this (near-deterministic), for good
DIVERGED_ENTROPY = 0.1
#: the rolling window (steps) of the onset rules
WINDOW = 3
#: the small networks and batches every corpus run uses (a run takes seconds per step on a CPU)
SMALL = dict(prompts_per_step=4, n=4, mini_batch_prompts=2, d_model=32, n_layers=1)
PRECISION_INFO = {"kind": "rollout_gap", "cause": "precision", "severity": "info",
                  "note": "the rollout samples on a bfloat16 copy of the float32 policy"}


@dataclass(frozen=True)
class Case:
    """One run of the corpus: its directory name, the planted kind (``healthy`` or a pathology),
    and its trainer settings."""

    name: str
    kind: str
    config: ToyConfig
    tags: dict[str, Any] = field(default_factory=dict)

    @property
    def split(self) -> str:
        return "test" if self.config.seed % 2 else "train"


def _healthy(seed: int, steps: int, variant: int) -> Case:
    """The ``variant``-th healthy setting (cycling over estimator, KL, learning rate, temperature, tool)."""
    kl = ("loss", "reward", "none")[variant % 3]
    est = "grpo" if variant % 2 == 0 else "gae"
    make = grpo_tool if est == "grpo" else ppo_gae
    changes: dict[str, Any] = dict(SMALL, steps=steps, seed=seed, actor_lr=(1e-3, 3e-3)[(variant // 2) % 2],
                                   temperature=(1.0, 0.8)[(variant // 4) % 2], tool=variant % 5 != 4,
                                   use_kl_loss=kl == "loss", use_kl_in_reward=kl == "reward")
    if est == "gae":
        changes["n"] = 1
        changes["prompts_per_step"] = 16
        changes["mini_batch_prompts"] = 8
    cfg = make(**changes)
    tags = {"adv_estimator": est, "kl": kl, "actor_lr": cfg.actor_lr, "temperature": cfg.temperature, "tool": cfg.tool}
    return Case(f"healthy-{variant:02d}-s{seed}", "healthy", cfg, tags)


def _entropy_collapse(seed: int, steps: int) -> Case:
    cfg = grpo_tool(**SMALL, steps=steps, seed=seed, actor_lr=3e-2, entropy_coeff=0.0, temperature=0.7)
    return Case(f"entropy_collapse-s{seed}", "entropy_collapse", cfg,
                {"actor_lr": cfg.actor_lr, "entropy_coeff": 0.0, "temperature": 0.7})


def _divergence(seed: int, steps: int) -> Case:
    cfg = grpo_tool(**SMALL, steps=steps, seed=seed, actor_lr=0.3)
    return Case(f"divergence-s{seed}", "divergence", cfg, {"actor_lr": cfg.actor_lr})


def cases(size: str = "small", seed: int = 0) -> list[Case]:
    """The corpus's cases: ``small`` 2 healthy runs, 2 entropy collapses and 2 divergences of 10
    steps (one seed of each split); ``full`` 16 healthy runs over the settings (8 per split: 240
    healthy steps in ``test``), and 10 entropy collapses and 10 divergences per split, of 30
    steps. ``seed`` shifts every run's seed."""
    if size == "small":
        steps, healthy, collapse = 10, [(0, seed + 1), (1, seed + 2)], [seed + 1, seed + 2]
    elif size == "full":
        steps = 30
        healthy = [(v, seed + 1 + v) for v in range(16)]
        collapse = [seed + 1 + k for k in range(20)]
    else:
        raise RldiagError(f"corpus size must be small or full, not {size!r}")
    return ([_healthy(s, steps, v) for v, s in healthy] + [_entropy_collapse(s, steps) for s in collapse]
            + [_divergence(s, steps) for s in collapse])


def collapse_onset(entropy: list[float], share: float = COLLAPSE_SHARE, window: int = WINDOW) -> int | None:
    """The index (0-based) of the first step whose ``window``-step rolling mean of ``entropy`` is
    below ``share`` times the mean of its first two values; None when it never is."""
    if len(entropy) < max(2, window):
        return None
    start = (entropy[0] + entropy[1]) / 2
    for i in range(window - 1, len(entropy)):
        if sum(entropy[i - window + 1:i + 1]) / window < share * start:
            return i
    return None


def divergence_onset(entropy: list[float], score: list[float], floor: float = DIVERGED_ENTROPY) -> int | None:
    """The index (0-based, from 1) of the first step from which, to the end of the run, the
    policy's entropy stays below ``floor`` (it has degenerated to near-determinism) and the
    reward below its first step's; None when there is none."""
    at = None
    for i in range(len(score) - 1, 0, -1):
        if not (entropy[i] < floor and score[i] < score[0]):
            break
        at = i
    return at


#: per planted kind: the series its onset is read from, the rule in words, and the rule
ONSETS = {
    "entropy_collapse": ("actor/entropy_loss",
                         f"the first step whose {WINDOW}-step rolling mean of actor/entropy_loss is below "
                         f"{COLLAPSE_SHARE} x the mean of the first two steps",
                         lambda s: collapse_onset(s["actor/entropy_loss"])),
    "divergence": ("actor/entropy_loss, critic/score/mean",
                   f"the first step from which, to the end of the run, actor/entropy_loss stays below "
                   f"{DIVERGED_ENTROPY} and critic/score/mean below its first step's value",
                   lambda s: divergence_onset(s["actor/entropy_loss"], s["critic/score/mean"])),
}


def labels(case: Case, steps: list[int], series: dict[str, list[float]]) -> dict[str, Any]:
    """``labels.json`` of a trained case from its logged series (``metric -> per-step values``)."""
    pathologies: list[dict[str, Any]] = []
    if case.kind in ONSETS:
        signal, rule, onset = ONSETS[case.kind]
        at = onset(series)
        pathologies.append({"kind": case.kind, "signal": signal, "onset_step": None if at is None else steps[at],
                            "onset_rule": rule})
    return {"name": case.name, "healthy": case.kind == "healthy", "pathologies": pathologies,
            "info": [PRECISION_INFO], "split": case.split, "seed": case.config.seed, "settings": case.tags,
            "config": case.config.as_dict()}


def train_case(case: Case, out: Path) -> dict[str, Any]:
    """Train ``case`` into ``out / case.name`` and write its ``labels.json``; returns the labels."""
    from rldiag.toy.trainer import ToyTrainer

    run_dir = out / case.name
    steps: list[int] = []
    series: dict[str, list[float]] = {}

    def keep(step: int, metrics: dict[str, float]) -> None:
        steps.append(step)
        for k, v in metrics.items():
            series.setdefault(k, []).append(float(v))

    ToyTrainer(case.config).run(run_dir, on_step=keep)
    lab = labels(case, steps, series)
    (run_dir / "labels.json").write_text(json.dumps(lab, indent=1) + "\n")
    return lab


def generate(out: str | Path, selected: list[Case]) -> dict[str, Any]:
    """Train every case of ``selected`` into ``out`` and write ``out/manifest.json``. A pathology
    whose onset never came (the training did not produce it) is listed under ``not_produced``."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    runs, missing = [], []
    for case in selected:
        lab = train_case(case, root)
        runs.append({"name": case.name, "dir": case.name, "healthy": lab["healthy"], "split": lab["split"],
                     "kinds": [p["kind"] for p in lab["pathologies"]]})
        missing += [case.name for p in lab["pathologies"] if p.get("onset_step") is None]
    manifest = {"runs": runs, "not_produced": missing,
                "splits": {s: sum(r["split"] == s for r in runs) for s in ("train", "test")}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rldiag.toy.corpus", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the corpus directory (one run directory per case, and manifest.json)")
    ap.add_argument("--size", choices=("small", "full"), default="small")
    ap.add_argument("--seed", type=int, default=0, help="added to every run's seed")
    args = ap.parse_args(argv)
    manifest = generate(args.out, cases(args.size, args.seed))
    print(f"{len(manifest['runs'])} runs in {args.out} (train {manifest['splits']['train']}, "
          f"test {manifest['splits']['test']}); pathologies not produced: {', '.join(manifest['not_produced']) or 'none'}")
    return 1 if manifest["not_produced"] else 0


if __name__ == "__main__":
    raise SystemExit(main())
