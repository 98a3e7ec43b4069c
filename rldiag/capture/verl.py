"""Capture from verl's own trainers (the V1 ``PPOTrainer`` and the legacy ``RayPPOTrainer``)
with no change to the training code.

Turned on from the environment of the process that runs the trainer (verl runs it in a Ray
actor, the ``TaskRunner``)::

    export VERL_USE_EXTERNAL_MODULES=rldiag.capture.verl   # verl imports it in every process
    export RLDIAG_CAPTURE_DIR=/abs/path/runs/exp1          # where the run directory goes
    python -m verl.trainer.main_ppo ...

``verl/__init__.py`` imports the modules named in ``VERL_USE_EXTERNAL_MODULES`` in every
process that imports verl, Ray actors included; importing this module with
``RLDIAG_CAPTURE_DIR`` set calls :func:`install`. Code that builds its own trainer can call
``install(run_dir)`` itself, in the process that calls ``fit``.

:func:`install` patches, when they are imported (or at once when they already are):

- ``fit`` of both trainers: opens a :class:`~rldiag.capture.RunWriter` with the trainer's
  config (``run.yaml``, with ``rldiag.capture.verl_version`` = ``verl.__version__``, the trainer
  kind and V1's ``trainer_mode``) and closes it when ``fit`` returns (V1's ``fit`` returns at
  the last step without ``on_train_end``);
- ``compute_rollout_correction_and_add_to_batch`` (``rollout_corr_helper``, and V1's own
  reference to it): keeps the mask *before* rejection, written as ``loss_mask``;
- the end of the advantage block: legacy ``ray_trainer.compute_advantage`` (its DataProto),
  V1 ``PPOTrainer._compute_advantage`` (the fields read back from the TransferQueue after the
  trainer wrote advantages and returns, its divisibility-padding rows dropped, each row's place
  in the trainer's padded batch kept as ``batch_position``). Each call is one ``write_batch``
  of ``trainer.global_steps``; the ``separate_async`` trainer's several calls per step become
  the parts of that step. Each row's weight versions (verl's ``max_global_steps`` /
  ``min_global_steps``: in the DataProto's non-tensor batch, in V1's row tags) become
  ``policy_version`` / ``policy_version_min`` when every row of the step has them;
- ``verl.utils.tracking.Tracking.log``, the trainers' last act of a step: the metrics go to
  ``metrics.jsonl`` and then ``RunWriter.sync()`` runs, so each step is on disk, fsynced, when
  it ends (a kill loses at most the step in flight; no exit hook is relied on). A training step
  (its metrics carry ``training/global_step``) that ends with no batch captured is warned (a
  capture that silently records nothing is a bug) and counted.

The capture never stops training (``on_error="warn"``, :mod:`rldiag.capture.writer`): a fault
(a full disk, a removed directory, a batch it cannot read, a trainer with no tokenizer for
``RLDIAG_CAPTURE_TOKENS``, verl's file logger pointed at the capture's ``metrics.jsonl``) is
warned once and counted in the step's logged metrics (``rldiag/capture/dropped_steps``,
``rldiag/capture/errors``, from the first fault on); ``install(on_error="raise")`` raises them
instead. ``RLDIAG_DOCTOR_STOP`` is the one deliberate stop.

``RLDIAG_CAPTURE_EVERY=N``, ``RLDIAG_CAPTURE_GROUPS=K`` (or a share in (0, 1)) and
``RLDIAG_CAPTURE_MAX_GB=X`` set the capture policy (:mod:`rldiag.capture.policy`): the batches
of every N-th step (and of the first and the last, ``total_training_steps`` read at each step),
K whole prompt groups of each, batch capture stopped at X GB; a step the policy leaves out is
not read back from the trainer and is no fault (its ``rldiag/capture/rows`` is 0).

``RLDIAG_CAPTURE_TOKENS=1`` also stores each response's and each prompt's token strings
(``response_tokens``, ``prompt_tokens``, with the trainer's tokenizer). ``RLDIAG_DOCTOR=1`` runs
the doctor's rules at each step's ``Tracking.log`` and logs ``rldiag/health/*`` with the step's
metrics; ``RLDIAG_DOCTOR_STOP=critical`` (or ``warning``) stops training on such a finding
(:mod:`rldiag.capture.health`, docs/capture.md). verl is never imported
by rldiag otherwise; its code is only wrapped, never copied.
"""

