"""Health alerts where the user already looks: the doctor's rules run after each captured step
and their verdicts go into the metrics the trainer logs (W&B, TensorBoard, console, file).

Turned on with ``RLDIAG_DOCTOR=1`` next to the capture (``rldiag.capture.verl``), or by handing a
:class:`HealthHook` to the toy trainer. Each step's log gets

- ``rldiag/health/<rule id>``: 0 ok, 1 warning, 2 critical, the highest severity among the rule's
  active findings (severity ``info`` counts 0), for every rule that applies to the run's settings;
- ``rldiag/health/findings``: how many findings are active, ``info`` ones not counted.

Rules on logged metrics see step N's own metrics in the log of step N. Rules on a recomputed
signal (``source: recomputed``, an ``rldiag/...`` metric, kind ``mismatch``) need step N's batch
recomputed: that runs on the capture's writer thread once the step's batch file is written, while
the trainer runs step N+1, so those verdicts appear in the log of step N+1 (the log of N+1
first waits for that recompute: the lag is exactly one step, never more). The last step's
recompute is never in any log (there is no later one).

Nothing here raises into the training loop: a rule or a recompute that fails is reported once
(a ``logging`` warning, once per rule / per cause) and skipped; the run goes on.

``RLDIAG_DOCTOR_STOP=critical`` (or ``warning``): when a finding of that severity or worse is
active at a step's log, the hook asks the trainer to stop after that step (:attr:`HealthHook.stop`:
the rules that asked; ``rldiag.capture.verl`` lowers the trainer's ``total_training_steps``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import torch

from rldiag.doctor.evaluate import evaluate_rules
from rldiag.doctor.evaluators import Finding
from rldiag.doctor.live import LiveDoctor
from rldiag.doctor.rule import Rule
from rldiag.doctor.rules import load_rules
from rldiag.doctor.signals import SignalTable
from rldiag.errors import CaptureError, RldiagError

if TYPE_CHECKING:
    from rldiag.config.settings import Settings

log = logging.getLogger("rldiag.capture.health")

ENV_DOCTOR = "RLDIAG_DOCTOR"
ENV_STOP = "RLDIAG_DOCTOR_STOP"
PREFIX = "rldiag/health/"
FINDINGS_KEY = PREFIX + "findings"
LEVELS = {"info": 0, "warning": 1, "critical": 2}


def env_flag(value: str | None) -> bool:
    """An environment switch: ``1``, ``true``, ``yes``, ``on`` (any case) turn it on."""
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def stop_level(value: str | None) -> int | None:
    """``RLDIAG_DOCTOR_STOP``'s value as the lowest level that stops (``warning`` 1,
    ``critical`` 2); None when unset or empty. Anything else is a :class:`CaptureError`."""
    text = (value or "").strip().lower()
    if not text:
        return None
    if text not in ("warning", "critical"):
        raise CaptureError(f"{ENV_STOP}={value!r}: expected 'critical' or 'warning' (the least severe finding "
                           "that stops training)")
    return LEVELS[text]


class StepDoctor(Protocol):
    """What the hook needs of a live doctor (:class:`rldiag.doctor.live.LiveDoctor`'s interface):
    its data, its evaluation and its verdicts; and its ``rules``, ``table`` and ``settings``, to
    find and leave out a rule whose evaluation raises."""

    rules: list[Rule]
    table: SignalTable
    settings: dict[str, Any]

    def add_logged(self, step: int, values: Mapping[str, float]) -> None: ...

    def add_recomputed(self, step: int, values: Mapping[str, float]) -> None: ...

    def evaluate(self, step: int) -> list[Any]: ...

    def active(self) -> list[Finding]: ...

    def levels(self) -> dict[str, int]: ...


def needs_recompute(rule: Rule) -> bool:
    """Whether ``rule`` reads a signal only a recompute gives."""
    return rule.source == "recomputed" or rule.kind == "mismatch" or (rule.metric or "").startswith("rldiag/")


def _numbers(data: Mapping[str, Any]) -> dict[str, float]:
    """The logged values that are numbers (tensors / numpy scalars unwrapped), the hook's own
    keys left out."""
    out: dict[str, float] = {}
    for key, value in data.items():
        key = str(key)
        if key.startswith(PREFIX) or isinstance(value, (str, bytes)):
            continue
        item = getattr(value, "item", None)
        try:
            out[key] = float(item() if callable(item) and getattr(value, "ndim", 0) == 0 else value)
        except (TypeError, ValueError):
            continue
    return out


def single_thread_torch() -> bool:
    """Make torch's intra-op work on *this* thread single-threaded, leaving every other thread's
    as it was. True when done.

    ``torch.set_num_threads`` sets two things: the calling thread's OpenMP thread count (an
    OpenMP ICV, per thread) and the count a thread starts from the first time it runs a parallel
    op (process-wide). So, with ATen's OpenMP backend only: set 1 here, then put the process-wide
    count back from a helper thread (whose own count is all that helper's call changes). A thread
    that starts its first parallel op in between (microseconds) would start from 1; the training
    thread is past that (:meth:`HealthHook.__init__` runs a ``torch.get_num_threads()`` on it).
    With another backend (a native thread pool, shared by the whole process) nothing is changed
    and False is returned: the recompute then shares torch's pool."""
    if "ATen parallel backend: OpenMP" not in torch.__config__.parallel_info():
        return False
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    helper = threading.Thread(target=torch.set_num_threads, args=(before,), name="rldiag-torch-threads")
    helper.start()
    helper.join()
    return torch.get_num_threads() == 1


def run_settings(run_dir: str | Path) -> tuple[Settings, dict[str, Any]]:
    """The run's settings (``run.yaml`` over the defaults) and the mapping the rules' ``when``
    read (the derived keys resolved, as ``rldiag doctor`` does)."""
    from rldiag.config.settings import resolve_settings

    settings = resolve_settings(Path(run_dir), {})
    return settings, {**settings.values, **settings.resolved()}


DoctorFactory = Callable[[Mapping[str, Any], list[Rule]], StepDoctor]


def build_hook(run_dir: str | Path, submit: Callable[[Callable[[], Any]], Future], *, stop_at: int | None = None,
               make_doctor: DoctorFactory | None = None, rules: list[Rule] | None = None) -> HealthHook:
    """The hook for a capture into ``run_dir`` (its ``run.yaml`` written): the built-in rules
    (or ``rules``) that apply to the run, ``make_doctor(settings, rules)`` (default
    :class:`RuleDoctor`), recomputes queued with ``submit`` when a rule needs one. A run whose
    settings the engine cannot recompute gets the logged-metric rules only (a warning says so)."""
    settings, effective = run_settings(run_dir)
    chosen = [r for r in (rules if rules is not None else load_rules()) if r.applies(effective)]
    doctor = make_doctor(effective, chosen) if make_doctor is not None else LiveDoctor(effective, chosen)
    recompute: StepRecompute | None = None
    if any(needs_recompute(r) for r in chosen):
        try:
            recompute = StepRecompute(run_dir, settings)
        except RldiagError as exc:
            log.warning("rldiag doctor: the run's settings cannot be recomputed, so rules on recomputed signals "
                        "are not evaluated: %s: %s", type(exc).__name__, exc)
    return HealthHook(doctor, chosen, submit=submit, recompute=recompute, stop_at=stop_at)


class StepRecompute:
    """Recompute one captured step from its batch file (``rldiag recompute``'s engine on the CPU,
    under the run's settings, :func:`run_settings`); run on the writer thread, steps in order (an
    adaptive KL controller advances over them as in a full recompute)."""

    def __init__(self, run_dir: str | Path, settings: Settings):
        from rldiag.engine.pipeline import initial_kl_state
        from rldiag.scenario.plan import check_settings

        self.run_dir = Path(run_dir)
        self.settings = settings
        check_settings(self.settings)
        self.kl_state = initial_kl_state(self.settings) if self.settings["algorithm.use_kl_in_reward"] else None
        self.single_threaded: bool | None = None  # set on the first call, on the thread it runs on

    def __call__(self, step: int) -> dict[str, float]:
        from rldiag.io.run_layout import RunLayout
        from rldiag.io.rundir import StepFile
        from rldiag.scenario.memory import recompute_step

        if self.single_threaded is None:
            self.single_threaded = single_thread_torch()
        sf = StepFile(int(step), RunLayout(self.run_dir).batch_file(int(step)))
        _, result = recompute_step(sf, self.settings, self.kl_state, threads=False)
        if result.failed:
            raise CaptureError(f"step {step}: {result.failed.get(int(step), next(iter(result.failed.values())))}")
        return {k: float(v[0]) for k, v in result.metrics.items()}


class HealthHook:
    """The doctor in the training loop. Per step, on the training thread: :meth:`on_log` (before
    the trainer's log call: the health keys to add to its metrics) and :meth:`after_step` (after
    the step's batch is handed to the writer: its recompute is queued on the writer thread).

    ``doctor``: a :class:`StepDoctor`; ``rules``: the rules it evaluates (to decide whether any
    needs a recompute); ``submit``: runs a function on the capture's writer thread after what is
    queued (``RunWriter.run_on_writer``), None for no recompute; ``recompute``: step -> its
    recomputed metrics; ``stop_at``: the lowest level that stops (1 warning, 2 critical)."""

    def __init__(self, doctor: StepDoctor, rules: list[Rule], *,
                 submit: Callable[[Callable[[], Any]], Future] | None = None,
                 recompute: Callable[[int], Mapping[str, float]] | None = None, stop_at: int | None = None):
        self.doctor = doctor
        self.recomputed_rules = [r.id for r in rules if needs_recompute(r)]
        self.submit = submit if (recompute is not None and self.recomputed_rules) else None
        self.recompute = recompute
        self.stop_at = stop_at
        self.stop: list[str] = []  # the rules that asked to stop (at the last on_log)
        self._pending: list[tuple[int, Future]] = []
        self._warned: set[str] = set()
        torch.get_num_threads()  # this (the training) thread's torch thread count is now its own

    def _warn_once(self, key: str, msg: str, *args: Any) -> None:
        if key not in self._warned:
            self._warned.add(key)
            log.warning(msg, *args)

    def _recompute_quietly(self, step: int) -> Mapping[str, float] | None:
        assert self.recompute is not None
        try:
            return self.recompute(step)
        except Exception as exc:  # noqa: BLE001 - a failed recompute skips that step's signals
            self._warn_once("recompute", "rldiag doctor: the recompute of step %d failed; rules %s skip it "
                            "(reported once): %s: %s", step, ", ".join(self.recomputed_rules), type(exc).__name__,
                            exc)
            return None

    def after_step(self, step: int) -> None:
        """Step ``step``'s batch is queued: queue its recompute behind it (writer thread)."""
        if self.submit is None:
            return
        try:
            self._pending.append((int(step), self.submit(lambda: self._recompute_quietly(int(step)))))
        except Exception as exc:  # noqa: BLE001 - a closed or failed writer: no recompute, training goes on
            self._warn_once("submit", "rldiag doctor: cannot queue step %d's recompute: %s: %s", step,
                            type(exc).__name__, exc)

    def on_log(self, step: int, data: Mapping[str, Any]) -> dict[str, int]:
        """The health keys for step ``step``'s log: the recomputes of earlier steps taken in
        (waited for), ``data``'s numbers added, the rules evaluated. Never raises; {} when the
        doctor itself failed."""
        try:
            return self._on_log(int(step), data)
        except Exception as exc:  # noqa: BLE001 - the doctor never stops training by failing
            self._warn_once("evaluate", "rldiag doctor: evaluating step %d failed; no health keys (reported "
                            "once): %s: %s", step, type(exc).__name__, exc)
            return {}

    def _on_log(self, step: int, data: Mapping[str, Any]) -> dict[str, int]:
        while self._pending and self._pending[0][0] < step:
            done, future = self._pending.pop(0)
            values = future.result()  # waits on the writer thread's own completion
            if values:
                self.doctor.add_recomputed(done, values)
        self.doctor.add_logged(step, _numbers(data))
        self._evaluate(step)
        levels = {k: int(v) for k, v in self.doctor.levels().items()}
        active = [f for f in self.doctor.active() if LEVELS.get(f.severity, 0) > 0]
        out = {PREFIX + rule: level for rule, level in levels.items()}
        out[FINDINGS_KEY] = len(active)
        self.stop = (sorted({f.rule for f in active if LEVELS.get(f.severity, 0) >= self.stop_at})
                     if self.stop_at is not None else [])
        return out

    def stop_message(self, step: int, when: str = "after this step") -> str:
        """The line that says why training stops after ``step``: each rule that asked, its
        severity, title and what was seen."""
        found = {f.rule: f for f in self.doctor.active() if f.rule in self.stop}
        what = "; ".join(f"{rule} ({f.severity}): {f.title}: {f.message}" for rule, f in found.items())
        level = "critical" if self.stop_at == 2 else "warning"
        return f"rldiag doctor: {ENV_STOP}={level}: stopping training {when}, step {step}: {what}"

    def _evaluate(self, step: int) -> None:
        """``doctor.evaluate(step)``; when it raises, each rule is tried alone (on the doctor's
        table, leaving its state alone), the ones that raise are reported (once per rule) and
        left out of this step's evaluation, and the others are evaluated."""
        try:
            self.doctor.evaluate(step)
            return
        except Exception:  # noqa: BLE001 - found rule by rule below
            pass
        rules = list(self.doctor.rules)
        good = []
        for rule in rules:
            try:
                evaluate_rules([rule], self.doctor.table, self.doctor.settings)
            except Exception as exc:  # noqa: BLE001 - this rule is skipped at this step
                self._warn_once(f"rule:{rule.id}", "rldiag doctor: rule %s failed at step %d and is skipped "
                                "(reported once): %s: %s", rule.id, step, type(exc).__name__, exc)
            else:
                good.append(rule)
        self.doctor.rules = good
        try:
            self.doctor.evaluate(step)
        finally:
            self.doctor.rules = rules  # tried again next step; its level stays 0 while it fails

    def close(self) -> None:
        """Forget queued recomputes (their results would appear in no log)."""
        for _, future in self._pending:
            future.cancel()
        self._pending.clear()

