"""``rldiag doctor RUN --follow``: the doctor of a run that is still writing, as events.

:class:`DoctorFollower` is the I/O edge around :class:`~rldiag.doctor.live.LiveDoctor`: each
:meth:`DoctorFollower.poll_once` reads the lines ``metrics.jsonl`` completed since the last poll
(:class:`~rldiag.io.rundir.MetricsTail`: from a byte offset, a torn last line kept until its
newline arrives) and, when the listing of batch files changed (a new file, or one whose size or
mtime moved), recomputes the steps new to the live doctor (or whose file changed); a file that
cannot be read yet (still being written) fails and is retried when it changes. The first look
writes the scenario of these overrides as ``rldiag recompute`` does (every unchanged step it
holds reused); later looks compute only those steps, in memory, in the packs that recompute puts
them in (:func:`rldiag.scenario.memory.recompute_changed`), so that neither a look's work nor its
memory grows with the run (rewriting the scenario costs every step at every look). Under an
adaptive KL controller every look writes the scenario (each step depends on every step before
it). What the follower keeps per step: each metric's value and step in the live doctor's numpy
columns (:class:`~rldiag.doctor.signals.SignalTable`) and the batch file's state. Each new step
is then evaluated in step order, so an event carries the step at which it happened.

The first poll catches up with what is on disk: every step is evaluated in order, and what holds
at the end is reported once, as a ``fired`` event at the step from which it has held without a
break (:meth:`LiveDoctor.standing`); so ``--follow`` on a finished run prints the findings
``rldiag doctor`` prints, each once.

Counterfactuals: after a finding (not ``info``) fires, a background thread computes what the
settings that address it would change (``counterfactual_fn``, by default
:func:`rldiag.doctor.counterfactual.counterfactuals`), one at a time,
the latest finding first; its result becomes a ``changed`` event on the next poll.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from rldiag.config.settings import resolve_settings, scenario_slug
from rldiag.doctor.evaluators import Finding
from rldiag.doctor.live import EVENTS, HealthEvent, Identity, LiveDoctor, LiveDoctorError, identity
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import load_rules
from rldiag.errors import RldiagError
from rldiag.executors.klchain import is_adaptive
from rldiag.io.fs import RemotePath
from rldiag.io.outputs import json_safe
from rldiag.io.rundir import MetricsTail, RunDir
from rldiag.scenario.memory import recompute_changed
from rldiag.scenario.plan import check_settings
from rldiag.scenario.recompute import recompute as run_recompute

#: ``fn(run, rule, finding, overrides=..., device=...) -> [{"settings", "metric", "statistic", "window", "with", "without"}]``
CounterfactualFn = Callable[..., list[dict[str, Any]]]
EventFn = Callable[[HealthEvent], None]


def default_counterfactual_fn() -> CounterfactualFn:
    """:func:`rldiag.doctor.counterfactual.counterfactuals` (imported when first needed: it brings
    the sweep engine)."""
    from rldiag.doctor.counterfactual import counterfactuals

    fn: CounterfactualFn = counterfactuals
    return fn


class CounterfactualWorker:
    """One background thread running ``fn(run, rule, finding, overrides=..., device=...)`` for
    the findings submitted, one at a time, the latest submitted first. :meth:`results` hands back
    what finished: ``(identity, counterfactual or None, error or None)``."""

    def __init__(self, fn: CounterfactualFn, run: Path | RemotePath, overrides: Mapping[str, Any], device: str) -> None:
        self.fn, self.run, self.overrides, self.device = fn, run, dict(overrides), device
        self._jobs: list[tuple[Identity, Rule, Finding]] = []
        self._done: list[tuple[Identity, list[dict[str, Any]] | None, str | None]] = []
        self._busy = False
        self._closed = False
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, key: Identity, rule: Rule, finding: Finding) -> None:
        with self._cv:
            self._jobs.append((key, rule, finding))
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="rldiag-counterfactual", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._jobs and not self._closed:
                    self._cv.wait()
                if self._closed:
                    return
                key, rule, finding = self._jobs.pop()  # the latest first
                self._busy = True
            cf: list[dict[str, Any]] | None = None
            error = None
            try:
                cf = list(self.fn(self.run, rule, finding, overrides=self.overrides, device=self.device))
            except Exception as exc:  # noqa: BLE001  (a worker thread: the error is reported, the follow goes on)
                error = f"{type(exc).__name__}: {exc}"
            with self._cv:
                self._done.append((key, cf, error))
                self._busy = False
                self._cv.notify_all()

    def results(self) -> list[tuple[Identity, list[dict[str, Any]] | None, str | None]]:
        with self._cv:
            out, self._done = self._done, []
        return out

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._jobs) + int(self._busy)

    def wait(self, timeout: float | None = None) -> bool:
        """Block until every submitted job finished (True), or ``timeout`` seconds passed (False)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._jobs and not self._busy, timeout)

    def close(self) -> None:
        """Stop after the job in progress (a daemon thread: an exit does not wait for it)."""
        with self._cv:
            self._closed = True
            self._jobs.clear()
            self._cv.notify_all()