from __future__ import annotations

import functools
import importlib.abc
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from rldiag.capture.config import plain
from rldiag.capture.faults import CaptureWarning
from rldiag.capture.fields import VERSION_SOURCES
from rldiag.capture.health import (
    ENV_DOCTOR,
    ENV_RULES,
    ENV_STOP,
    DoctorFactory,
    HealthHook,
    build_hook,
    env_flag,
    stop_level,
)
from rldiag.capture.policy import ENV_EVERY, ENV_GROUPS, ENV_MAX_GB, parse_every, parse_groups, parse_max_gb
from rldiag.capture.writer import RunWriter, batch_rows
from rldiag.doctor.rule import Rule
from rldiag.errors import CaptureError
from rldiag.io.run_layout import RunLayout

ENV_DIR = "RLDIAG_CAPTURE_DIR"
ENV_TOKENS = "RLDIAG_CAPTURE_TOKENS"

LEGACY_MODULE = "verl.trainer.ppo.ray_trainer"
V1_MODULE = "verl.trainer.ppo.v1.trainer_base"
CORRECTION_MODULE = "verl.trainer.ppo.rollout_corr_helper"
TRACKING_MODULE = "verl.utils.tracking"
_CORRECTION_FN = "compute_rollout_correction_and_add_to_batch"

#: The fields a V1 step's capture reads back from the TransferQueue; the TransferQueue leaves
#: out the ones a run does not have (no critic: no ``values``, ...), as verl's own reads rely on.
V1_FIELDS = ("uid", "prompts", "responses", "response_mask", "rm_scores", "token_level_rewards", "old_log_probs",
             "ref_log_prob", "values", "rollout_log_probs", "advantages", "returns")
#: The per-row, non-tensor fields a reward function reads (and V1's ``extra_fields``, whose
#: ``reward_extra_info`` holds the reward manager's components), read back with a V1 step's batch
#: when the TransferQueue holds them (:mod:`rldiag.capture.reward_inputs`).
V1_REWARD_FIELDS = ("data_source", "reward_model", "extra_info", "extra_fields")

#: The per-row tags of a V1 batch that hold the weight versions a row was generated with (the
#: legacy trainer's agent loop puts the same names in the DataProto's non-tensor batch); they
#: become ``policy_version`` and ``policy_version_min`` (``rldiag.capture.fields.VERSION_SOURCES``).
VERSION_TAGS = tuple(name for names in VERSION_SOURCES.values() for name in names)

_WRAPPED = "__rldiag_capture__"

health_log = logging.getLogger("rldiag.capture.health")


