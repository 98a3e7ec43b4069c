"""Write offline W&B runs with the real wandb SDK (run in a subprocess by the tests and bench).

Usage: ``python wandb_writer.py SPEC.json``. The spec lists runs; each is written with
``wandb.init(mode="offline")`` in turn, and ``spec["result"]`` receives, per run key, the run's
offline folder, id and wandb's own view of the final config. The environment (HOME, WANDB_DIR,
WANDB_*_DIR, WANDB_MODE=offline, WANDB_ERROR_REPORTING=false) is set by the caller.

Run kinds:

- ``log``: ``config`` at init, ``rows`` (``[[step, {key: value}], ...]``, logged with
  ``run.log(data, step=step)``), then ``config_update`` (``run.config.update``), then
  ``batches_dir`` logged as an ``rl-batches`` artifact with rldiag's exporter, then
  ``run.finish(exit_code=...)``; ``encoding`` sets wandb's ``x_history_value_encoding``.
- ``export``: ``rldiag.capture.wandb_export.export_run(run_dir)`` (config, metrics and batches).

Each run may set ``data_dir`` (WANDB_DATA_DIR while it runs: where its artifact files are staged).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path


def _run_folder(run) -> str:
    return str(Path(run.dir).parent)


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import wandb

    from rldiag.capture.wandb_export import export_run, log_batches

    result = {}
    for item in spec["runs"]:
        if item.get("data_dir"):
            os.environ["WANDB_DATA_DIR"] = item["data_dir"]
        if item["kind"] == "export":
            rep = export_run(item["run_dir"], project=item.get("project", "rldiag-test"), mode="offline",
                             artifact_name=item.get("artifact_name"))
            folders = sorted(Path(os.environ["WANDB_DIR"], "wandb").glob(f"offline-run-*-{rep.run_id}"))
            result[item["key"]] = {"run_dir": str(folders[-1]), "run_id": rep.run_id,
                                   "metric_steps": rep.metric_steps, "batch_files": rep.batch_files}
            continue
        settings = wandb.Settings(x_history_value_encoding=item.get("encoding", "json"))
        run = wandb.init(project=item.get("project", "rldiag-test"), mode="offline", config=item.get("config"),
                         settings=settings)
        for step, data in item.get("rows", []):
            run.log(data, step=step)
        if item.get("config_update"):
            run.config.update(item["config_update"], allow_val_change=True)
        if item.get("batches_dir"):
            log_batches(run, item["batches_dir"], name=item.get("artifact_name", "batches"))
        final_config = {k: v for k, v in dict(run.config).items() if k != "_wandb"}
        result[item["key"]] = {"run_dir": _run_folder(run), "run_id": run.id, "config": final_config}
        run.finish(exit_code=item.get("exit_code", 0))
    Path(spec["result"]).write_text(json.dumps(result, allow_nan=True))


if __name__ == "__main__":
    main(sys.argv[1])