@dataclass
class FollowSummary:
    """How a follow ended: ``reason`` (``idle`` | ``stopped``), the last step evaluated, the
    steps read, the events by kind, the findings active at the end (as ``--json`` prints them),
    each rule's level, and what could not be done (recompute, counterfactuals)."""

    run: str
    reason: str
    step: int | None
    logged_steps: int
    recomputed_steps: int
    events: dict[str, int]
    active: list[Finding]
    levels: dict[str, int]
    recompute_error: str | None = None
    recompute_failed: dict[int, str] = field(default_factory=dict)
    counterfactual_errors: dict[str, str] = field(default_factory=dict)  # "rule[/cause]" -> error
    skipped_lines: int = 0  # metrics.jsonl lines that are not metrics

    @property
    def healthy(self) -> bool:
        return not any(f.severity != "info" for f in self.active)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["healthy"] = self.healthy
        d["recompute_failed"] = {str(k): v for k, v in self.recompute_failed.items()}
        return json_safe(d)


class DoctorFollower:
    """Follow one run: :meth:`poll_once` for one look (tests drive it directly), :meth:`follow`
    for the loop. ``on_event`` gets each event as soon as it is known (before the poll's
    recompute, for events of logged metrics). ``counterfactual_fn``: None takes
    :func:`default_counterfactual_fn`; ``counterfactual=False`` turns them off. ``clock``: the
    monotonic clock of the idle timeout."""

    def __init__(self, run: str | Path | RemotePath, overrides: Mapping[str, Any] | None = None, *,
                 rules_files: Iterable[str | Path] = (), rules: list[Rule] | None = None, recompute: bool = True,
                 device: str = "cpu", on_event: EventFn | None = None, counterfactual: bool = True,
                 counterfactual_fn: CounterfactualFn | None = None, clock: Callable[[], float] = time.monotonic):
        self.rd = RunDir(run)
        self.overrides = dict(overrides or {})
        rule_list = rules if rules is not None else load_rules(rules_files)
        self.settings = resolve_settings(self.rd.path, self.overrides)
        effective = {**self.settings.values, **self.settings.resolved()}
        self.doctor = LiveDoctor(effective, rule_list, run=self.rd, engine_settings=self.settings)
        self.rules = {r.id: r for r in rule_list}
        self.tail = MetricsTail(self.rd.metrics_file)
        self.device = device
        self.on_event = on_event
        self.clock = clock
        self.recompute_error: str | None = None
        self.recompute_failed: dict[int, str] = {}
        self.recompute = recompute
        if recompute:
            try:
                check_settings(self.settings)
            except RldiagError as exc:
                self.recompute_error = f"{type(exc).__name__}: {exc}"
        self._save_tokens = bool(self.rd.layout.scenario(scenario_slug(self.overrides)).token_steps())
        self._listing: dict[int, tuple[int, int]] | None = None  # batch files at the last recompute
        self._listing_changed = False
        self._fed: dict[int, tuple[int, int]] = {}  # steps given to the doctor, with their file's state
        self.counts = dict.fromkeys(EVENTS, 0)  # the events handed out, by kind
        fn = (counterfactual_fn or default_counterfactual_fn()) if counterfactual else None
        self.worker = CounterfactualWorker(fn, self.rd.path, self.overrides, device) if fn is not None else None
        self.counterfactual_errors: dict[str, str] = {}
        self.caught_up = False
        self.last_news = clock()

    # ---- one look --------------------------------------------------------------------------------

    def poll_once(self) -> list[HealthEvent]:
        """Read what is new, evaluate each new step, hand out the events (also to ``on_event``)."""
        # the counterfactuals finished since the last poll, first: one submitted by this poll's own
        # fired events arrives with the next poll, whatever the worker thread's speed (not in this
        # poll when it happens to be quick: the events a poll hands out do not depend on a race)
        out: list[HealthEvent] = self._emit(self._counterfactual_events())
        logged = self._read_logged()
        if self.caught_up:
            out += self._emit(self._evaluate(logged, {}))
            recomputed = self._read_recomputed()
            out += self._emit(self._evaluate({}, recomputed))
        else:  # catch up: every step on disk, with both sources, then what holds at the end
            recomputed = self._read_recomputed()
            self._evaluate(logged, recomputed)
            self.caught_up = True
            out += self._emit(self.doctor.standing())
        if logged or recomputed or self._listing_changed:
            self.last_news = self.clock()  # idle from here: the poll's own work is not time without news
        return out

    def _emit(self, events: list[HealthEvent]) -> list[HealthEvent]:
        for ev in events:
            self.counts[ev.event] += 1
            if ev.event == "fired" and self.worker is not None and ev.finding.severity != "info":
                rule = self.rules.get(ev.finding.rule)
                if rule is not None:
                    self.worker.submit(identity(ev.finding), rule, ev.finding)
            if self.on_event is not None:
                self.on_event(ev)
        return events

    def _read_logged(self) -> dict[int, dict[str, float]]:
        out: dict[int, dict[str, float]] = {}
        for step, values in self.tail.read():
            out.setdefault(step, {}).update({k: float(v) for k, v in values.items()})
        return out

    def _read_recomputed(self) -> dict[int, dict[str, float]]:
        """The recomputed metrics of the steps whose batch file is new or changed (none when the
        listing did not change since the last look)."""
        self._listing_changed = False
        if not self.recompute or self.recompute_error is not None:
            return {}
        listing = self.rd.listing()
        if not listing or listing == self._listing:
            return {}
        self._listing, self._listing_changed = listing, True
        changed = [s for s in listing if self._fed.get(s) != listing[s]]
        try:
            metrics, failed = self._recompute(changed)
        except RldiagError as exc:  # retried at the next change of the listing
            self.recompute_failed = {s: f"{type(exc).__name__}: {exc}" for s in listing if s not in self._fed}
            return {}
        self.recompute_failed = failed
        out: dict[int, dict[str, float]] = {}
        for step in changed:
            if step in metrics:
                out[step] = metrics[step]
                self._fed[step] = listing[step]
        return out

    def _recompute(self, changed: list[int]) -> tuple[dict[int, dict[str, float]], dict[int, str]]:
        """``(step -> metrics, step -> why it failed)`` of the ``changed`` steps (at least). The
        first look (and every look under an adaptive KL controller, whose steps each depend on
        every step before them) writes the scenario as ``rldiag recompute`` does, reusing what
        it holds; later looks compute only the changed steps, in memory, in the packs that
        recompute would put them in (:func:`rldiag.scenario.memory.recompute_changed`), so
        that a look costs the same at step 10,000 as at step 10."""
        if not self.caught_up or is_adaptive(self.settings):
            rep = run_recompute(self.rd.path, self.overrides, device=self.device, save_tokens=self._save_tokens)
            metrics = {int(row["step"]): {k: float(v) for k, v in row.items() if k != "step" and v is not None}
                       for row in rep.metrics}
            return metrics, dict(rep.steps_failed)
        got = recompute_changed(self.rd, self.settings, changed, device=self.device)
        return got.metrics, dict(got.failed)

    def _evaluate(self, logged: dict[int, dict[str, float]], recomputed: dict[int, dict[str, float]]) -> list[HealthEvent]:
        """Add the new data and evaluate: data of steps up to the last one evaluated first (late
        batches, a step logged again), then each later step in order with its own data."""
        last = self.doctor.step
        steps = sorted(set(logged) | set(recomputed))
        late = [s for s in steps if last is not None and s <= last]
        new = [s for s in steps if last is None or s > last]
        for s in late:
            self._add(s, logged, recomputed)
        events: list[HealthEvent] = []
        for s in new:
            self._add(s, logged, recomputed)
            events += self.doctor.evaluate(s)
        if late and not new and last is not None:
            events += self.doctor.evaluate(last)
        return events

    def _add(self, step: int, logged: dict[int, dict[str, float]], recomputed: dict[int, dict[str, float]]) -> None:
        if step in logged:
            self.doctor.add_logged(step, logged[step])
        if step in recomputed:
            self.doctor.add_recomputed(step, recomputed[step])

    def _counterfactual_events(self) -> list[HealthEvent]:
        if self.worker is None:
            return []
        events = []
        for key, cf, error in self.worker.results():
            label = key[0] + (f"/{key[1]}" if key[1] else "")
            if error is not None:
                self.counterfactual_errors[label] = error
            elif cf and key in self.doctor:
                try:
                    events.append(self.doctor.attach_counterfactual(key, cf))
                except LiveDoctorError:  # cleared meanwhile: nothing to attach it to
                    continue
        return events

    # ---- the loop ----------------------------------------------------------------------------------

    def follow(self, poll_seconds: float = 0.5, idle_timeout: float | None = None,
               stop: threading.Event | None = None, sleep: Callable[[float], Any] | None = None) -> FollowSummary:
        """Poll every ``poll_seconds`` until ``stop`` is set or ``idle_timeout`` seconds passed
        without a new metrics line or batch file (never, when None: Ctrl-C raises
        ``KeyboardInterrupt`` out of here). At an idle end the counterfactuals still running are
        waited for and their events handed out. ``sleep``: default ``stop.wait``."""
        stop = stop or threading.Event()
        wait = sleep or stop.wait
        try:
            while True:
                self.poll_once()
                if stop.is_set():
                    return self.summary("stopped")
                if idle_timeout is not None and self.clock() - self.last_news >= idle_timeout:
                    if self.worker is not None:
                        self.worker.wait()
                        self._emit(self._counterfactual_events())
                    return self.summary("idle")
                wait(poll_seconds)
        finally:
            self.close()

    def close(self) -> None:
        if self.worker is not None:
            self.worker.close()

    def summary(self, reason: str) -> FollowSummary:
        d = self.doctor
        return FollowSummary(run=str(self.rd.path), reason=reason, step=d.step, logged_steps=d.table.logged_steps,
                             recomputed_steps=d.table.recomputed_steps, events=dict(self.counts), active=d.active(),
                             levels=d.levels(), recompute_error=self.recompute_error,
                             recompute_failed=dict(self.recompute_failed),
                             counterfactual_errors=dict(self.counterfactual_errors), skipped_lines=len(self.tail.skipped))
