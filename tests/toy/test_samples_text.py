"""The bundled samples carry the text of every token: ``response_tokens`` (one string per
response token) and ``prompt_tokens`` (one per prompt token), and that text is what the trainer
scored: the grader, run on the text, gives every row its stored score."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from rldiag.io.loader import validate_table
from rldiag.io.rundir import RunDir
from rldiag.toy.config import PRESETS
from rldiag.toy.task import DIGITS, PAD, SEP, TOKEN_NAMES, Prompts, score_responses

SAMPLES = Path(__file__).resolve().parents[2] / "samples"
IDS = {name: i for i, name in enumerate(TOKEN_NAMES)}


def _padded(rows: list[list[int]], width: int, fill: int) -> torch.Tensor:
    out = torch.full((len(rows), width), fill, dtype=torch.long)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=torch.long)
    return out


def _prompts_of(texts: list[list[str]]) -> Prompts:
    """The grader's view of the prompts written as text: the answer is the sum of the digits."""
    sums = [sum(int(w) for w in t[:-1]) for t in texts]
    answers = [[int(c) for c in str(s)] for s in sums]
    width = max(len(a) for a in answers)
    target = _padded(answers, width, PAD)
    empty = torch.zeros((len(texts), 1), dtype=torch.long)
    return Prompts(empty, empty, target, torch.tensor([len(a) for a in answers]), empty, torch.zeros(len(texts)))


@pytest.mark.parametrize("name", ["grpo-tool", "ppo-gae"])
def test_the_samples_have_the_text_of_every_token(name):
    run = SAMPLES / name
    cfg = PRESETS[name]()
    files = RunDir(run).step_files()
    assert len(files) == cfg.steps
    for sf in files:
        table = pq.read_table(sf.path)
        validate_table(table, sf)  # list<string>, no null, response_tokens of the row's length
        for col in ("response_tokens", "prompt_tokens"):
            t = table.schema.field(col).type
            assert pa.types.is_list(t) and pa.types.is_string(t.value_type), (sf.step, col, t)
        masks = table["response_mask"].to_pylist()
        responses, prompts = table["response_tokens"].to_pylist(), table["prompt_tokens"].to_pylist()
        assert [len(r) for r in responses] == [len(m) for m in masks]
        assert [len(p) for p in prompts] == table["prompt_length"].to_pylist()
        assert {w for r in responses for w in r} <= set(TOKEN_NAMES)
        for p in prompts:  # the digits, then "="; no padding
            assert p[-1] == TOKEN_NAMES[SEP] and all(w in TOKEN_NAMES[:DIGITS] for w in p[:-1])
        # the grader reads the text as the trainer's grader read the token ids: the stored scores
        lengths = torch.tensor([len(r) for r in responses])
        width = cfg.max_response_length
        ids = _padded([[IDS[w] for w in r] for r in responses], width, PAD)
        mask = _padded(masks, width, 0)
        score, _ = score_responses(ids, mask, lengths, _prompts_of(prompts), cfg.partial_credit)
        np.testing.assert_array_equal(score.double().numpy(), np.asarray(table["score"].to_pylist()),
                                      err_msg=f"{name} step {sf.step}")


@pytest.mark.parametrize("name", ["grpo-tool", "ppo-gae"])
def test_the_samples_carry_what_a_reward_function_reads(name):
    """``data_source``, ``ground_truth`` / ``extra_info`` (JSON text), ``response_text`` and
    ``prompt_text`` (decoded with ``skip_special_tokens=True``): the task's reward as a verl-style
    function, called on them as verl calls it, gives every row its stored score (float32)."""
    import json

    from rldiag.toy.task import ToyTokenizer, compute_score

    tok = ToyTokenizer()
    cfg = PRESETS[name]()
    for sf in RunDir(SAMPLES / name).step_files():
        table = pq.read_table(sf.path)
        for col in ("data_source", "ground_truth", "extra_info", "response_text", "prompt_text"):
            assert pa.types.is_string(table.schema.field(col).type), (sf.step, col)
        assert set(table["reward_inputs_repr"].to_pylist()) == {0}
        responses = table["response_tokens"].to_pylist()
        texts = table["response_text"].to_pylist()
        assert texts == [tok.decode([IDS[w] for w in r], skip_special_tokens=True) for r in responses]
        assert table["prompt_text"].to_pylist() == ["".join(p[:-1]) + " =" for p in table["prompt_tokens"].to_pylist()]
        truths = [json.loads(g) for g in table["ground_truth"].to_pylist()]
        assert truths == [str(sum(int(w) for w in p[:-1])) for p in table["prompt_tokens"].to_pylist()]
        assert all(isinstance(g, str) for g in truths)  # JSON text of a string: '"16"'
        extras = [json.loads(e) for e in table["extra_info"].to_pylist()]
        assert extras == [{"partial_credit": cfg.partial_credit}] * table.num_rows
        scores = [np.float32(compute_score(data_source=d, solution_str=s, ground_truth=g, extra_info=e))
                  for d, s, g, e in zip(table["data_source"].to_pylist(), texts, truths, extras)]
        np.testing.assert_array_equal(np.asarray(scores, dtype=np.float64), np.asarray(table["score"].to_pylist()),
                                      err_msg=f"{name} step {sf.step}")


def test_the_toy_tokenizer_keeps_eos_and_the_numbers_a_pad_splits():
    from rldiag.toy.task import ToyTokenizer, compute_score

    tok = ToyTokenizer()
    ids = [IDS[w] for w in ["1", "<pad>", "2", "<call>", "<obs>", "1", "6", "</obs>", "<eos>"]]
    assert tok.decode(ids) == "1 <pad> 2 <call> <obs> 16 </obs> <eos>"
    assert tok.decode(ids, skip_special_tokens=True) == "1 2 <call> <obs> 16 </obs> <eos>"
    assert compute_score("toy/digit_sum", "1 2 <eos>", "21") == 0.25  # the last number, 2: one digit of two in place
    assert compute_score("toy/digit_sum", "1 2 <eos>", "12") == 0.0
    assert compute_score("toy/digit_sum", "12 <eos>", "12") == 1.0
    assert compute_score("toy/digit_sum", "12", "12") == 0.5 * 1.0  # no <eos>: partial credit only
