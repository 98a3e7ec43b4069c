"""Capture: write a run directory (docs/run-directory.md) from a trainer while it trains.

>>> from rldiag.capture import RunWriter                        # doctest: +SKIP
>>> with RunWriter("runs/exp1", config=cfg) as run:
...     run.write_batch(step, batch)      # padded tensors or a verl DataProto, after compute_advantage
...     run.log_metrics(step, metrics)    # one {"step": N, "data": {...}} line of metrics.jsonl

Modules: ``fields`` (verl field names -> batch columns), ``unpad`` (padded tensors -> flat
columns, on the training thread), ``table`` (Arrow table, validation, atomic Parquet write),
``config`` (run.yaml), ``writer`` (the background writer and its error policy), ``diskio`` (its
one I/O seam), ``backlog`` (its queue, bounded in bytes), ``faults`` (faults warned once and
counted; SIGTERM). See docs/capture.md.
"""

from rldiag.capture.config import config_yaml, write_config
from rldiag.capture.table import payload_table, write_step_file
from rldiag.capture.unpad import StepPayload, split_batch, unpad_batch
from rldiag.capture.writer import CaptureStats, RunWriter

__all__ = [
    "CaptureStats",
    "RunWriter",
    "StepPayload",
    "config_yaml",
    "payload_table",
    "split_batch",
    "unpad_batch",
    "write_config",
    "write_step_file",
]
