"""A calibration corpus of real toy training runs, each with its labels.

``python -m rldiag.toy.corpus OUT [--size small|full] [--seed S]`` trains the toy trainer
(:class:`rldiag.toy.trainer.ToyTrainer`: a real transformer, real GRPO / PPO updates, sampling on a
bfloat16 copy of the policy) into one run directory per case, ``OUT/<case>/``, each with
``labels.json``, and writes ``OUT/manifest.json``. A pathology is produced by the training itself
(its settings), never by editing tensors afterwards, and its onset is read from the run's own
logged series by the rule its label states (:mod:`rldiag.toy.onsets`).

The cases come from one declared table, :data:`CASES` (kind -> :class:`Family`): each family
builds its ``index``-th case from a seed and a length, says how many runs each size holds and
labels a trained run from its logged series. Other modules add families with :func:`register`;
the modules named in :data:`EXTENSIONS` are imported (when present) before the table is read, so
a family module only has to call :func:`register` at import. Built in:

- ``healthy``: GRPO and GAE, KL loss / KL in reward / none, learning rates inside the stable
  range, temperature 1.0 and 0.8 (the trainer recomputes its log-probs at the rollout's
  temperature: processed log-probs), the calculator tool on and off;
- ``entropy_collapse``: no entropy bonus, a learning rate 30 times the default and a colder
  rollout (temperature 0.7);
- ``divergence``: a learning rate 300 times the default (0.3): the policy degenerates;
- ``reward_hacking``: the reward pays a length bonus the task's correctness does not
  (``ToyConfig.length_bonus``); the true correctness is logged as ``rldiag/label/true_score``.

Every run's rollout copy is bfloat16, so every label lists the ``precision`` gap cause at
severity ``info`` (the expected diagnosis, not a health finding). The split is by seed: odd seeds
``test``, even ``train``.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rldiag.errors import RldiagError
from rldiag.io.run_layout import RunLayout
from rldiag.toy.config import ToyConfig, grpo_tool, ppo_gae
from rldiag.toy.onsets import RULES, collapse_onset, divergence_onset, hacking_onset

#: the small networks and batches every corpus run uses (a run takes seconds per step on a CPU)
SMALL = dict(prompts_per_step=4, n=4, mini_batch_prompts=2, d_model=32, n_layers=1)
PRECISION_INFO = {"kind": "rollout_gap", "cause": "precision", "severity": "info",
                  "note": "the rollout samples on a bfloat16 copy of the float32 policy"}
#: steps per run, per size
STEPS = {"small": 15, "full": 30}
SIZES = tuple(STEPS)
#: modules that add families to :data:`CASES` when imported (each one optional)
EXTENSIONS = ("rldiag.toy.corpus_gap",)

Series = dict[str, list[float]]


@dataclass(frozen=True)
class Case:
    """One run of the corpus: its directory name, the planted kind (``healthy`` or a pathology),
    its trainer settings and the settings that describe it (``tags``)."""

    name: str
    kind: str
    config: ToyConfig
    tags: dict[str, Any] = field(default_factory=dict)

    @property
    def split(self) -> str:
        return "test" if self.config.seed % 2 else "train"


@dataclass(frozen=True)
class Family:
    """One kind of run in the corpus.

    ``build(seed, steps, index) -> Case``: the ``index``-th run (``index`` cycles over the
    family's settings); ``runs``: how many runs each size holds (``{"small": 2, "full": 24}``;
    consecutive seeds, so they alternate between the splits); ``label(case, steps, series) ->
    pathologies``: the ``labels.json`` pathologies of a trained run from its logged series
    (``metric -> per-step values``, ``steps`` the step numbers), each ``{"kind", "cause"?,
    "onset_step", "signal", "onset_rule", "implied_by"?}``; ``onset_step`` None when the training did
    not produce it; ``steps``: the run length per size where :data:`STEPS`' is too short."""

    kind: str
    build: Callable[[int, int, int], Case]
    runs: dict[str, int]
    label: Callable[[Case, list[int], Series], list[dict[str, Any]]]
    healthy: bool = False
    steps: dict[str, int] = field(default_factory=dict)  # per size, where :data:`STEPS` is too short for the kind


