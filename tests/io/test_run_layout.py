"""RunLayout: every path under a run directory, the same for a local run and one in an object
store; and no other module of the package spells one of them."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from rldiag.io.fs import RemotePath, as_path
from rldiag.io.run_layout import (
    STEP_FILE,
    ComparisonLayout,
    LayoutAuditLayout,
    RunLayout,
    ScenarioLayout,
    SweepLayout,
    step_file_name,
)

PACKAGE = Path(__file__).resolve().parents[2] / "rldiag"

#: every path under RUN, relative to it
EXPECTED = {
    "config_files": ("run.yaml", "config.yaml", ".hydra/config.yaml"),
    "run_config": "run.yaml",
    "metrics_file": "metrics.jsonl",
    "batches_dir": "batches",
    "output_dir": "rldiag",
    "scenarios_dir": "rldiag/scenarios",
    "comparisons_dir": "rldiag/comparisons",
    "import_dir": "rldiag/import",
    "sweeps_dir": "rldiag/sweeps",
    "wandb_import_record": "rldiag/import/wandb.json",
}


def _rel(p: Path | RemotePath, root: Path | RemotePath) -> str:
    assert type(p) is type(root), (p, root)
    return str(p.relative_to(root))  # type: ignore[arg-type]


@pytest.fixture
def remote_root(monkeypatch):
    # a RemotePath only joins names here: no request reaches the (absent) endpoint
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "k")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s")
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return as_path("s3://bucket/runs/run")


@pytest.fixture(params=["local", "remote"])
def root(request, tmp_path):
    if request.param == "local":
        return tmp_path / "run"
    return request.getfixturevalue("remote_root")


def test_every_path_under_the_run(root):
    layout = RunLayout(root)
    assert layout.root == root and RunLayout(str(root)).root == root
    for attr, want in EXPECTED.items():
        got = getattr(layout, attr)
        if isinstance(want, tuple):
            assert tuple(_rel(p, root) for p in got) == want, attr
        else:
            assert _rel(got, root) == want, attr
    assert _rel(layout.batch_file(12), root) == "batches/step_000012.parquet"
    assert _rel(layout.batch_file(12, "arrow", width=1), root) == "batches/step_12.arrow"
    assert layout.wandb_import_record == layout.root / RunLayout.WANDB_IMPORT


def test_a_scenario_and_a_comparison(root):
    layout = RunLayout(root)
    sc = layout.scenario("adv_estimator=rloo")
    assert isinstance(sc, ScenarioLayout) and sc.name == "adv_estimator=rloo"
    assert {k: _rel(getattr(sc, k), root) for k in ("dir", "meta", "metrics", "tokens_dir")} == {
        "dir": "rldiag/scenarios/adv_estimator=rloo",
        "meta": "rldiag/scenarios/adv_estimator=rloo/scenario.json",
        "metrics": "rldiag/scenarios/adv_estimator=rloo/metrics.parquet",
        "tokens_dir": "rldiag/scenarios/adv_estimator=rloo/tokens",
    }
    assert _rel(sc.tokens_file(7), root) == "rldiag/scenarios/adv_estimator=rloo/tokens/step_000007.parquet"
    assert ScenarioLayout.tokens_rel(7) == "tokens/step_000007.parquet"
    assert sc.dir / ScenarioLayout.tokens_rel(7) == sc.tokens_file(7)
    cmp = layout.comparison("base", "rloo")
    assert isinstance(cmp, ComparisonLayout)
    assert {k: _rel(getattr(cmp, k), root) for k in ("dir", "meta", "metrics", "tokens", "groups")} == {
        "dir": "rldiag/comparisons/base__vs__rloo",
        "meta": "rldiag/comparisons/base__vs__rloo/comparison.json",
        "metrics": "rldiag/comparisons/base__vs__rloo/metrics.parquet",
        "tokens": "rldiag/comparisons/base__vs__rloo/tokens.parquet",
        "groups": "rldiag/comparisons/base__vs__rloo/groups.parquet",
    }


def test_a_sweep(root):
    sw = RunLayout(root).sweep("sweep-1a2b3c4d")
    assert isinstance(sw, SweepLayout) and sw.name == "sweep-1a2b3c4d"
    assert {k: _rel(getattr(sw, k), root) for k in ("dir", "meta", "summary")} == {
        "dir": "rldiag/sweeps/sweep-1a2b3c4d",
        "meta": "rldiag/sweeps/sweep-1a2b3c4d/sweep.json",
        "summary": "rldiag/sweeps/sweep-1a2b3c4d/summary.parquet",
    }


def test_the_layout_audit(root):
    audit = RunLayout(root).layout_audit
    assert isinstance(audit, LayoutAuditLayout)
    assert {k: _rel(getattr(audit, k), root) for k in ("dir", "meta", "metrics")} == {
        "dir": "rldiag/sweeps/layout-audit",
        "meta": "rldiag/sweeps/layout-audit/audit.json",
        "metrics": "rldiag/sweeps/layout-audit/metrics.parquet",
    }
    sc = audit.scenario("dp=2")
    assert isinstance(sc, ScenarioLayout) and sc.name == "dp=2"
    assert _rel(sc.meta, root) == "rldiag/sweeps/layout-audit/dp=2/scenario.json"


def test_paths_keep_their_kind():
    assert isinstance(RunLayout("/tmp/x").scenario("a").meta, Path)
    assert isinstance(RunLayout(Path("rel")).batch_file(1), Path)


def test_step_file_names():
    assert step_file_name(3) == "step_000003.parquet"
    assert step_file_name(3, "arrow", width=1) == "step_3.arrow"
    assert step_file_name(1234567, width=6) == "step_1234567.parquet"
    for name in (step_file_name(5), step_file_name(5, "arrow", 1), "step_0005.parquet"):
        assert STEP_FILE.match(name)
    for name in ("step_5.json", ".step_5.parquet.x.tmp", "step_.parquet", "step_5.parquet.tmp"):
        assert not STEP_FILE.match(name)
    with pytest.raises(ValueError, match="parquet, arrow"):
        step_file_name(1, "csv")


def test_token_steps_lists_the_token_files(tmp_path):
    sc = RunLayout(tmp_path).scenario("s")
    assert sc.token_steps() == []
    sc.tokens_dir.mkdir(parents=True)
    for step in (12, 3):
        sc.tokens_file(step).write_bytes(b"")
    (sc.tokens_dir / ".step_000004.parquet.x.tmp").write_bytes(b"")
    (sc.tokens_dir / "notes.txt").write_bytes(b"")
    assert sc.token_steps() == [3, 12]


def test_rows_files(tmp_path):
    sc = RunLayout(tmp_path).scenario("s")
    assert sc.rows_file(12) == tmp_path / "rldiag" / "scenarios" / "s" / "rows" / "step_000012.parquet"
    assert ScenarioLayout.rows_rel(12) == "rows/step_000012.parquet" and ScenarioLayout.ROWS == "rows"


# -- the names are spelled in one module ----------------------------------------------------------

#: the file and directory names of the run directory (exact string constants)
NAMES = {"run.yaml", "config.yaml", ".hydra/config.yaml", "metrics.jsonl", "batches", "scenarios", "comparisons",
         "import", "wandb.json", "sweeps", "layout-audit", "audit.json", "scenario.json", "comparison.json",
         "metrics.parquet", "tokens.parquet", "groups.parquet", "tokens", "rows", "rldiag", "__vs__", "sweep.json",
         "summary.parquet"}


#: a step file's name, or the head of one in an f-string (``f"step_{n:06d}.parquet"``)
STEP_NAME = re.compile(r"^(tokens/|rows/)?step_(\d*|\d+\.(parquet|arrow))$")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):
                ids.add(id(first.value))
    return ids


def _path_spellings(source: str) -> list[tuple[int, str]]:
    """String constants that are a run-directory name used as a path: joined with ``/``, or an
    f-string piece naming a step file (``step_{n}.parquet``). Dict keys, keyword values and
    messages (other words around the name) are not paths."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div):
            for side in (node.left, node.right):
                if isinstance(side, ast.Constant) and isinstance(side.value, str) and side.value in NAMES:
                    found.add((side.lineno, side.value))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            v = node.value
            if v in NAMES - {"batches", "tokens", "rows", "rldiag", "import", "scenarios", "comparisons", "sweeps",
                                  "layout-audit"} or STEP_NAME.match(v):
                found.add((node.lineno, v))
    return sorted(found)


