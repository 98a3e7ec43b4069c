"""``rldiag verify`` and ``rldiag compare`` on a run in object storage (``s3://bucket/run``, a local
S3 server): the same reports as on the local copy of the run; compare writes its outputs into the
store, ``comparison.json`` last and listing every object with its size and SHA-256, and a compare
that fails half way leaves no ``comparison.json`` behind; verify's candidate search downloads a
mismatching step once, not once per candidate."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import Counter

import pyarrow.parquet as pq
import pytest

import rldiag.analysis.compare as compare_mod
from rldiag.analysis.compare import compare
from rldiag.analysis.verify import verify_run
from rldiag.cli.main import main
from rldiag.errors import OutputError
from rldiag.io import loader
from rldiag.io.fs import RemotePath
from rldiag.io.run_layout import RunLayout
from rldiag.scenario.recompute import recompute
from tests.analysis.logged_runs import ADAPTIVE_KL, write_self_logged_run
from tests.analysis.reference import write_logged_run
from tests.s3server import moto_s3

FILES = ("comparison.json", "groups.parquet", "metrics.parquet", "tokens.parquet")


@pytest.fixture(scope="module")
def s3():
    with moto_s3() as server:
        yield server


def _key(uri: str) -> str:
    """``bucket/prefix`` of an ``s3://`` URI (what pyarrow's filesystem takes)."""
    return uri.removeprefix("s3://")


def _upload(s3, root) -> str:
    return s3.upload_dir(root, f"runs/{uuid.uuid4().hex[:8]}")


def test_verify_reads_the_run_in_the_store(s3, tmp_path, capsys):
    # adaptive KL in the reward, from step 2: the controller is replayed over step 1 read from the store
    root, _ = write_self_logged_run(tmp_path / "kl", ADAPTIVE_KL)
    uri = _upload(s3, root)
    assert main(["verify", uri, "--steps", "2:", "--json", "--no-progress"]) == 0
    remote = json.loads(capsys.readouterr().out)
    local = verify_run(root, steps="2:").to_dict()
    assert (remote.pop("run"), local.pop("run")) == (uri, str(root))
    assert remote == local
    assert remote["status"] == "match" and remote["steps_checked"] == [2, 3]
    assert remote["fields"]["token_level_rewards"]["compared"] > 0


def test_verify_names_the_setting_and_downloads_each_step_once(s3, tmp_path, monkeypatch, capsys):
    # the trainer ran Dr. GRPO: located and named the same from the store, and the candidate
    # search (every candidate recomputes step 1) downloads step 1 once for all of them
    root = write_logged_run(tmp_path / "drgrpo", steps=2, seed=2, logged={"norm_by_std": False})
    uri = _upload(s3, root)
    opened: Counter[str] = Counter()
    real_source = loader.arrow_source

    def counting_source(p):
        opened[str(p)] += 1
        return real_source(p)

    monkeypatch.setattr(loader, "arrow_source", counting_source)
    assert main(["verify", uri, "--candidate-steps", "1", "--json", "--no-progress"]) == 1
    remote = json.loads(capsys.readouterr().out)
    local = verify_run(root, candidate_steps=1).to_dict()
    assert (remote.pop("run"), local.pop("run")) == (uri, str(root))
    assert remote == local
    assert remote["first_mismatch"]["field"] == "advantages" and remote["candidates_tried"] > 10
    assert remote["candidates"][0]["overrides"] == {"algorithm.norm_adv_by_std_in_grpo": False}
    # the pass over the steps opens each file for its schema, its batch and its logged columns;
    # the candidates recompute step 1 from the bytes downloaded once
    assert opened[f"{uri}/batches/step_1.parquet"] == 3 and opened[f"{uri}/batches/step_2.parquet"] == 3


@pytest.fixture
def two_scenarios(s3, tmp_path):
    """A logged run, local and in the store, each with scenarios ``base`` (its settings) and
    ``drgrpo`` (no std normalisation), with per-token outputs."""
    root = write_logged_run(tmp_path / "run", steps=3, seed=2)
    uri = _upload(s3, root)
    for run in (root, uri):
        recompute(run, name="base", save_tokens=True, device="cpu")
        recompute(run, {"algorithm.norm_adv_by_std_in_grpo": False}, name="drgrpo", save_tokens=True, device="cpu")
    return root, uri


