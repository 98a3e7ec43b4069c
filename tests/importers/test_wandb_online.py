"""The online path through an injected API (plain fake objects), and the real SDK without network."""

from __future__ import annotations

import base64
import hashlib
import json
import math
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from rldiag.importers import WandbImportError, import_wandb
from rldiag.importers.wandb_online import default_api_factory

from .conftest import hermetic_env, same_value


def md5_b64(data: bytes) -> str:
    return base64.b64encode(hashlib.md5(data).digest()).decode()


class FakeEntry:
    def __init__(self, path: str, data: bytes, digest: str | None = None):
        self.path, self._data = path, data
        self.digest = digest or md5_b64(data)
        self.size = len(data)
        self.ref = None
        self.downloads = 0

    def download(self, root: str | None = None):
        self.downloads += 1
        dst = Path(root) / self.path
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.write_bytes(self._data)
        return str(dst)


class FakeManifest:
    def __init__(self, entries):
        self.entries = {e.path: e for e in entries}


class FakeArtifact:
    def __init__(self, name: str, type: str, entries):  # noqa: A002
        self.name, self.type = name, type
        self.version = name.split(":")[1] if ":" in name else None
        self.digest = "d-" + name
        self.manifest = FakeManifest(entries)

    def get_entry(self, path):
        return self.manifest.entries[path]


class FakeRun:
    def __init__(self, rows, config, artifacts, state="finished"):
        self.id, self.entity, self.project, self.name, self.state = "abc123", "me", "rl", "grpo-1", state
        self._rows, self.config, self._artifacts = rows, config, artifacts
        self.page_sizes: list[int] = []

    @property
    def lastHistoryStep(self):  # noqa: N802 - the public API's name
        return max(r["_step"] for r in self._rows)

    def scan_history(self, page_size=1000, **kw):
        self.page_sizes.append(page_size)
        yield from (dict(r) for r in self._rows)

    def history(self, *a, **kw):
        raise AssertionError("the down-sampled history() must not be used")

    def logged_artifacts(self):
        return list(self._artifacts)


class FakeApi:
    def __init__(self, run=None, artifacts=None):
        self._run, self._artifacts = run, artifacts or {}
        self.calls: list[tuple] = []

    def run(self, path):
        self.calls.append(("run", path))
        if self._run is None or path != "me/rl/abc123":
            raise ValueError(f"Could not find run {path}")
        return self._run

    def artifact(self, name, type=None):  # noqa: A002
        self.calls.append(("artifact", name))
        if name not in self._artifacts:
            raise ValueError(f"artifact {name} not found")
        return self._artifacts[name]


def factory_for(api, seen):
    def factory(*, timeout, base_url):
        seen.append({"timeout": timeout, "base_url": base_url})
        return api
    return factory


ROWS = [
    {"_step": 1, "_runtime": 3.5, "_timestamp": 1.7e9, "actor/pg_clipfrac": 0.125, "response_length/max": 512,
     "val": {"acc": 0.5}, "actor/grad_norm": math.nan},
    {"_step": 2, "_runtime": 7.0, "_timestamp": 1.7e9 + 4, "actor/pg_clipfrac": 0.25, "actor/grad_norm": math.inf,
     "global_seqlen/sum": 2**53 + 1},
    {"_step": 3, "_runtime": 9.0, "_timestamp": 1.7e9 + 8, "actor/pg_clipfrac": 0.0,
     "media": {"_type": "table-file", "path": "t.json"}},
]
CONFIG = {
    "_wandb": {"value": {"cli_version": "0.31.0"}},
    "algorithm": {"value": {"adv_estimator": "grpo", "gamma": 1.0, "kl_ctrl": {"kl_coef": 0.001}}, "desc": None},
    "actor_rollout_ref": {"value": {"actor": {"loss_agg_mode": "token-mean", "clip_ratio": 0.2}}},
    "data": {"value": {"max_response_length": 32}},
}