#: the config files' names are declared in config (which sits below io and finds the file itself)
ALLOWED = {"rldiag/config/settings.py": {"run.yaml", "config.yaml", ".hydra/config.yaml"}}


def test_only_run_layout_spells_the_run_directory():
    spelled = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        if rel == "rldiag/io/run_layout.py":
            continue
        got = [(line, name) for line, name in _path_spellings(path.read_text()) if name not in ALLOWED.get(rel, ())]
        if got:
            spelled[rel] = got
    assert spelled == {}, "name these through rldiag.io.run_layout (RunLayout, ScenarioLayout, ...)"


def test_the_spelling_check_finds_spellings():
    assert _path_spellings('p = run / "metrics.jsonl"\nq = f"step_{n:06d}.parquet"\nr = root / "rldiag"\n') == [
        (1, "metrics.jsonl"), (2, "step_"), (3, "rldiag")]
    assert _path_spellings('d = {"batches": 1}\nprint("no metrics.jsonl here")\nf(dest="batches")\n') == []


# -- where RUN/rldiag is: the run, or its mirror under $RLDIAG_HOME ------------------------------


def test_rldiag_home_resolution(tmp_path):
    from rldiag.io.run_layout import rldiag_home

    assert rldiag_home({"RLDIAG_HOME": str(tmp_path / "h")}) == tmp_path / "h"
    assert rldiag_home({"XDG_CACHE_HOME": str(tmp_path / "xdg")}) == tmp_path / "xdg" / "rldiag"
    assert rldiag_home({}) == Path.home() / ".cache" / "rldiag"


