"""The text columns (``response_tokens``, ``prompt_tokens``: list<string>, for display) are
checked by the loader's validation and never reach the engine."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pytest

from rldiag.errors import BatchError
from rldiag.io.loader import validate_table
from rldiag.io.rundir import StepFile

SF = StepFile(3, Path("batches/step_000003.parquet"))


def _table(**text) -> pa.Table:
    cols = {
        "uid": pa.array(["a", "a"]),
        "response_mask": pa.array([[1, 1, 0], [1]], pa.list_(pa.int8())),
        "score": pa.array([1.0, 0.0]),
    }
    return pa.table({**cols, **text})


def test_text_columns_of_any_prompt_length_are_valid():
    table = _table(response_tokens=pa.array([["a", "b", "<obs>"], ["c"]], pa.list_(pa.string())),
                   prompt_tokens=pa.array([["1", "2", "3", "4", "="], []], pa.large_list(pa.large_string())))
    ragged = validate_table(table, SF)
    assert set(ragged) == {"response_mask"}  # checked, not handed over as token values


@pytest.mark.parametrize("name", ["response_tokens", "prompt_tokens"])
def test_a_text_column_must_hold_strings(name):
    with pytest.raises(BatchError, match=r"expected list<string>") as err:
        validate_table(_table(**{name: pa.array([[1, 2, 3], [4]], pa.list_(pa.int64()))}), SF)
    assert err.value.column == name and err.value.step == 3
    with pytest.raises(BatchError, match=r"expected list<string>"):
        validate_table(_table(**{name: pa.array(["abc", "d"])}), SF)


@pytest.mark.parametrize("name", ["response_tokens", "prompt_tokens"])
def test_null_lists_and_null_tokens_are_refused(name):
    with pytest.raises(BatchError, match="the row's list is null") as err:
        validate_table(_table(**{name: pa.array([["a", "b", "c"], None], pa.list_(pa.string()))}), SF)
    assert err.value.row == 1
    with pytest.raises(BatchError, match="token 1 is null") as err:
        validate_table(_table(**{name: pa.array([["a", "b", "c"], ["d", None]], pa.list_(pa.string()))}), SF)
    assert err.value.row == 1 and err.value.column == name


def test_response_text_has_one_string_per_response_token():
    bad = pa.array([["a", "b"], ["c"]], pa.list_(pa.string()))
    with pytest.raises(BatchError, match="has 2 token strings but response_mask has 3 tokens") as err:
        validate_table(_table(response_tokens=bad), SF)
    assert err.value.row == 0 and err.value.column == "response_tokens"
    validate_table(_table(prompt_tokens=bad), SF)  # a prompt has its own length