class VerlCapture:
    """The capture state of one process: the run directory, the writer (open while ``fit``
    runs), the trainer being captured and the mask kept before rollout rejection."""

    def __init__(self, run_dir: str | Path, tokens: bool = False, doctor: bool = False, stop_at: int | None = None,
                 make_doctor: DoctorFactory | None = None, rules: list[Rule] | None = None, on_error: str = "warn",
                 rules_files: list[str] | None = None, writer_options: dict | None = None,
                 health_options: dict | None = None):
        self.run_dir = Path(run_dir)
        self.writer_options = dict(writer_options or {})
        self.health_options = dict(health_options or {})
        self.tokens = tokens
        self.doctor, self.stop_at, self.make_doctor, self.rules = doctor, stop_at, make_doctor, rules
        self.rules_files = list(rules_files or [])
        self.on_error = on_error
        self.write_metrics = True  # False while verl's own file logger writes metrics.jsonl
        self.health: HealthHook | None = None
        self.stopping_at: int | None = None  # the step after which the doctor stopped training
        self.writer: RunWriter | None = None
        self.trainer: Any = None
        self.kind: str | None = None
        self._pre_mask: torch.Tensor | None = None
        self._position_step: int | None = None  # the step whose parts _position_offset counts
        self._position_offset = 0
        self._lock = threading.Lock()

    # -- fit ----------------------------------------------------------------------------------
    def begin(self, trainer: Any, kind: str) -> None:
        """``fit`` starts: open the writer with the trainer's config."""
        if self.writer is not None:  # a nested fit (a subclass calling super().fit()): one writer
            return
        config = getattr(trainer, "config", None)
        self.write_metrics = self._check_file_logger(config)
        tokenizer = getattr(trainer, "tokenizer", None) if self.tokens else None
        if self.tokens and tokenizer is None:
            self._config_fault(f"{ENV_TOKENS} is set but the trainer has no tokenizer: token text is not stored")
        self.trainer, self.kind, self.stopping_at = trainer, kind, None
        self.writer = RunWriter(self.run_dir, config=run_config(config, kind), tokenizer=tokenizer,
                                **{"on_error": self.on_error, "handle_sigterm": True, **self.policy_options(),
                                   **self.writer_options})
        if self.doctor:
            try:
                self.health = build_hook(self.run_dir, self.writer.run_on_writer, stop_at=self.stop_at,
                                         make_doctor=self.make_doctor, rules=self.rules, rules_files=self.rules_files,
                                         **self.health_options)
            except Exception as exc:  # noqa: BLE001 - no doctor, but training and capture go on
                health_log.warning("rldiag doctor: not started, training goes on without it: %s: %s",
                                   type(exc).__name__, exc)

    def finish(self) -> None:
        """``fit`` returned (or raised): write what is queued and close."""
        writer, self.writer, self.trainer, self._pre_mask = self.writer, None, None, None
        health, self.health = self.health, None
        if health is not None:
            health.close()
        if writer is not None:
            writer.close()

    @property
    def active(self) -> bool:
        return self.writer is not None

    def policy_options(self) -> dict[str, Any]:
        """The capture policy of ``RLDIAG_CAPTURE_EVERY`` / ``_GROUPS`` / ``_MAX_GB``
        (:mod:`rldiag.capture.policy`) as ``RunWriter`` keywords; a variable whose value is
        not valid is a configuration fault (raised with ``on_error="raise"``, else warned and
        left out)."""
        out: dict[str, Any] = {}
        for key, env, parse in (("every", ENV_EVERY, parse_every), ("groups", ENV_GROUPS, parse_groups),
                                ("max_gb", ENV_MAX_GB, parse_max_gb)):
            try:
                out[key] = parse(os.environ.get(env), env)
            except CaptureError as exc:
                self._config_fault(f"{exc}; {env} is left out")
        return out

    def wants_batch(self, rows: int | None = None) -> bool:
        """Whether the policy captures the current step's batch (the trainer's
        ``total_training_steps`` is the last step); a step it leaves out is recorded as skipped
        (with its ``rows``, where known) and its batch is not read (unless the last step is
        unknown)."""
        writer = self._open_writer()
        total = getattr(self.trainer, "total_training_steps", None)
        if isinstance(total, int) and not isinstance(total, bool):
            writer.last_step = total
        if not writer.policy.active or writer.captures(self.step) or writer.last_step is None:
            return True  # (without a last step, write_batch keeps a left-out batch in memory)
        writer.skip(self.step, rows=rows)
        return False

    def _open_writer(self) -> RunWriter:
        """The writer; the patched trainer methods call in only while ``fit`` runs (:attr:`active`)."""
        assert self.writer is not None, "no capture is open (fit is not running)"
        return self.writer

    def _config_fault(self, message: str) -> None:
        """A configuration problem found as ``fit`` starts: raised with ``on_error="raise"``,
        else warned (training and the rest of the capture go on)."""
        if self.on_error == "raise":
            raise CaptureError(message)
        warnings.warn(f"rldiag.capture: {message}", CaptureWarning, stacklevel=4)

    def _check_file_logger(self, config: Any) -> bool:
        """Whether the capture writes ``metrics.jsonl``: not when verl's file logger writes the
        same file (it truncates it when it opens; its lines are the capture's own form)."""
        target = os.environ.get("VERL_FILE_LOGGER_PATH")
        loggers = _get(config, "trainer.logger") or []
        loggers = [loggers] if isinstance(loggers, str) else list(loggers)
        if target and "file" in loggers and Path(target).resolve() == RunLayout(self.run_dir).metrics_file.resolve():
            self._config_fault(
                f"VERL_FILE_LOGGER_PATH={target} is the capture's own metrics.jsonl: verl's file logger "
                "truncates it when it opens and would interleave lines with the capture; the capture leaves "
                "metrics.jsonl to verl's file logger (point it elsewhere to have the capture write it)")
            return False
        return True

    def guarded(self, what: str, fn: Callable[[], Any]) -> None:
        """``fn()``, the capture of one step: with ``on_error="warn"`` a failure is warned once
        and counted (the step's batch is not written), never raised into training."""
        try:
            fn()
        except Exception as exc:  # noqa: BLE001 - the capture never stops training
            writer = self.writer
            if writer is None or self.on_error == "raise":
                raise
            step = self.step
            writer.fault(what, str(writer.batch_path(step)), exc, f"step {step}'s batch is not captured",
                         dropped=1, errors=1, step=step)

    # -- one step -----------------------------------------------------------------------------
    def keep_mask_before_correction(self, data: Any) -> None:
        """Rollout correction is about to rewrite ``response_mask``: keep the rollout's mask."""
        if self.active:
            mask = data.batch["response_mask"]
            self._pre_mask = mask.detach().clone()

    def _take_pre_mask(self, rows: int, width: int) -> torch.Tensor | None:
        pre, self._pre_mask = self._pre_mask, None
        if pre is None:
            return None
        if pre.shape[0] != rows:  # the step's batch is not captured (guarded)
            raise CaptureError(f"step {self.step}: the mask kept before rollout correction has {pre.shape[0]} rows, "
                               f"the batch {rows}")
        if pre.shape[1] >= width:
            return pre[:, :width]
        return torch.nn.functional.pad(pre, (0, width - pre.shape[1]))

    @property
    def step(self) -> int:
        return int(getattr(self.trainer, "global_steps", 0))

    def capture_dataproto(self, data: Any) -> None:
        """The legacy trainer's batch after ``compute_advantage`` (a padded DataProto)."""
        tensors = {str(k): data.batch[k] for k in list(data.batch.keys())}
        mask = tensors["response_mask"]
        pre = self._take_pre_mask(mask.shape[0], mask.shape[1])
        if pre is not None:
            tensors["loss_mask"] = pre.to(mask.device)
        non = reward_inputs_as_passed(dict(data.non_tensor_batch), self.reward_fn_key)
        self._open_writer().write_batch(self.step, SimpleNamespace(batch=tensors, non_tensor_batch=non))

    @property
    def reward_fn_key(self) -> str:
        """The non-tensor field holding each row's data source (verl's ``data.reward_fn_key``)."""
        return str(_get(getattr(self.trainer, "config", None), "data.reward_fn_key") or "data_source")

    def capture_v1(self, tq: Any, meta: Any) -> None:
        """The V1 trainer's batch after ``_compute_advantage``, read back from the TransferQueue
        (nested, one row per key) and handed over padded."""
        data = tq.kv_batch_get(keys=meta.keys, partition_id=meta.partition_id,
                               select_fields=list(V1_FIELDS + V1_REWARD_FIELDS))
        present = set(data.keys())
        reward = {k: _rows_of(data[k]) for k in V1_REWARD_FIELDS if k in present}
        data = data.exclude(*reward) if reward else data
        lengths = data["responses"].offsets().diff()
        prompt_length = data["prompts"].offsets().diff()
        uids = data["uid"]  # a NonTensorStack (tolist) or, in older tensordict releases, a plain sequence
        uid = np.asarray(list(uids.tolist() if hasattr(uids, "tolist") else uids), dtype=object)
        padded = data.exclude("uid", "prompts").to_padded_tensor()
        width = padded["responses"].shape[1]
        tags = list(getattr(meta, "tags", None) or [{}] * len(uid))
        # on the CPU (the uids are a numpy array); each tensor is indexed on its own device
        keep = torch.tensor([not (t or {}).get("is_padding", False) for t in tags], dtype=torch.bool, device="cpu")
        step = {k: padded[k] for k in padded.keys()}
        if "rm_scores" in step and "token_level_scores" not in step:
            step["token_level_scores"] = step.pop("rm_scores")
        pre = self._take_pre_mask(len(uid), width)
        if pre is not None:
            step["loss_mask"] = pre
        step["attention_mask"] = (torch.arange(width, device=lengths.device) < lengths.unsqueeze(1)).long()
        if self.tokens:  # the prompt ids, right-padded here, and the prompt part of the attention mask
            prompts = data["prompts"].to_padded_tensor(padding=0)
            prompt_attn = torch.arange(prompts.shape[1], device=prompt_length.device) < prompt_length.unsqueeze(1)
            step["prompts"] = prompts
            step["attention_mask"] = torch.cat([prompt_attn.to(lengths.device).long(), step["attention_mask"]], 1)
        step = {k: v[keep.to(v.device)] for k, v in step.items()}
        step["prompt_length"] = prompt_length[keep.to(prompt_length.device)]
        # each row's place in the trainer's padded, balanced batch: the update's layout
        # (rldiag/engine/batch_layout.py); the parts of one step follow each other
        if self._position_step != self.step:
            self._position_step, self._position_offset = self.step, 0
        step["batch_position"] = (torch.arange(len(uid), device="cpu") + self._position_offset)[keep.cpu()]
        self._position_offset += len(uid)
        step["uid"] = uid[keep.numpy()]
        kept = keep.numpy()
        step.update({k: v[kept] for k, v in v1_reward_inputs(reward, len(uid)).items()})
        # each row's weight versions, from its tags (verl's own staleness metrics read them there)
        for key in VERSION_TAGS:
            if any(key in (t or {}) for t in tags):
                step[key] = np.array([(t or {}).get(key) for t in tags], dtype=object)[keep.numpy()]
        self._open_writer().write_batch(self.step, step)

    def _captured(self, step: int) -> bool:
        return self.writer is not None and self.writer.parts(step) > 0 and not self.writer.dropped(step)

    def health_keys(self, step: int, data: Any) -> Any:
        """``Tracking.log`` is about to log ``data``: a copy of it with the capture's fault counts
        (once a fault happened) and, with the doctor on and a batch captured for ``step``, the
        ``rldiag/health/*`` keys added; else ``data`` itself."""
        keys: dict[str, Any] = {}
        if self.health is not None and self.writer is not None and self.writer.parts(step) > 0:
            keys.update(self.health.on_log(step, data))
        if self.writer is not None:
            keys.update(self.writer.fault_metrics())
            if self.writer.policy.active:  # the end-of-step barrier first: the step's file size is known
                self.writer.sync()
                keys.update(self.writer.capture_metrics(step))
        return {**data, **keys} if keys else data

    def end_step(self, step: int, data: dict) -> None:
        """``Tracking.log``: the metrics line, then the end-of-step barrier; then, with the
        doctor on, the step's recompute is queued and a stop it asked for is made."""
        writer = self._open_writer()
        if self.write_metrics:
            writer.log_metrics(step, data)
        writer.sync()
        if "training/global_step" in data and writer.parts(step) == 0 and not writer.skipped(step):
            advantage = "compute_advantage" if self.kind == "legacy" else "PPOTrainer._compute_advantage"
            message = (f"rldiag capture: training step {step} ended with no batch captured; the {self.kind} trainer's "
                       f"advantage step ({advantage}) did not run through the capture (a subclass that overrides it "
                       "without calling super()?)")
            if self.on_error == "raise":
                raise CaptureError(message)
            writer.fault("no batch", str(writer.batch_path(step)), None, message, dropped=1, step=step)
        if self.health is not None and self._captured(step):
            self.health.after_step(step)
            if self.health.stop:
                self._stop_after(step, self.health)

    def _stop_after(self, step: int, health: HealthHook) -> None:
        """Lower the trainer's ``total_training_steps`` to ``step``: verl's V1 loop then ends
        after this step, the legacy loop after the next one (docs/capture.md, *Stopping*). Once:
        a later step (the legacy loop's last) does not lower it again."""
        if self.stopping_at is not None:
            return
        self.stopping_at = step
        when = "after this step" if self.kind == "v1" else "after the next step (verl's legacy loop)"
        health_log.warning(health.stop_message(step, when))
        if self.trainer is not None:
            self.trainer.total_training_steps = step