#: the corpus's table: kind -> family, in the order runs are generated
CASES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add ``family`` to :data:`CASES` (a kind registered twice is an error)."""
    if family.kind in CASES and CASES[family.kind] != family:
        raise RldiagError(f"corpus family {family.kind!r} registered twice")
    unknown = set(family.runs) - set(SIZES)
    if unknown:
        raise RldiagError(f"corpus family {family.kind!r}: unknown sizes {sorted(unknown)}; sizes are {SIZES}")
    CASES[family.kind] = family
    return family


def load_extensions() -> None:
    """Import the family modules of :data:`EXTENSIONS` that exist (they register at import)."""
    for name in EXTENSIONS:
        if importlib.util.find_spec(name) is not None:
            importlib.import_module(name)


def onset_pathology(kind: str, signal: str, at: int | None, steps: list[int], **more: Any) -> dict[str, Any]:
    """A ``labels.json`` pathology whose onset (0-based index ``at`` into ``steps``) was read by
    the rule :data:`rldiag.toy.onsets.RULES` names for ``kind``."""
    return {"kind": kind, **more, "onset_step": None if at is None else steps[at], "signal": signal,
            "onset_rule": RULES[kind]}


# ---- the built-in families


def healthy_case(seed: int, steps: int, variant: int) -> Case:
    """The ``variant``-th healthy run. Consecutive variants come in pairs with the same settings
    (their seeds differ by one, so one run of each pair is in each split); the pair ``p =
    variant // 2`` cycles over estimator, KL, learning rate, temperature and tool."""
    p = variant // 2
    kl = ("loss", "reward", "none")[p % 3]
    est = "grpo" if p % 2 == 0 else "gae"
    make = grpo_tool if est == "grpo" else ppo_gae
    changes: dict[str, Any] = dict(SMALL, steps=steps, seed=seed, actor_lr=(1e-3, 3e-3)[(p // 2) % 2],
                                   temperature=(1.0, 0.8)[(p // 4) % 2], tool=p % 5 != 4,
                                   use_kl_loss=kl == "loss", use_kl_in_reward=kl == "reward")
    if est == "gae":
        changes["n"] = 1
        changes["prompts_per_step"] = 16
        changes["mini_batch_prompts"] = 8
    cfg = make(**changes)
    tags = {"adv_estimator": est, "kl": kl, "actor_lr": cfg.actor_lr, "temperature": cfg.temperature, "tool": cfg.tool}
    return Case(f"healthy-{variant:02d}-s{seed}", "healthy", cfg, tags)


def entropy_collapse_case(seed: int, steps: int, index: int = 0) -> Case:
    cfg = grpo_tool(**SMALL, steps=steps, seed=seed, actor_lr=3e-2, entropy_coeff=0.0, temperature=0.7)
    return Case(f"entropy_collapse-s{seed}", "entropy_collapse", cfg,
                {"actor_lr": cfg.actor_lr, "entropy_coeff": 0.0, "temperature": 0.7})


def divergence_case(seed: int, steps: int, index: int = 0) -> Case:
    cfg = grpo_tool(**SMALL, steps=steps, seed=seed, actor_lr=0.3)
    return Case(f"divergence-s{seed}", "divergence", cfg, {"actor_lr": cfg.actor_lr})


#: the reward-hacking runs: an easy task (sums of 1-2 digits, a tool that never fails, full credit
#: for each right digit in place) whose reward adds this times the share of the response width the
#: actor filled with digits
HACK_BONUS = 1.0
HACK_LR = 5e-3


def reward_hacking_case(seed: int, steps: int, index: int = 0) -> Case:
    """GRPO whose reward adds ``HACK_BONUS`` x the share of the response width the actor wrote
    as digits (a "shown working" format bonus): digits written after the answer change the
    last number the grader reads, so the bonus and the task's correctness pull apart, and the
    policy trades the second for the first."""
    cfg = grpo_tool(**SMALL, steps=steps, seed=seed, actor_lr=HACK_LR, length_bonus=HACK_BONUS,
                    bonus_digits_only=True, min_digits=1, max_digits=2, tool_failure=0.0, partial_credit=1.0)
    return Case(f"reward_hacking-s{seed}", "reward_hacking", cfg,
                {"actor_lr": cfg.actor_lr, "length_bonus": cfg.length_bonus, "bonus": "digits the actor wrote",
                 "digits": [1, 2], "tool_failure": 0.0, "partial_credit": 1.0})


def no_pathology(case: Case, steps: list[int], series: Series) -> list[dict[str, Any]]:
    return []


def collapse_label(case: Case, steps: list[int], series: Series) -> list[dict[str, Any]]:
    return [onset_pathology("entropy_collapse", "actor/entropy_loss",
                            collapse_onset(series["actor/entropy_loss"]), steps)]


def divergence_label(case: Case, steps: list[int], series: Series) -> list[dict[str, Any]]:
    return [onset_pathology("divergence", "actor/entropy_loss, critic/score/mean",
                            divergence_onset(series["actor/entropy_loss"], series["critic/score/mean"]), steps)]


def hacking_label(case: Case, steps: list[int], series: Series) -> list[dict[str, Any]]:
    return [onset_pathology("reward_hacking", "rldiag/label/true_score, critic/score/mean",
                            hacking_onset(series["rldiag/label/true_score"], series["critic/score/mean"]), steps)]


register(Family("healthy", healthy_case, {"small": 2, "full": 16}, no_pathology, healthy=True))
register(Family("entropy_collapse", entropy_collapse_case, {"small": 2, "full": 24}, collapse_label))
register(Family("divergence", divergence_case, {"small": 2, "full": 24}, divergence_label))
# the true score needs 10-15 steps to turn (the onset rule's windows alone take 10)
register(Family("reward_hacking", reward_hacking_case, {"small": 2, "full": 28}, hacking_label, steps={"small": 22}))


def cases(size: str = "small", seed: int = 0, kinds: list[str] | None = None) -> list[Case]:
    """The corpus's cases, family by family in :data:`CASES` order (``kinds``: only these): the
    ``i``-th run of a family has seed ``seed + 1 + i`` (so a family's runs alternate between
    ``test`` and ``train``) and :data:`STEPS` steps. ``small`` (2 runs of 15 steps per kind)
    is what the tests and the 3-minute bench train; ``full`` has 16 healthy runs (8 per split:
    240 healthy steps in ``test``) and 24 of each pathology (12 per split: at least 10 produced in ``test``), of 30 steps."""
    if size not in STEPS:
        raise RldiagError(f"corpus size must be small or full, not {size!r}")
    load_extensions()
    wanted = list(CASES) if kinds is None else kinds
    unknown = [k for k in wanted if k not in CASES]
    if unknown:
        raise RldiagError(f"unknown corpus kinds {unknown}; the corpus has {list(CASES)}")
    out = []
    for kind in wanted:
        fam = CASES[kind]
        steps = fam.steps.get(size, STEPS[size])
        out += [fam.build(seed + 1 + i, steps, i) for i in range(fam.runs.get(size, 0))]
    return out


def labels(case: Case, steps: list[int], series: Series) -> dict[str, Any]:
    """``labels.json`` of a trained case from its logged series (``metric -> per-step values``)."""
    load_extensions()
    fam = CASES[case.kind]
    return {"name": case.name, "healthy": fam.healthy, "pathologies": fam.label(case, steps, series),
            "info": [PRECISION_INFO], "split": case.split, "seed": case.config.seed, "steps": len(steps),
            "settings": case.tags, "config": case.config.as_dict()}


def train_case(case: Case, out: Path) -> dict[str, Any]:
    """Train ``case`` into ``out / case.name`` and write its ``labels.json``; returns the labels."""
    from rldiag.toy.trainer import ToyTrainer

    run_dir = out / case.name
    steps: list[int] = []
    series: Series = {}

    def keep(step: int, metrics: dict[str, float]) -> None:
        steps.append(step)
        for k, v in metrics.items():
            series.setdefault(k, []).append(float(v))

    ToyTrainer(case.config).run(run_dir, on_step=keep)
    lab = labels(case, steps, series)
    (run_dir / "labels.json").write_text(json.dumps(lab, indent=1) + "\n")
    return lab


def relabel_case(case: Case, out: Path) -> dict[str, Any]:
    """Write ``labels.json`` of an already trained ``case`` from its own ``metrics.jsonl`` (the
    onset rules applied again, nothing retrained); returns the labels."""
    from rldiag.analysis.logged import logged_metrics

    run_dir = out / case.name
    logged = logged_metrics(RunLayout(run_dir).metrics_file)
    steps = sorted(logged)
    series: Series = {}
    for step in steps:
        for k, v in logged[step].items():
            series.setdefault(k, []).append(float(v))
    lab = labels(case, steps, series)
    (run_dir / "labels.json").write_text(json.dumps(lab, indent=1) + "\n")
    return lab


def trained(case: Case, out: Path) -> bool:
    """``out / case.name`` holds this case's finished run: its labels (same config: a setting the
    labels predate counts as its default) and one metrics line per step."""
    run_dir = out / case.name
    try:
        old = json.loads((run_dir / "labels.json").read_text())
        lines = RunLayout(run_dir).metrics_file.read_text().splitlines()
    except (OSError, ValueError):
        return False
    # a setting newer than the run (absent from its labels) had its default when it trained
    defaults, before = ToyConfig().as_dict(), old.get("config") or {}
    same = all(before.get(k, defaults.get(k)) == v for k, v in case.config.as_dict().items())
    return same and len(lines) == case.config.steps


def generate(out: str | Path, selected: list[Case], size: str | None = None, seed: int | None = None,
             reuse: bool = False) -> dict[str, Any]:
    """Train every case of ``selected`` into ``out`` and write ``out/manifest.json``. A pathology
    whose onset never came (the training did not produce it) is listed under ``not_produced``.
    ``reuse``: a case whose finished run is already there (:func:`trained`) is relabelled from
    its logged series instead of trained again."""
    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    runs, missing = [], []
    for case in selected:
        lab = relabel_case(case, root) if reuse and trained(case, root) else train_case(case, root)
        runs.append({"name": case.name, "dir": case.name, "kind": case.kind, "healthy": lab["healthy"],
                     "split": lab["split"], "steps": lab["steps"], "kinds": [p["kind"] for p in lab["pathologies"]]})
        missing += [case.name for p in lab["pathologies"] if p.get("onset_step") is None]
    manifest = {"size": size, "seed": seed, "runs": runs, "not_produced": missing,
                "splits": {s: sum(r["split"] == s for r in runs) for s in ("train", "test")}}
    (root / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rldiag.toy.corpus", description=__doc__.splitlines()[0])
    ap.add_argument("out", help="the corpus directory (one run directory per case, and manifest.json)")
    ap.add_argument("--size", choices=SIZES, default="small")
    ap.add_argument("--seed", type=int, default=0, help="added to every run's seed")
    ap.add_argument("--kind", action="append", help="only this kind of run (repeatable)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1: reproducible)")
    ap.add_argument("--reuse", action="store_true",
                    help="keep the runs already trained in OUT with the same settings (only their labels are written again)")
    args = ap.parse_args(argv)
    import torch

    torch.set_num_threads(args.threads)
    manifest = generate(args.out, cases(args.size, args.seed, args.kind), args.size, args.seed, reuse=args.reuse)
    print(f"{len(manifest['runs'])} runs in {args.out} (train {manifest['splits']['train']}, "
          f"test {manifest['splits']['test']}); pathologies not produced: {', '.join(manifest['not_produced']) or 'none'}")
    return 1 if manifest["not_produced"] else 0


if __name__ == "__main__":
    # run as rldiag.toy.corpus, not __main__: the family modules register into that module's CASES
    from rldiag.toy.corpus import main as corpus_main

    raise SystemExit(corpus_main())
