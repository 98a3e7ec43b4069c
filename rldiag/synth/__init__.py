"""Synthetic run directories, for the tests, ``bench/`` and smoke runs.

- :mod:`~rldiag.synth.batches`: random but well-formed batches (:class:`SynthSpec`,
  :func:`write_synth_run`).
- :mod:`~rldiag.synth.mismatch`: runs with a planted cause of rollout-vs-trainer log-prob
  mismatch (:class:`MismatchSpec`, :func:`write_mismatch_run`, :data:`MISMATCH_CAUSES`).
"""

from __future__ import annotations

from rldiag.synth.batches import SynthSpec, draw_lengths, list_array, synth_step_table, write_synth_run
from rldiag.synth.mismatch import MISMATCH_CAUSES, MismatchSpec, write_mismatch_run

__all__ = [
    "MISMATCH_CAUSES",
    "MismatchSpec",
    "SynthSpec",
    "draw_lengths",
    "list_array",
    "synth_step_table",
    "write_mismatch_run",
    "write_synth_run",
]
