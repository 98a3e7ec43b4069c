"""Differential test of ``rldiag rescore --reward verl:default`` against verl 0.9.1's own
``default_compute_score`` on a gsm8k-shaped run built here: the capture decodes each response as
verl's reward manager does (a Hugging Face tokenizer built offline with the ``tokenizers``
package, ``skip_special_tokens=True``), and each row's new score is verl's on that string, as
float32."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

pytest.importorskip("verl")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

from verl.utils.reward_score import default_compute_score  # noqa: E402

from rldiag.capture import RunWriter  # noqa: E402
from rldiag.errors import RewardError  # noqa: E402
from rldiag.io.run_layout import RunLayout  # noqa: E402
from rldiag.scenario.rescore import rescore  # noqa: E402

pytestmark = pytest.mark.slow  # worker processes

ROWS = [  # (data source, response, ground truth)
    ("openai/gsm8k", "She has 3 + 4 = 7 apples . #### 7 <eos>", "7"),
    ("openai/gsm8k", "The total is #### 1,234 <eos>", "1234"),
    ("openai/gsm8k", "I think 12 then #### 13 <eos>", "12"),
    ("openai/gsm8k", "no final answer here , 42 <eos>", "42"),
    ("openai/gsm8k", "#### -5 <pad> <eos>", "-5"),
    ("openai/gsm8k", "#### $ 8 <eos>", "8"),
    ("lighteval/MATH", "so the answer is \\boxed{\\frac{1}{2}} <eos>", "\\frac{1}{2}"),
    ("lighteval/MATH", "we get \\boxed{3} <eos>", "4"),
]


def _tokenizer(texts: list[str]):
    from tokenizers import Tokenizer, models, pre_tokenizers

    words = ["<pad>", "<eos>", "<unk>"] + sorted({w for t in texts for w in t.split()} - {"<pad>", "<eos>"})
    tk = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>",
                                                unk_token="<unk>")


def _gsm8k_run(path: Path, rows=ROWS) -> tuple[Path, object, list[list[int]]]:
    tok = _tokenizer([r[1] for r in rows] + ["question"])
    ids = [tok.convert_tokens_to_ids(r[1].split()) for r in rows]
    width = max(map(len, ids))
    pad = tok.pad_token_id
    responses = torch.full((len(rows), width), pad)
    attn = torch.zeros((len(rows), width), dtype=torch.long)
    for i, x in enumerate(ids):
        responses[i, : len(x)], attn[i, : len(x)] = torch.tensor(x), 1
    batch = {"prompts": torch.full((len(rows), 1), tok.convert_tokens_to_ids("question")), "responses": responses,
             "response_mask": attn, "attention_mask": torch.cat([torch.ones((len(rows), 1), dtype=torch.long), attn], 1),
             "token_level_scores": attn.float() * 0.0}
    non = {"uid": np.array([f"p{i // 2}" for i in range(len(rows))], dtype=object),
           "data_source": np.array([r[0] for r in rows], dtype=object),
           "reward_model": np.array([{"ground_truth": r[2], "style": "rule"} for r in rows], dtype=object),
           "extra_info": np.array([{"split": "train", "index": np.int64(i)} for i in range(len(rows))], dtype=object)}
    config = {"algorithm": {"adv_estimator": "grpo"}, "actor_rollout_ref": {"rollout": {"n": 2}}}
    with RunWriter(path, config=config, tokenizer=tok, on_error="raise") as w:
        w.write_batch(1, SimpleNamespace(batch=batch, non_tensor_batch=non))
    return path, tok, ids


def test_verl_default_rescores_as_verl_scores_the_same_strings(tmp_path):
    run, tok, ids = _gsm8k_run(tmp_path / "run")
    table = pq.read_table(run / "batches" / "step_000001.parquet")
    # the decode half: verl's reward manager's string, special tokens skipped
    decoded = [tok.decode(x, skip_special_tokens=True) for x in ids]
    assert table["response_text"].to_pylist() == decoded
    assert "<eos>" not in decoded[0] and "<pad>" not in decoded[4]
    assert json.loads(table["extra_info"].to_pylist()[3]) == {"split": "train", "index": 3}
    rep = rescore(run, "verl:default", workers=2)
    assert rep.ok and not rep.failures
    want = [np.float32(default_compute_score(data_source=ds, solution_str=s, ground_truth=gt, extra_info={}))
            for (ds, _, gt), s in zip(ROWS, decoded)]
    assert sorted(set(want)) == [0.0, 1.0]  # both verdicts are exercised
    rows = pq.read_table(RunLayout(run).scenario("reward=default_compute_score").rows_file(1))
    np.testing.assert_array_equal(np.float32(rows["score"].to_numpy()), np.asarray(want, dtype=np.float32))
    assert rep.changed == int(sum(w != 0.0 for w in want))


def test_verl_default_refuses_code_executing_sources_unless_allowed(tmp_path):
    rows = [("codecontests", "print ( 1 ) <eos>", "[]"), ("openai/gsm8k", "#### 1 <eos>", "1")]
    run, _, _ = _gsm8k_run(tmp_path / "run", rows)
    with pytest.raises(RewardError, match="codecontests .*--allow-code-exec"):
        rescore(run, "verl:default", workers=1)
    assert not RunLayout(run).scenario("reward=default_compute_score").dir.exists()
