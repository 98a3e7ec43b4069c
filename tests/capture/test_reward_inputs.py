"""The columns a reward function reads: ``data_source``, ``ground_truth`` and ``extra_info``
(always JSON text), ``response_text`` / ``prompt_text`` (each row decoded with
``skip_special_tokens=True``), written by ``RunWriter`` from a verl-style batch."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import torch

from rldiag.capture import RunWriter
from rldiag.capture.reward_inputs import json_text
from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir

P, R = 4, 5


class _Tok:
    """Ids 1..26 are letters; 0 is the special padding token ``<pad>``."""

    def convert_ids_to_tokens(self, ids):
        return ["<pad>" if i == 0 else chr(96 + i) for i in ids]

    def batch_decode(self, rows, skip_special_tokens=False):
        return ["".join(("" if skip_special_tokens else "<pad>") if i == 0 else chr(96 + i) for i in r) for r in rows]


def _batch(non: dict) -> SimpleNamespace:
    rl = torch.tensor([5, 3, 1])
    pl = torch.tensor([2, 4, 1])
    resp_attn = (torch.arange(R)[None, :] < rl[:, None]).long()
    prompt_attn = (torch.arange(P).flip(0)[None, :] < pl[:, None]).long()
    responses = torch.tensor([[1, 0, 2, 3, 4], [5, 6, 7, 0, 0], [8, 0, 0, 0, 0]])  # row 0 samples <pad> mid-way
    prompts = torch.tensor([[0, 0, 9, 10], [11, 12, 13, 14], [0, 0, 0, 15]])
    batch = {"prompts": prompts, "responses": responses, "attention_mask": torch.cat([prompt_attn, resp_attn], 1),
             "response_mask": resp_attn, "token_level_scores": resp_attn.float()}
    return SimpleNamespace(batch=batch, non_tensor_batch={"uid": np.array(["a", "a", "b"], dtype=object), **non})


def test_reward_inputs_are_json_text_and_the_texts_are_decoded_without_special_tokens(tmp_path):
    non = {
        "data_source": np.array(["openai/gsm8k", "openai/gsm8k", "math"], dtype=object),
        "reward_model": np.array([{"ground_truth": "42", "style": "rule"}, {"ground_truth": np.int64(7)},
                                  {"ground_truth": np.array([1.5, 2.0])}], dtype=object),
        "extra_info": np.array([{"index": np.int32(3), "split": "train"}, None, {"tags": {1, 2}}], dtype=object),
    }
    with RunWriter(tmp_path, tokenizer=_Tok(), on_error="raise") as w:
        w.write_batch(1, _batch(non))
    table = pq.read_table(tmp_path / "batches" / "step_000001.parquet")
    assert table["data_source"].to_pylist() == ["openai/gsm8k", "openai/gsm8k", "math"]
    assert table["ground_truth"].to_pylist() == ['"42"', "7", "[1.5, 2.0]"]
    assert [json.loads(g) for g in table["ground_truth"].to_pylist()] == ["42", 7, [1.5, 2.0]]
    extra = table["extra_info"].to_pylist()
    assert json.loads(extra[0]) == {"index": 3, "split": "train"} and extra[1] == "{}"
    assert extra[2] == repr({"tags": {1, 2}})  # a set: no JSON for it, its repr kept and the row flagged
    assert table["reward_inputs_repr"].to_pylist() == [0, 0, 1]
    assert table["response_text"].to_pylist() == ["abcd", "efg", "h"]  # row 0's <pad> left out
    assert table["prompt_text"].to_pylist() == ["ij", "klmn", "o"]
    assert table["response_tokens"].to_pylist()[0] == ["a", "<pad>", "b", "c", "d"]
    # the loader never hands them to the engine: a recompute's load reads what it did before
    settings = resolve_settings(tmp_path, {"algorithm.adv_estimator": "grpo"})
    step = load_step(RunDir(tmp_path).step_files()[0], settings, recompute_columns(settings))
    assert not {"data_source", "ground_truth", "extra_info", "reward_inputs_repr"} & set(step.batch.extra)
    every = load_step(RunDir(tmp_path).step_files()[0], settings, table.column_names)
    assert not {"data_source", "ground_truth", "extra_info", "reward_inputs_repr", "response_text"} & set(every.batch.extra)


def test_a_batch_without_them_gets_no_reward_columns(tmp_path):
    with RunWriter(tmp_path, on_error="raise") as w:
        w.write_batch(1, _batch({}))
    names = pq.read_table(tmp_path / "batches" / "step_000001.parquet").column_names
    assert not {"data_source", "ground_truth", "extra_info", "reward_inputs_repr", "response_text"} & set(names)


def test_json_text_of_numpy_values():
    assert json_text(np.float32(0.5)) == ("0.5", True)
    assert json_text({"a": np.arange(3)}) == ('{"a": [0, 1, 2]}', True)
    assert json_text("42") == ('"42"', True)
    assert json_text(object)[1] is False
