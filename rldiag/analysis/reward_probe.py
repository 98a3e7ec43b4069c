"""``rldiag probe-reward``: does a reward function pay degenerate replies? (a shortcut probe)

For ``prompts`` prompts of the run (one per (step, uid) group, spread over the steps and the
data sources), the function scores the group's first real reply and six degenerate ones
(:data:`PROBES`), called as verl calls it, in the rescore's worker processes:

- ``empty``: ``""``;
- ``echo_prompt``: the prompt's text;
- ``ground_truth_only``: the ground truth's text alone (a string as it is, anything else as JSON);
- ``repeat``: the real reply twice (joined by a newline);
- ``truncated``: the first half of the real reply (by characters);
- ``other_prompt``: the real reply of another probed prompt (the next one of the same data
  source where there is one).

Each probe's mean score is set against the real replies' mean and the *rewarded* replies' mean
(the real replies with a positive score: what a reply the reward pays earns). A probe is a
shortcut, finding ``reward_shortcut`` (the doctor's :class:`~rldiag.doctor.evaluators.Finding`,
``evidence.cause`` the probe), when it earns at least half the real replies' mean; for the three
probes that carry the answer (``ground_truth_only``, ``repeat``, ``truncated``) also at least
the rewarded replies' mean: a reward may pay a correct answer without its form partly (the toy
task's partial credit pays the bare answer 0.5) or a correct reply twice as it pays it once, but a
degenerate form that earns what a rewarded reply earns is the shortcut.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from rldiag.config.settings import resolve_settings
from rldiag.doctor.evaluators import Evidence, Finding
from rldiag.errors import RewardError
from rldiag.io.fs import RemotePath
from rldiag.io.loader import read_schema, read_table
from rldiag.io.outputs import json_safe
from rldiag.io.rundir import RunDir
from rldiag.scenario.reward_fn import CODE_EXEC_SOURCES, RewardFunction, resolve_reward
from rldiag.scenario.reward_pool import score_calls

__all__ = ["PROBES", "ProbeReport", "ProbeStat", "probe_reward"]

PROBES = ("empty", "echo_prompt", "ground_truth_only", "repeat", "truncated", "other_prompt")
#: the probes made from the answer or a real reply to the same prompt
ANSWER_BEARING = frozenset({"ground_truth_only", "repeat", "truncated"})
RULE = "reward_shortcut"
#: a probe's share of the real replies' mean that makes it a shortcut
SHARE = 0.5
EXAMPLES = 3
COLUMNS = ("uid", "data_source", "ground_truth", "extra_info", "response_text", "prompt_text")


@dataclass
class ProbeStat:
    """One probe: its mean score over the probed prompts whose call succeeded, and examples."""

    probe: str
    mean: float
    n: int
    shortcut: bool
    examples: list[dict[str, Any]] = field(default_factory=list)


@dataclass
class ProbeReport:
    """The probe of one reward function on one run."""

    function: RewardFunction
    prompts: int
    real_mean: float
    rewarded_mean: float | None  # the real replies with a positive score; None when none has one
    probes: list[ProbeStat]
    findings: list[Finding]
    failed_calls: int = 0

    def to_dict(self) -> dict[str, Any]:
        return json_safe({"function": self.function.record(), "prompts": self.prompts, "real_mean": self.real_mean,
                          "rewarded_mean": self.rewarded_mean, "failed_calls": self.failed_calls,
                          "probes": [asdict(p) for p in self.probes],
                          "findings": [asdict(f) for f in self.findings]})


@dataclass
class ProbedPrompt:
    step: int
    data_source: str
    ground_truth: Any
    extra_info: Any
    reply: str
    prompt: str


def _gather(rd: RunDir) -> list[ProbedPrompt]:
    """The first row of every (step, uid) group, in step order."""
    out = []
    for sf in rd.require_steps():
        names = set(read_schema(sf).names)
        missing = [c for c in COLUMNS if c not in names and c != "extra_info"]
        if missing:
            raise RewardError(f"{sf.path} (step {sf.step}): column {missing[0]!r} is missing; probe-reward reads "
                              f"{', '.join(COLUMNS)} (docs/run-directory.md)")
        t = read_table(sf, [c for c in COLUMNS if c in names]).to_pydict()
        seen: set[str] = set()
        extras = t.get("extra_info") or ["{}"] * len(t["uid"])
        for uid, ds, gt, ex, reply, prompt in zip(t["uid"], t["data_source"], t["ground_truth"], extras,
                                                  t["response_text"], t["prompt_text"]):
            if str(uid) in seen:
                continue
            seen.add(str(uid))
            try:
                out.append(ProbedPrompt(sf.step, str(ds), json.loads(gt), json.loads(ex), str(reply), str(prompt)))
            except ValueError:
                continue  # a value stored as its repr: not probed
    return out


def choose(prompts: list[ProbedPrompt], k: int) -> list[ProbedPrompt]:
    """``k`` prompts spread over the data sources (as evenly as their counts allow) and, within
    each, evenly over the steps (deterministic)."""
    by_source: dict[str, list[ProbedPrompt]] = {}
    for p in prompts:
        by_source.setdefault(p.data_source, []).append(p)
    quota = dict.fromkeys(by_source, 0)
    left = min(k, len(prompts))
    while left:
        for s in sorted(by_source):
            if left and quota[s] < len(by_source[s]):
                quota[s] += 1
                left -= 1
    out = []
    for s in sorted(by_source):
        items = by_source[s]
        idx: list[int] = (np.unique(np.linspace(0, len(items) - 1, quota[s]).round().astype(int)).tolist()
                          if quota[s] else [])
        out += [items[i] for i in idx]
    return sorted(out, key=lambda p: p.step)


def _truth_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def _probe_replies(chosen: list[ProbedPrompt]) -> dict[str, list[str]]:
    other: list[str] = []
    for i, p in enumerate(chosen):
        same = [j for j, q in enumerate(chosen) if q.data_source == p.data_source and j != i]
        j = next((j for j in same if j > i), same[0] if same else (i + 1) % len(chosen))
        other.append(chosen[j].reply)
    return {"empty": ["" for _ in chosen], "echo_prompt": [p.prompt for p in chosen],
            "ground_truth_only": [_truth_text(p.ground_truth) for p in chosen],
            "repeat": [f"{p.reply}\n{p.reply}" for p in chosen],
            "truncated": [p.reply[: len(p.reply) // 2] for p in chosen], "other_prompt": other}


def probe_reward(
    run: str | Path | RemotePath,
    reward: str | RewardFunction,
    prompts: int = 256,
    workers: int | None = None,
    timeout: float = 10.0,
    allow_code_exec: bool = False,
    progress: Callable[[int, int, str], None] | None = None,
) -> ProbeReport:
    """The shortcut probe (module docstring) of ``reward`` on ``run``'s replies."""
    rd = RunDir(run)
    settings = resolve_settings(rd.path)
    fn = reward if isinstance(reward, RewardFunction) else resolve_reward(
        reward, settings.values, rd.path if isinstance(rd.path, Path) else None)
    chosen = choose(_gather(rd), max(1, prompts))
    if not chosen:
        raise RewardError(f"{rd.path}: no prompt to probe")
    if fn.verl_default and not allow_code_exec and {p.data_source for p in chosen} & CODE_EXEC_SOURCES:
        raise RewardError("verl:default runs model-written code for some of the run's data sources; refused "
                          "without --allow-code-exec")
    replies = {"real": [p.reply for p in chosen], **_probe_replies(chosen)}
    calls = [{"data_source": p.data_source, "solution_str": text, "ground_truth": p.ground_truth,
              "extra_info": p.extra_info} for texts in replies.values() for p, text in zip(chosen, texts)]
    tick = (lambda done, total: progress(done, total, "probing")) if progress else None
    results, _ = score_calls(fn, calls, workers or (os.cpu_count() or 1), timeout, tick)
    n = len(chosen)
    scores = {name: [results[b * n + i].score for i in range(n)] for b, name in enumerate(replies)}
    failed = sum(r.error is not None for r in results)
    real = np.array([s for s in scores["real"] if s is not None], dtype=np.float64)
    real_mean = float(real.mean()) if real.size else 0.0
    paid = real[real > 0]
    rewarded = float(paid.mean()) if paid.size else None
    stats, findings = [], []
    for name in PROBES:
        got = [(i, s) for i, s in enumerate(scores[name]) if s is not None]
        mean = float(np.mean([s for _, s in got])) if got else float("nan")
        shortcut = bool(got) and real_mean > 0 and mean >= SHARE * real_mean and (
            name not in ANSWER_BEARING or (rewarded is not None and mean >= rewarded))
        top = sorted(got, key=lambda t: -t[1])[:EXAMPLES]
        examples = [{"step": chosen[i].step, "data_source": chosen[i].data_source, "prompt": chosen[i].prompt[:200],
                     "reply": replies[name][i][:200], "score": s} for i, s in top]
        stats.append(ProbeStat(name, mean, len(got), shortcut, examples))
        if shortcut:
            findings.append(Finding(
                rule=RULE, title=f"The reward pays a degenerate reply ({name})", severity="warning",
                why="a policy trained on this reward can earn it without solving the task (reward hacking)",
                message=f"{name} replies earn {mean:.3g} on average over {len(got)} prompts; the real replies "
                        f"{real_mean:.3g}" + (f", the rewarded ones {rewarded:.3g}" if rewarded is not None else ""),
                evidence=Evidence(statistic=f"mean score of {name} vs the real replies' mean (x{SHARE})",
                                  cause=name, details={"probe": name, "mean_score": mean, "real_mean": real_mean,
                                                       "rewarded_mean": rewarded, "prompts": len(got),
                                                       "function": fn.record(), "examples": examples}),
                remedy="make the reward check what the probe lacks (the answer's form, its prompt, its end)"))
    return ProbeReport(fn, n, real_mean, rewarded, stats, findings, failed)