def _rows_of(value: Any) -> np.ndarray:
    """A non-tensor field read back from the TransferQueue (a NonTensorStack, a list or an array)
    as a 1-D object array, one value per row."""
    values = value.tolist() if hasattr(value, "tolist") else list(value)
    out = np.empty(len(values), dtype=object)
    out[:] = values
    return out


def reward_inputs_as_passed(non: dict, reward_fn_key: str = "data_source") -> dict:
    """The non-tensor batch with the reward function's inputs as verl's reward manager passes
    them (``verl/workers/reward_manager/naive.py``, ``NaiveRewardManager.__call__``): the data
    source read under ``data.reward_fn_key``; ``extra_info`` (when the batch has it) with the
    agent loop's ``tool_extra_fields`` merged in and ``num_turns`` (``__num_turns__``) and
    ``rollout_reward_scores`` (``reward_scores``) added. New dicts: the trainer's are not changed."""
    out = dict(non)
    if reward_fn_key != "data_source" and non.get(reward_fn_key) is not None:
        out["data_source"] = non[reward_fn_key]
    infos = non.get("extra_info")
    if infos is None:
        return out
    tool, turns, scores = non.get("tool_extra_fields"), non.get("__num_turns__"), non.get("reward_scores")
    merged = []
    for i, info in enumerate(list(infos)):
        d = dict(info or {})
        if tool is not None and tool[i] is not None:
            d.update(dict(tool[i]).items())
        d["num_turns"] = turns[i] if turns is not None else None
        d["rollout_reward_scores"] = scores[i] if scores is not None else {}
        merged.append(d)
    out["extra_info"] = np.empty(len(merged), dtype=object)
    out["extra_info"][:] = merged
    return out


