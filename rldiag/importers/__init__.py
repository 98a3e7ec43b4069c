"""Importers: runs kept elsewhere -> rldiag run directories.

- :func:`import_wandb` (``rldiag import-wandb``): Weights & Biases runs, online through the public
  API or offline from ``wandb/offline-run-*`` folders (read with rldiag's own reader of the
  ``.wandb`` log format). ``wandb`` is an optional dependency, imported only when needed.

Modules: ``wandb_log`` (the block/chunk format), ``wandb_records`` (protobuf records -> config,
history, exit code, artifacts), ``wandb_values`` (W&B values -> run-directory values),
``wandb_artifacts`` (finding offline artifact files by path and digest), ``wandb_online`` (the
public API), ``rundir_writer`` (atomic writes into the run directory), ``wandb_import``
(the whole import: one source class per kind, offline run folder, online run or artifact).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rldiag.errors import WandbImportError, WandbMissingError

if TYPE_CHECKING:
    from rldiag.importers.wandb_import import ImportReport, import_wandb

__all__ = ["ImportReport", "WandbImportError", "WandbMissingError", "import_wandb"]


def __getattr__(name: str):
    if name in ("import_wandb", "ImportReport"):
        from rldiag.importers import wandb_import

        return getattr(wandb_import, name)
    raise AttributeError(name)