def test_compare_writes_its_outputs_into_the_store(s3, two_scenarios, capsys):
    root, uri = two_scenarios
    assert main(["compare", uri, "base", "drgrpo", "--json", "--no-progress"]) == 0
    remote = json.loads(capsys.readouterr().out)
    local = compare(root, "base", "drgrpo").to_dict()
    target = f"{uri}/rldiag/comparisons/base__vs__drgrpo"
    assert remote.pop("path") == target and local.pop("path") == str(root / "rldiag/comparisons/base__vs__drgrpo")
    assert (remote.pop("run"), local.pop("run")) == (uri, str(root))
    assert remote == local and remote["token_steps"] == [1, 2, 3] and remote["summary"]["tokens"] > 0
    assert str(RunLayout(uri).comparison("base", "drgrpo").dir) == target
    prefix = _key(target).split("/", 1)[1]
    assert s3.keys(prefix) == [f"{prefix}/{f}" for f in FILES]
    fs = s3.fs()
    meta = json.loads(fs.open_input_stream(f"{_key(target)}/comparison.json").read())
    assert sorted(meta["outputs"]) == ["groups.parquet", "metrics.parquet", "tokens.parquet"]
    for name, record in meta["outputs"].items():
        data = fs.open_input_stream(f"{_key(target)}/{name}").read()
        assert (len(data), hashlib.sha256(data).hexdigest()) == (record["size"], record["sha256"])
        assert pq.read_table(f"{_key(target)}/{name}", filesystem=fs).equals(
            pq.read_table(root / "rldiag/comparisons/base__vs__drgrpo" / name)), name
    assert meta["summary"] == json.loads((root / "rldiag/comparisons/base__vs__drgrpo/comparison.json").read_text())["summary"]
    # the logged side reads the batch files' advantages from the store
    assert compare(uri, "logged", "drgrpo").summary == pytest.approx(compare(root, "logged", "drgrpo").summary, nan_ok=True)
    # a compare again replaces the comparison: fewer steps, and comparison.json says so
    rep = compare(uri, "base", "drgrpo", steps="1")
    assert isinstance(rep.path, RemotePath) and rep.token_steps == [1]
    assert json.loads(fs.open_input_stream(f"{_key(target)}/comparison.json").read())["token_steps"] == [1]
    assert pq.read_table(f"{_key(target)}/tokens.parquet", filesystem=fs)["step"].to_pylist() == [1]


def test_compare_estimators_writes_every_pair_into_the_store(s3, tmp_path, capsys):
    root = write_logged_run(tmp_path / "run", steps=2, seed=3)
    uri = _upload(s3, root)
    assert main(["compare", uri, "--estimators", "grpo,rloo", "--no-progress"]) == 0
    target = f"{uri}/rldiag/comparisons/adv_estimator=grpo__vs__adv_estimator=rloo"
    assert f"wrote {target}" in capsys.readouterr().out
    prefix = _key(target).split("/", 1)[1]
    assert s3.keys(prefix) == [f"{prefix}/{f}" for f in FILES]


def test_a_compare_that_fails_half_way_leaves_no_comparison(s3, two_scenarios, monkeypatch):
    _, uri = two_scenarios
    compare(uri, "base", "drgrpo")
    target = _key(f"{uri}/rldiag/comparisons/base__vs__drgrpo")
    prefix = target.split("/", 1)[1]
    real_open = compare_mod.open_staged

    def failing_writer(*args, **kwargs):
        writer = real_open(*args, **kwargs)
        write_table = writer.write_table

        def write(rel, table):
            if rel == "groups.parquet":
                raise OutputError(f"cannot write {rel}: the store went away")
            write_table(rel, table)

        writer.write_table = write
        return writer

    monkeypatch.setattr(compare_mod, "open_staged", failing_writer)
    with pytest.raises(OutputError, match="went away"):
        compare(uri, "base", "drgrpo", steps="1")
    # the parts were staged locally: the previous comparison is there, whole
    assert s3.keys(prefix) == [f"{prefix}/{f}" for f in FILES]
    assert json.loads(s3.fs().open_input_stream(f"{target}/comparison.json").read())["token_steps"] == [1, 2, 3]
    monkeypatch.setattr(compare_mod, "open_staged", real_open)
    compare(uri, "base", "drgrpo", steps="2")
    assert s3.keys(prefix) == [f"{prefix}/{f}" for f in FILES]
    assert json.loads(s3.fs().open_input_stream(f"{target}/comparison.json").read())["token_steps"] == [2]