def make_api(files, **kw):
    v0 = FakeArtifact("batches:v0", "rl-batches", [FakeEntry("step_1.parquet", files[1]), FakeEntry("step_2.parquet", b"old")])
    v1 = FakeArtifact("batches:v1", "rl-batches", [FakeEntry("step_2.parquet", files[2]), FakeEntry("step_3.parquet", files[3]),
                                                  FakeEntry("notes.txt", b"x")])
    model = FakeArtifact("model:v0", "model", [FakeEntry("step_9.parquet", b"not a batch")])
    run = FakeRun(ROWS, CONFIG, [v1, model, v0], **kw)
    return FakeApi(run, {"me/rl/batches:v1": v1}), run, (v0, v1, model)


def test_online_run(batch_files, tmp_path):
    src, files = batch_files
    api, run, (v0, v1, model) = make_api(files)
    seen = []
    out = tmp_path / "run"
    rep = import_wandb("me/rl/abc123", out, api_factory=factory_for(api, seen), page_size=250, timeout=7.5)
    assert seen == [{"timeout": 7.5, "base_url": None}]
    assert run.page_sizes == [250]
    assert (rep.kind, rep.run_id, rep.entity, rep.project, rep.state) == ("online", "abc123", "me", "rl", "finished")
    # config: W&B's {"value": ...} wrappers gone, _wandb dropped, nested as verl's
    assert yaml.safe_load((out / "run.yaml").read_text()) == {
        "algorithm": {"adv_estimator": "grpo", "gamma": 1.0, "kl_ctrl": {"kl_coef": 0.001}},
        "actor_rollout_ref": {"actor": {"loss_agg_mode": "token-mean", "clip_ratio": 0.2}},
        "data": {"max_response_length": 32},
    }
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3]
    for ln, row in zip(lines, ROWS):
        want = {k: v for k, v in row.items() if k not in ("_step", "val")}
        if "val" in row:
            want["val.acc"] = row["val"]["acc"]
        assert ln["data"].keys() == want.keys()
        assert all(same_value(ln["data"][k], v) for k, v in want.items())
    assert lines[1]["data"]["global_seqlen/sum"] == 2**53 + 1
    # batches: only rl-batches artifacts, step files only, the later version wins step 2
    assert rep.batch_steps == [1, 2, 3]
    for s in (1, 2, 3):
        assert (out / "batches" / f"step_{s}.parquet").read_bytes() == files[s]
    assert sorted(p.name for p in (out / "batches").iterdir()) == ["step_1.parquet", "step_2.parquet", "step_3.parquet"]
    assert model.manifest.entries["step_9.parquet"].downloads == 0
    assert any("step 2 is in artifacts batches:v0 and batches:v1; kept batches:v1" in w for w in rep.warnings)
    assert not [p for p in out.iterdir() if p.name.startswith(".")]
    # the imported run recomputes like the original
    from rldiag.scenario.recompute import recompute

    got, want = recompute(out), recompute(src)
    assert got.steps_done == want.steps_done == [1, 2, 3] and not got.steps_failed
    for g, w in zip(sorted(got.metrics, key=lambda r: r["step"]), sorted(want.metrics, key=lambda r: r["step"])):
        assert all(same_value(g[k], w[k]) for k in w)


def test_one_artifact(batch_files, tmp_path):
    _, files = batch_files
    api, run, _ = make_api(files)
    rep = import_wandb(None, tmp_path / "run", artifacts=["me/rl/batches:v1"], api_factory=factory_for(api, []))
    assert rep.kind == "artifact" and rep.batch_steps == [2, 3]
    assert api.calls == [("artifact", "me/rl/batches:v1")]
    assert not (tmp_path / "run" / "metrics.jsonl").exists() and not (tmp_path / "run" / "run.yaml").exists()
    # with a run: its history and config, but the named artifact's batches
    rep = import_wandb("me/rl/abc123", tmp_path / "run2", artifacts=["me/rl/batches:v1"], api_factory=factory_for(api, []))
    assert rep.batch_steps == [2, 3] and rep.history_rows == 3