def v1_reward_inputs(fields: dict[str, np.ndarray], rows: int) -> dict[str, np.ndarray]:
    """A V1 step's reward inputs (``data_source``, ``reward_model``, ``extra_info`` as read back)
    and its reward components: each row's ``extra_fields["reward_extra_info"]`` (the reward loop's
    per-row extras), a column per key whose every row holds a number (as the legacy trainer's
    ``reward_extra_keys`` land in its non-tensor batch)."""
    out = {k: v for k, v in fields.items() if k != "extra_fields"}
    extras = fields.get("extra_fields")
    if extras is not None:
        infos = [(e or {}).get("reward_extra_info", {}) if isinstance(e, dict) else {} for e in extras]
        for key in dict.fromkeys(k for info in infos for k in info):
            values = [info.get(key) for info in infos]
            if all(isinstance(v, (bool, int, float, np.number)) for v in values):
                out[str(key)] = np.asarray(values, dtype=np.float64)
    return {k: v for k, v in out.items() if len(v) == rows}


def v1_rows(meta: Any) -> int | None:
    """The real rows of a V1 batch's meta: its keys less the divisibility-padding rows."""
    keys = getattr(meta, "keys", None)
    if keys is None or callable(keys):
        return None
    tags = list(getattr(meta, "tags", None) or [{}] * len(keys))
    return sum(1 for t in tags if not (t or {}).get("is_padding", False))