def test_a_writable_run_keeps_its_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    run.mkdir()
    layout = RunLayout(run)
    assert layout.output_dir == run / "rldiag" and not layout.mirrored
    assert not (tmp_path / "home").exists()


def test_a_read_only_run_is_mirrored_under_the_home(tmp_path, monkeypatch):
    """A run named in $RLDIAG_READ_ONLY (the test hook: as root, chmod does not stop a write, and
    os.access says yes) writes into $RLDIAG_HOME/runs/<16 hex of the SHA-256 of its resolved path>,
    laid out as RUN/rldiag; a link to it resolves to the same mirror."""
    import hashlib
    import json
    import os

    from rldiag.io.run_layout import mirror_dir, mirror_source, run_is_writable

    home = tmp_path / "home"
    monkeypatch.setenv("RLDIAG_HOME", str(home))
    run = tmp_path / "runs" / "r1"
    run.mkdir(parents=True)
    monkeypatch.setenv("RLDIAG_READ_ONLY", os.pathsep.join([str(tmp_path / "elsewhere"), str(tmp_path / "runs")]))
    key = hashlib.sha256(str(run.resolve()).encode()).hexdigest()[:16]
    layout = RunLayout(run)
    assert not run_is_writable(run) and layout.mirrored
    assert layout.output_dir == home / "runs" / key == mirror_dir(run)
    assert layout.scenario("baseline").meta == home / "runs" / key / "scenarios" / "baseline" / "scenario.json"
    assert layout.comparison("a", "b").dir == home / "runs" / key / "comparisons" / "a__vs__b"
    assert layout.layout_audit.dir == home / "runs" / key / "sweeps" / "layout-audit"
    assert layout.token_cache("baseline").dir == home / "runs" / key / "cache" / "baseline"
    assert layout.batch_file(3) == run / "batches" / "step_000003.parquet"  # the inputs stay the run's
    assert mirror_source(layout.output_dir) == str(run.resolve())
    assert json.loads((layout.output_dir / "source.json").read_text()) == {"run": str(run.resolve())}
    link = tmp_path / "link"
    link.symlink_to(run)
    assert RunLayout(link).output_dir == layout.output_dir
    assert RunLayout(tmp_path / "runs-other").output_dir == tmp_path / "runs-other" / "rldiag"  # a prefix is not a parent


def test_write_permission_decides(tmp_path, monkeypatch):
    """os.access(W_OK) on RUN/rldiag where it exists, else on RUN."""
    import os

    from rldiag.io import run_layout

    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "home"))
    run = tmp_path / "run"
    (run / "rldiag").mkdir(parents=True)
    asked = []

    def access(path, mode):
        asked.append(Path(path))
        return False

    monkeypatch.setattr(run_layout.os, "access", access)
    assert RunLayout(run).mirrored and asked == [run / "rldiag"]
    (run / "rldiag").rmdir()
    asked.clear()
    assert RunLayout(run).mirrored and asked == [run]
    monkeypatch.setattr(run_layout.os, "access", lambda path, mode: mode == os.W_OK)
    assert not RunLayout(run).mirrored


def test_the_install_is_never_written(tmp_path, monkeypatch):
    from rldiag.io.run_layout import INSTALL_DIR

    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "home"))
    sample = INSTALL_DIR / "app" / "samples" / "grpo-tool"
    layout = RunLayout(sample)
    assert layout.mirrored and layout.output_dir.is_relative_to(tmp_path / "home" / "runs")


def test_a_store_run_keeps_writing_into_the_store_unless_declared_read_only(remote_root, tmp_path, monkeypatch):
    import hashlib

    root = remote_root
    monkeypatch.setenv("RLDIAG_HOME", str(tmp_path / "home"))
    assert _rel(RunLayout(root).output_dir, root) == "rldiag"  # no request made to find out
    monkeypatch.setenv("RLDIAG_READ_ONLY", "s3://bucket/runs")
    key = hashlib.sha256(b"s3://bucket/runs/run").hexdigest()[:16]
    layout = RunLayout(root)
    assert layout.output_dir == tmp_path / "home" / "runs" / key and layout.mirrored
    assert isinstance(layout.scenario("baseline").dir, Path) and isinstance(layout.batch_file(1), RemotePath)


def test_read_only_entries_keep_uris_whole():
    import os

    from rldiag.io.run_layout import read_only_entries

    text = os.pathsep.join(["/data/a", "s3://bucket/run", "", "gs://b/x/"])
    assert read_only_entries(text) == ["/data/a", "s3://bucket/run", "gs://b/x/"]
