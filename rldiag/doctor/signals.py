"""The per-step signals the doctor's rules read: logged metrics (``metrics.jsonl``) and the
metrics of a recompute under the run's settings, among them the engine's health signals
(:func:`rldiag.engine.metrics.signal_metrics`):

- ``rldiag/mask/credit_cut_fraction``: share of actor tokens (mask 1) followed, later in their
  row, by a mask-0 position (a tool observation): under verl 0.8.0's REINFORCE++ (a reward-to-go
  that resets at mask 0, ``compute_reinforce_plus_plus_outcome_advantage``) such a token receives
  none of the outcome reward.
- ``rldiag/advantages/centre_offset``: masked mean of the advantages over their masked
  (population) standard deviation; 0 when every advantage is 0.
- ``rldiag/rewards/kl_sign_flip_fraction``: among non-aborted rows with a nonzero score, the
  share whose summed ``token_level_rewards`` has the opposite sign of the summed score (only
  with ``algorithm.use_kl_in_reward``).

The table grows step by step (``rldiag doctor --follow`` adds each new step to the same table):
each metric of each source is a pair of growable numpy arrays, so that a rule evaluated after
every step reads arrays rather than rebuilding them from Python dicts. A table given ``keep``
(the metrics its rules read, :func:`rldiag.doctor.evaluators.metrics_read`) stores those alone:
a step costs 16 bytes per kept metric and source (its step and value) plus 16 bytes per source
for the count of steps, rather than 16 bytes for each of the ~180 metrics a recompute gives.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping

import numpy as np

from rldiag.doctor.evaluators import Series


class Column:
    """One metric of one source: ``steps`` (int64, increasing, unique) and ``values``
    (float64), in buffers that double when full. Appending a later step is O(1) amortised; a
    step seen again overwrites its value (a resumed run logs a step twice: the later line wins);
    an earlier step not seen yet is inserted (O(n), rare)."""

    __slots__ = ("_steps", "_values", "n", "version")

    def __init__(self, capacity: int = 64) -> None:
        self._steps = np.empty(capacity, dtype=np.int64)
        self._values = np.empty(capacity, dtype=np.float64)
        self.n = 0
        self.version = 0  # bumped on every change: caches of merged series compare it

    @property
    def steps(self) -> np.ndarray:
        return self._steps[:self.n]

    @property
    def values(self) -> np.ndarray:
        return self._values[:self.n]

    def set(self, step: int, value: float) -> None:
        n = self.n
        self.version += 1
        if n and step <= self._steps[n - 1]:
            i = int(np.searchsorted(self._steps[:n], step))
            if self._steps[i] == step:
                self._values[i] = value
                return
            self._steps = np.insert(self._steps[:n], i, step)
            self._values = np.insert(self._values[:n], i, value)
            self.n = n + 1
            return
        if n == len(self._steps):
            self._steps = np.concatenate([self._steps, np.empty(max(n, 64), dtype=np.int64)])
            self._values = np.concatenate([self._values, np.empty(max(n, 64), dtype=np.float64)])
        self._steps[n] = step
        self._values[n] = value
        self.n = n + 1


def _tail(steps: np.ndarray, values: np.ndarray, tail: int) -> tuple[np.ndarray, np.ndarray]:
    """The shortest suffix holding ``tail`` finite values (all of it when it has fewer): what a
    rule with ``window: tail`` looks at, without touching the steps before it."""
    k = tail
    while k < len(values) and np.count_nonzero(np.isfinite(values[-k:])) < tail:
        k *= 2
    return steps[-k:], values[-k:]


class SignalTable:
    """``metric -> Column`` per source (``logged``, ``recomputed``). ``keep``: the metrics stored
    (None: every one); a metric left out reads as never given (``series`` gives None), and every
    step given counts in ``logged_steps`` / ``recomputed_steps`` all the same."""

    def __init__(self, keep: Collection[str] | None = None) -> None:
        self.keep = None if keep is None else frozenset(keep)
        self.logged: dict[str, Column] = {}
        self.recomputed: dict[str, Column] = {}
        self._steps = {"logged": Column(), "recomputed": Column()}  # the steps given, each once
        self._merged: dict[str, tuple[tuple[int, int], Series]] = {}  # name -> (versions, logged over recomputed)

    def _add(self, source: str, step: int, values: Mapping[str, float]) -> None:
        columns = self.logged if source == "logged" else self.recomputed
        for k, v in values.items():
            if self.keep is not None and k not in self.keep:
                continue
            col = columns.get(k)
            if col is None:
                col = columns[k] = Column()
            col.set(int(step), float(v))
        if values:
            self._steps[source].set(int(step), 0.0)

    def add_logged(self, step: int, values: Mapping[str, float]) -> None:
        self._add("logged", step, values)

    def add_recomputed(self, step: int, values: Mapping[str, float]) -> None:
        self._add("recomputed", step, values)

    def series(self, name: str, source: str = "any", tail: int | None = None) -> Series | None:
        """The metric over steps: ``logged``, ``recomputed``, or ``any`` (logged where present,
        recomputed elsewhere). None when the chosen source has no value. ``tail``: only the last
        steps, as many as hold ``tail`` finite values (a rule's ``window``)."""
        lg = self.logged.get(name) if source in ("any", "logged") else None
        rc = self.recomputed.get(name) if source in ("any", "recomputed") else None
        if lg is not None and rc is not None:
            s = self._merge(name, lg, rc)
        elif lg is not None or rc is not None:
            col = lg if lg is not None else rc
            assert col is not None
            s = Series(name=name, steps=col.steps, values=col.values, source="logged" if lg is not None else "recomputed")
        else:
            return None
        if tail is not None and len(s.steps) > tail:
            steps, values = _tail(s.steps, s.values, tail)
            s = Series(name=s.name, steps=steps, values=values, source=s.source)
        return s

    def _merge(self, name: str, lg: Column, rc: Column) -> Series:
        versions = (lg.version, rc.version)
        cached = self._merged.get(name)
        if cached is not None and cached[0] == versions:
            return cached[1]
        steps = np.union1d(lg.steps, rc.steps)
        values = np.empty(len(steps), dtype=np.float64)
        values[np.searchsorted(steps, rc.steps)] = rc.values
        values[np.searchsorted(steps, lg.steps)] = lg.values  # logged wins where both have the step
        used = ["logged"] + (["recomputed"] if len(steps) > lg.n else [])
        s = Series(name=name, steps=steps, values=values, source="+".join(used))
        self._merged[name] = (versions, s)
        return s

    @property
    def first_step(self) -> int | None:
        """The first step given by either source (None: none yet)."""
        firsts = [int(c.steps[0]) for c in self._steps.values() if c.n]
        return min(firsts) if firsts else None

    @property
    def logged_steps(self) -> int:
        return self._steps["logged"].n

    @property
    def recomputed_steps(self) -> int:
        return self._steps["recomputed"].n