def _get(config: Any, dotted: str) -> Any:
    node = config
    for key in dotted.split("."):
        if node is None:
            return None
        getter = getattr(node, "get", None)
        node = getter(key, None) if callable(getter) else getattr(node, key, None)
    return node


def run_config(config: Any, kind: str) -> dict:
    """The trainer's config as ``run.yaml`` holds it, with what the capture knows of verl:
    ``rldiag.capture.{verl_version, trainer, trainer_mode}``."""
    tree = plain(config) if config is not None else {}
    if not isinstance(tree, dict):
        raise CaptureError(f"the trainer's config must be a mapping at the top, not {type(tree).__name__}")
    verl = sys.modules.get("verl")
    info = {"verl_version": str(getattr(verl, "__version__", "unknown")), "trainer": kind}
    if kind == "v1":
        info["trainer_mode"] = _get(config, "trainer.v1.trainer_mode")
    rldiag = dict(tree.get("rldiag") or {})
    rldiag["capture"] = info
    return {**tree, "rldiag": rldiag}


# ---- patches ------------------------------------------------------------------------------------

_SESSION: VerlCapture | None = None
_UNDO: list[tuple[Any, str, Any]] = []
_DONE: set[str] = set()


def _set(owner: Any, name: str, value: Callable) -> None:
    original = getattr(owner, name)
    if getattr(original, _WRAPPED, False):
        return
    setattr(value, _WRAPPED, True)
    _UNDO.append((owner, name, original))
    setattr(owner, name, value)


