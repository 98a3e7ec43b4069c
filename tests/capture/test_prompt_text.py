"""Prompt text: ``RunWriter(..., tokenizer=tok)`` stores each prompt's token strings
(``prompt_tokens``) from verl's left-padded ``prompts`` and the prompt part of ``attention_mask``."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.capture import RunWriter
from rldiag.config.settings import resolve_settings
from rldiag.engine.requirements import recompute_columns
from rldiag.errors import BatchError, MissingInputError
from rldiag.io.loader import load_step
from rldiag.io.rundir import RunDir

P, R = 5, 6


class _Vocab:
    """A tokenizer with Hugging Face's method name; counts its calls."""

    def __init__(self):
        self.calls = 0

    def convert_ids_to_tokens(self, ids):
        self.calls += 1
        return [f"t{i}" for i in ids]


class _DecodeOnly:
    def decode(self, ids):
        return "".join(chr(97 + i % 26) for i in ids)


def _dataproto(rows: int = 6, seed: int = 0, prompt_lengths: list[int] | None = None) -> SimpleNamespace:
    """A verl DataProto-like step: ``prompts`` (rows, P) left-padded, ``responses`` (rows, R)
    right-padded, ``attention_mask`` (rows, P + R) over both, ``uid`` in the non-tensor batch."""
    g = torch.Generator().manual_seed(seed)
    pl = torch.tensor(prompt_lengths) if prompt_lengths is not None else torch.randint(1, P + 1, (rows,), generator=g)
    rl = torch.randint(1, R + 1, (rows,), generator=g)
    prompt_attn = (torch.arange(P).flip(0)[None, :] < pl[:, None]).long()  # verl left-pads prompts
    resp_attn = (torch.arange(R)[None, :] < rl[:, None]).long()
    pad = 0
    batch = {
        "prompts": torch.where(prompt_attn.bool(), torch.randint(1, 90, (rows, P), generator=g), pad),
        "responses": torch.where(resp_attn.bool(), torch.randint(1, 90, (rows, R), generator=g), pad),
        "attention_mask": torch.cat([prompt_attn, resp_attn], 1),
        "response_mask": resp_attn,
        "token_level_scores": torch.rand(rows, R, generator=g) * resp_attn,
    }
    uid = np.array([f"p{i // 2}" for i in range(rows)], dtype=object)
    return SimpleNamespace(batch=batch, non_tensor_batch={"uid": uid})


def _expected(ids: torch.Tensor, attn: torch.Tensor, text) -> list[list[str]]:
    return [[text(int(i)) for i, a in zip(row, m) if a] for row, m in zip(ids.tolist(), attn.tolist())]


def _table(path) -> pa.Table:
    return pq.read_table(RunDir(path).step_files()[0].path)


@pytest.mark.parametrize("tokenizer,text", [(_Vocab(), lambda i: f"t{i}"), (_DecodeOnly(), lambda i: chr(97 + i % 26))])
def test_prompt_text_is_one_string_per_real_prompt_token(tmp_path, tokenizer, text):
    dp = _dataproto(rows=6, seed=1)
    with RunWriter(tmp_path, tokenizer=tokenizer) as run:
        run.write_batch(1, dp)
    table = _table(tmp_path)
    am = dp.batch["attention_mask"]
    assert table["prompt_tokens"].to_pylist() == _expected(dp.batch["prompts"], am[:, :P], text)
    assert table["response_tokens"].to_pylist() == _expected(dp.batch["responses"], am[:, P:], text)
    assert table["prompt_length"].to_pylist() == am[:, :P].sum(-1).tolist()
    assert [len(r) for r in table["prompt_tokens"].to_pylist()] == table["prompt_length"].to_pylist()
    for name in ("prompt_tokens", "response_tokens"):
        t = table.schema.field(name).type
        assert pa.types.is_list(t) and pa.types.is_string(t.value_type)


def test_response_and_prompt_text_come_from_one_tokenizer_call_per_step(tmp_path):
    vocab = _Vocab()
    with RunWriter(tmp_path, tokenizer=vocab) as run:
        run.write_batch(1, _dataproto(seed=2))
        run.write_batch(2, _dataproto(seed=3))
    assert vocab.calls == 2


def test_a_prompt_of_no_tokens_is_an_empty_list(tmp_path):
    dp = _dataproto(rows=4, seed=4, prompt_lengths=[0, 3, 0, P])
    with RunWriter(tmp_path, tokenizer=_Vocab()) as run:
        run.write_batch(1, dp)
    prompts = _table(tmp_path)["prompt_tokens"].to_pylist()
    assert [len(p) for p in prompts] == [0, 3, 0, P]
    assert prompts[1] == [f"t{int(i)}" for i in dp.batch["prompts"][1, P - 3:]]


def test_without_a_tokenizer_there_is_no_text(tmp_path):
    with RunWriter(tmp_path) as run:
        run.write_batch(1, _dataproto(seed=5))
    names = set(_table(tmp_path).column_names)
    assert not {"prompt_tokens", "response_tokens"} & names


def test_without_prompts_only_the_response_text_is_stored(tmp_path):
    dp = _dataproto(seed=6)
    del dp.batch["prompts"]
    with RunWriter(tmp_path, tokenizer=_Vocab()) as run:
        run.write_batch(1, dp)
    names = set(_table(tmp_path).column_names)
    assert "response_tokens" in names and "prompt_tokens" not in names


def test_prompt_text_needs_the_prompt_part_of_the_attention_mask(tmp_path):
    dp = _dataproto(seed=7)
    dp.batch["attention_mask"] = dp.batch["attention_mask"][:, P:]  # the response part only
    run = RunWriter(tmp_path, tokenizer=_Vocab(), on_error="raise")
    with pytest.raises(MissingInputError, match="prompt part of attention_mask") as err:
        run.write_batch(1, dp)
    assert err.value.column == "attention_mask" and err.value.step == 1
    run.close()


def test_prompts_wider_than_the_prompt_part_of_the_mask_are_refused(tmp_path):
    dp = _dataproto(seed=8)
    dp.batch["prompts"] = torch.cat([dp.batch["prompts"], dp.batch["prompts"][:, :1]], 1)
    run = RunWriter(tmp_path, tokenizer=_Vocab(), on_error="raise")
    with pytest.raises(BatchError, match=r"expected \(rows, prompt width\) = \(6, 5\)") as err:
        run.write_batch(1, dp)
    assert err.value.column == "prompts"
    run.close()


def test_the_engine_loads_a_batch_with_text_without_reading_it(tmp_path):
    dp = _dataproto(seed=9)
    with RunWriter(tmp_path, tokenizer=_Vocab()) as run:
        run.write_batch(1, dp)
    sf = RunDir(tmp_path).step_files()[0]
    settings = resolve_settings(overrides={"algorithm.adv_estimator": "grpo"})
    step = load_step(sf, settings, recompute_columns(settings))
    assert not {"prompt_tokens", "response_tokens"} & set(step.batch.extra)
    # named explicitly, the text columns are checked and still kept away from the engine's batch
    step = load_step(sf, settings, ["uid", "response_mask", "token_level_scores", "prompt_tokens", "response_tokens"])
    assert not {"prompt_tokens", "response_tokens"} & set(step.batch.extra)
    assert step.n_rows == 6
