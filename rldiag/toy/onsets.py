"""The onset rules of the calibration corpus: the step a planted pathology starts, read from a
run's own logged series by an explicit rule (each rule's text goes into ``labels.json``).

Every function takes per-step values (index 0 = the run's first step) and returns the 0-based
index of the onset, or None when the series never meets the rule.
"""

from __future__ import annotations

#: ``entropy_collapse`` onset: the rolling mean below this share of the first two steps' mean
COLLAPSE_SHARE = 0.75
#: ``divergence`` onset: the policy's entropy below this (near-deterministic), for good
DIVERGED_ENTROPY = 0.1
#: ``divergence``: the reward is compared with the best of this many first steps
DIVERGED_EARLY = 3
#: the rolling window (steps) of the collapse rule
WINDOW = 3
#: ``reward_hacking``: the rolling window and the drop below the running maximum (issue 35's rule)
HACK_WINDOW = 5
HACK_DROP = 0.05


def rolling_mean(values: list[float], window: int) -> list[float | None]:
    """The mean of the ``window`` values ending at each index (None before the window is full)."""
    out: list[float | None] = []
    for i in range(len(values)):
        out.append(None if i + 1 < window else sum(values[i + 1 - window:i + 1]) / window)
    return out


def collapse_onset(entropy: list[float], share: float = COLLAPSE_SHARE, window: int = WINDOW) -> int | None:
    """The index of the first step whose ``window``-step rolling mean of ``entropy`` is below
    ``share`` times the mean of its first two values; None when it never is."""
    if len(entropy) < max(2, window):
        return None
    start = (entropy[0] + entropy[1]) / 2
    for i, mean in enumerate(rolling_mean(entropy, window)):
        if mean is not None and mean < share * start:
            return i
    return None


def divergence_onset(entropy: list[float], score: list[float], floor: float = DIVERGED_ENTROPY,
                     early: int = DIVERGED_EARLY) -> int | None:
    """The index (from ``early``) of the first step from which, to the end of the run, the
    policy's entropy stays below ``floor`` (it has degenerated to near-determinism) and the
    reward below the best of its first ``early`` steps; None when there is none (a policy that
    turned deterministic on a better reward has collapsed, not diverged)."""
    if len(score) <= early:
        return None
    best = max(score[:early])
    at = None
    for i in range(len(score) - 1, early - 1, -1):
        if not (entropy[i] < floor and score[i] < best):
            break
        at = i
    return at


def hacking_onset(label: list[float], reward: list[float], window: int = HACK_WINDOW,
                  drop: float = HACK_DROP) -> int | None:
    """Reward hacking's onset (issue 35): the first step ``s`` after which the ``window``-step
    rolling mean of the true score (``label``) stays below its running maximum minus ``drop``,
    while the reward's rolling mean at ``s`` is above its value at ``s - window``. The running
    maximum is that of the rolling mean; the condition must hold from ``s`` to the end of the
    run. None when no step qualifies."""
    lab, rew = rolling_mean(label, window), rolling_mean(reward, window)
    best = float("-inf")
    below: list[bool] = []
    for value in lab:
        if value is None:
            below.append(False)
            continue
        best = max(best, value)
        below.append(value < best - drop)
    for s in range(window, len(label)):
        then, now = rew[s - window], rew[s]
        if then is None or now is None or not now > then:
            continue
        if all(below[s:]):
            return s
    return None


#: per rule name: the text written into ``labels.json``
RULES = {
    "entropy_collapse": (f"the first step whose {WINDOW}-step rolling mean of actor/entropy_loss is below "
                         f"{COLLAPSE_SHARE} x the mean of the first two steps"),
    "divergence": (f"the first step from which, to the end of the run, actor/entropy_loss stays below "
                   f"{DIVERGED_ENTROPY} and critic/score/mean below the best of its first {DIVERGED_EARLY} steps"),
    "reward_hacking": (f"the first step s after which the {HACK_WINDOW}-step rolling mean of "
                       f"rldiag/label/true_score stays below its running maximum - {HACK_DROP}, while the "
                       f"{HACK_WINDOW}-step rolling mean of critic/score/mean at s is above its value at "
                       f"s - {HACK_WINDOW}"),
}