def _wrap_fit(kind: str, fit: Callable) -> Callable:
    @functools.wraps(fit)
    def fit_and_capture(self, *args, **kwargs):
        session = _SESSION
        if session is None or session.active:
            return fit(self, *args, **kwargs)
        session.begin(self, kind)
        try:
            result = fit(self, *args, **kwargs)
        except BaseException:
            try:
                session.finish()
            except CaptureError as exc:  # the training error goes on; the capture's is printed
                print(f"rldiag.capture: {exc}", file=sys.stderr)
            raise
        session.finish()
        return result

    return fit_and_capture


def _wrap_correction(fn: Callable) -> Callable:
    @functools.wraps(fn)
    def correct_and_keep_mask(data, *args, **kwargs):
        if _SESSION is not None:
            _SESSION.keep_mask_before_correction(data)
        return fn(data, *args, **kwargs)

    return correct_and_keep_mask


def _patch_correction(module: Any) -> None:
    _set(module, _CORRECTION_FN, _wrap_correction(getattr(module, _CORRECTION_FN)))


def _patch_legacy(module: Any) -> None:
    _set(module.RayPPOTrainer, "fit", _wrap_fit("legacy", module.RayPPOTrainer.fit))
    compute_advantage = module.compute_advantage

    @functools.wraps(compute_advantage)
    def compute_advantage_and_capture(data, *args, **kwargs):
        out = compute_advantage(data, *args, **kwargs)
        session = _SESSION
        if session is not None and session.active and session.kind == "legacy" and session.wants_batch(batch_rows(out)):
            session.guarded("batch", lambda: session.capture_dataproto(out))
        return out

    _set(module, "compute_advantage", compute_advantage_and_capture)
    if hasattr(module, _CORRECTION_FN):  # a module-level import of it (the V1 base has one)
        _patch_correction(module)


def _patch_v1(module: Any) -> None:
    cls = module.PPOTrainer
    _set(cls, "fit", _wrap_fit("v1", cls.fit))
    compute = cls._compute_advantage

    @functools.wraps(compute)
    def compute_advantage_and_capture(self, batch, *args, **kwargs):
        out = compute(self, batch, *args, **kwargs)
        if _SESSION is not None and _SESSION.active and _SESSION.kind == "v1" and _SESSION.wants_batch(v1_rows(batch)):
            session = _SESSION  # the trainer's own meta: keys and padding tags
            session.guarded("batch", lambda: session.capture_v1(module.tq, batch))
        return out

    _set(cls, "_compute_advantage", compute_advantage_and_capture)
    if hasattr(module, _CORRECTION_FN):
        _patch_correction(module)


def _patch_tracking(module: Any) -> None:
    log = module.Tracking.log

    @functools.wraps(log)
    def log_and_capture(self, data, step, *args, **kwargs):
        session = _SESSION
        if session is not None and session.active:
            data = session.health_keys(int(step), data)
        out = log(self, data, step, *args, **kwargs)
        if session is not None and session.active:
            logged = dict(data)
            try:
                session.end_step(int(step), logged)
            except Exception as exc:  # noqa: BLE001 - the capture never stops training
                if session.on_error == "raise":
                    raise
                writer = session.writer
                if writer is not None:
                    writer.fault("end of step", str(writer.path), exc, f"step {step}'s end (its metrics line, "
                                 "fsync or health) is skipped", errors=1)
        return out

    _set(module.Tracking, "log", log_and_capture)