def test_bad_digest_changes_nothing(batch_files, tmp_path):
    _, files = batch_files
    api, run, (v0, v1, model) = make_api(files)
    out = tmp_path / "run"
    import_wandb("me/rl/abc123", out, api_factory=factory_for(api, []))
    before = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    v1.manifest.entries["step_3.parquet"].digest = md5_b64(b"something else")
    run._rows = ROWS[:1]
    with pytest.raises(WandbImportError, match="step_3.parquet downloaded with MD5"):
        import_wandb("me/rl/abc123", out, api_factory=factory_for(api, []))
    after = {p.relative_to(out): p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert after == before  # nothing half-updated, no temp files left


def test_api_errors_name_what_failed(batch_files, tmp_path):
    _, files = batch_files
    api, _, _ = make_api(files)
    with pytest.raises(WandbImportError, match="cannot open W&B run me/rl/nope: Could not find run"):
        import_wandb("me/rl/nope", tmp_path / "run", api_factory=factory_for(api, []))
    with pytest.raises(WandbImportError, match="expected entity/project/name:version"):
        import_wandb(None, tmp_path / "run", artifacts=["batches"], api_factory=factory_for(api, []))
    with pytest.raises(WandbImportError, match="cannot open W&B artifact me/rl/batches:v9"):
        import_wandb(None, tmp_path / "run", artifacts=["me/rl/batches:v9"], api_factory=factory_for(api, []))


def test_no_key_fails_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    with pytest.raises(WandbImportError, match="WANDB_API_KEY is not set"):
        import_wandb("me/rl/abc123", tmp_path / "run")
    with pytest.raises(WandbImportError, match="WANDB_API_KEY"):
        default_api_factory(timeout=1)
    assert not (tmp_path / "run").exists()  # a failed import leaves no empty run directory behind


def _processes_with(marker: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            env = (d / "environ").read_bytes()
        except OSError:
            continue
        if marker.encode() in env:
            pids.append(int(d.name))
    return pids


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs /proc to look for leftover processes")
def test_no_network_fails_with_a_clear_error_and_leaves_no_wandb_core(tmp_path):
    """An unreachable server with the real SDK: the error is printed, the process exits with 1,
    and the wandb-core it started is gone when it has exited. stdout and stderr are pipes read to
    their end (``capture_output``): a wandb-core left holding them would keep this call waiting,
    which the safety timeout would turn into a failure."""
    pytest.importorskip("wandb")
    key = "k" * 40
    marker = f"RLDIAG_TEST_MARKER={os.getpid()}-{time.time_ns()}"
    env = hermetic_env(tmp_path, WANDB_API_KEY=key, RLDIAG_TEST_MARKER=marker.split("=", 1)[1])
    env.pop("WANDB_MODE")
    proc = subprocess.run(
        [sys.executable, "-m", "rldiag.cli.main", "import-wandb", "me/rl/abc123", "--out", str(tmp_path / "run"),
         "--base-url", "http://127.0.0.1:9", "--timeout", "2"],
        env=env, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "WandbImportError: cannot connect to http://127.0.0.1:9" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert key not in proc.stdout + proc.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    assert _processes_with(marker) == []  # ended and reaped before the command exited


def test_the_cli_prints_the_error_before_the_sdk_shuts_down(tmp_path, monkeypatch, capsys):
    """wandb's shutdown may take its full deadline: the user sees the error before it starts."""
    from rldiag.cli.main import main
    from rldiag.importers import wandb_import

    def no_server(**_):
        raise WandbImportError("cannot connect to http://127.0.0.1:9 (timeout 2s): refused")

    seen_at_shutdown = []
    monkeypatch.setattr(wandb_import, "default_api_factory", no_server)
    monkeypatch.setattr(wandb_import, "shutdown", lambda: seen_at_shutdown.append(capsys.readouterr().err))
    rc = main(["import-wandb", "me/rl/abc123", "--out", str(tmp_path / "run"), "--no-progress"])
    assert rc == 1
    assert len(seen_at_shutdown) == 1
    assert "WandbImportError: cannot connect to http://127.0.0.1:9" in seen_at_shutdown[0]


def test_the_library_shuts_the_sdk_down_before_returning(tmp_path, monkeypatch):
    from rldiag.importers import wandb_import

    def no_server(**_):
        raise WandbImportError("cannot connect")

    calls = []
    monkeypatch.setattr(wandb_import, "default_api_factory", no_server)
    monkeypatch.setattr(wandb_import, "shutdown", lambda: calls.append("shutdown"))
    with pytest.raises(WandbImportError):
        import_wandb("me/rl/abc123", tmp_path / "run")
    assert calls == ["shutdown"]