PATCHES: dict[str, Callable[[Any], None]] = {
    CORRECTION_MODULE: _patch_correction,
    LEGACY_MODULE: _patch_legacy,
    V1_MODULE: _patch_v1,
    TRACKING_MODULE: _patch_tracking,
}


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the module it made."""

    def __init__(self, loader: Any, name: str):
        self._loader, self._name = loader, name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        _apply(self._name, module)

    def __getattr__(self, attr):  # get_source, get_code, ... of the real loader
        return getattr(self._loader, attr)


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Patches verl's trainer modules as they are imported (they are imported after
    ``import verl`` has imported this module)."""

    def find_spec(self, name, path=None, target=None):
        if name not in PATCHES or name in _DONE:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, name)
                return spec
        return None


_FINDER = _PatchOnImport()


def _apply(name: str, module: Any) -> None:
    if name not in _DONE:
        _DONE.add(name)
        PATCHES[name](module)


def install(run_dir: str | Path | None = None, *, tokens: bool | None = None, doctor: bool | None = None,
            stop: str | None = None, make_doctor: DoctorFactory | None = None,
            rules: list[Rule] | None = None, on_error: str = "warn",
            rules_files: list[str] | None = None, writer_options: dict | None = None,
            health_options: dict | None = None) -> VerlCapture:
    """Capture every ``fit`` of verl's trainers in this process into ``run_dir`` (default:
    ``$RLDIAG_CAPTURE_DIR``). ``tokens``: also store token text (default: ``$RLDIAG_CAPTURE_TOKENS``).
    ``doctor``: run the doctor's rules after each step and log ``rldiag/health/*`` with the
    step's metrics (default: ``$RLDIAG_DOCTOR``); ``stop``: ``critical`` or ``warning``, stop
    training after a step with such a finding active (default: ``$RLDIAG_DOCTOR_STOP``);
    ``make_doctor(settings, rules)``: the live doctor to use (:mod:`rldiag.capture.health`);
    ``rules``: the rules it evaluates (default: the built-in ones, with ``rules_files`` merged
    over them, default ``$RLDIAG_DOCTOR_RULES``: a file that cannot be read is warned and left
    out). ``on_error``: ``"warn"`` (faults warned once and counted, training never stopped) or
    ``"raise"``; ``writer_options``: more :class:`~rldiag.capture.RunWriter` keywords
    (``max_queue_bytes``, ``max_wait_s``, ``wait_share``); ``health_options``: the doctor
    hook's (``wait_s``, ``slow_s``: :class:`~rldiag.capture.health.HealthHook`). Idempotent;
    :func:`uninstall` undoes it."""
    global _SESSION
    run_dir = run_dir if run_dir is not None else os.environ.get(ENV_DIR)
    if not run_dir:
        raise CaptureError(f"rldiag.capture.verl.install needs a run directory (or {ENV_DIR} in the environment)")
    if tokens is None:
        tokens = env_flag(os.environ.get(ENV_TOKENS))
    if doctor is None:
        doctor = env_flag(os.environ.get(ENV_DOCTOR))
    stop_at = stop_level(stop if stop is not None else os.environ.get(ENV_STOP))
    if _SESSION is not None and _SESSION.active:
        raise CaptureError(f"a capture into {_SESSION.run_dir} is running in this process")
    if rules_files is None:
        rules_files = [p for p in os.environ.get(ENV_RULES, "").split(os.pathsep) if p]
    _SESSION = VerlCapture(run_dir, tokens=tokens, doctor=doctor, stop_at=stop_at, make_doctor=make_doctor,
                           rules=rules, on_error=on_error, rules_files=rules_files, writer_options=writer_options,
                           health_options=health_options)
    if _FINDER not in sys.meta_path:
        sys.meta_path.insert(0, _FINDER)
    for name in PATCHES:  # CORRECTION_MODULE first: the trainers' own references are patched after
        if name in sys.modules:
            _apply(name, sys.modules[name])
    return _SESSION


def uninstall() -> None:
    """Undo :func:`install`: the original functions back, no import hook, the writer closed."""
    global _SESSION
    session, _SESSION = _SESSION, None
    if _FINDER in sys.meta_path:
        sys.meta_path.remove(_FINDER)
    while _UNDO:
        owner, name, original = _UNDO.pop()
        setattr(owner, name, original)
    _DONE.clear()
    if session is not None:
        session.finish()


if os.environ.get(ENV_DIR):
    install()
