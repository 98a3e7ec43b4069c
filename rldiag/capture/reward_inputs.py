"""What a reward function reads, per row, as batch columns (docs/run-directory.md).

verl's reward managers call ``compute_score(data_source=, solution_str=, ground_truth=,
extra_info=)`` per row (``verl/workers/reward_manager/naive.py`` ``NaiveRewardManager.__call__``,
``verl/experimental/reward_loop/reward_manager/naive.py`` ``run_single``): the data source is the
non-tensor field ``data_source``, the ground truth ``reward_model["ground_truth"]``, and
``extra_info`` a dict. The capture keeps them as strings:

- ``data_source``: the value as text;
- ``ground_truth`` and ``extra_info``: always JSON text (``"\\"42\\""`` for the string ``42``;
  numpy scalars and arrays as JSON numbers and lists). A value JSON cannot hold is stored as its
  ``repr`` and the row is flagged (``reward_inputs_repr`` = 1), so that a rescore reports it rather
  than hand the function a string in place of the object.

The solution and prompt strings (``response_text``, ``prompt_text``) are decoded from the token
ids on the writer thread (:func:`decoded_texts`).
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from rldiag.errors import BatchError
from rldiag.io.schema import REWARD_INPUT_REPR_COLUMN

#: the non-tensor fields read (verl's names) and the columns they become
DATA_SOURCE_KEY = "data_source"
REWARD_MODEL_KEY = "reward_model"
GROUND_TRUTH_KEY = "ground_truth"
EXTRA_INFO_KEY = "extra_info"


def _plain(value: Any) -> Any:
    """A numpy scalar or array as the Python number or list JSON holds; raises TypeError otherwise."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"{type(value).__name__} is not JSON serializable")


def json_text(value: Any) -> tuple[str, bool]:
    """``(text, exact)``: ``value`` as JSON text, or its ``repr`` with ``exact`` False when JSON
    cannot hold it (a set, an object, a circular structure)."""
    try:
        return json.dumps(value, default=_plain, ensure_ascii=False), True
    except (TypeError, ValueError):
        return repr(value), False


def _objects(value: Any, name: str, rows: int, where: Mapping[str, Any]) -> list[Any]:
    values = value.tolist() if isinstance(value, np.ndarray) else list(value)
    if len(values) != rows:
        raise BatchError(f"has {len(values)} values; expected one per row ({rows})", column=name, **where)
    return values


def reward_input_columns(non: Mapping[str, Any], rows: int, where: Mapping[str, Any]) -> dict[str, np.ndarray]:
    """The per-row columns ``data_source``, ``ground_truth``, ``extra_info`` (and the flag
    ``reward_inputs_repr`` with either of the last two) from a batch's non-tensor fields; the
    fields the batch lacks give no column. ``(rows,)`` numpy arrays (str, or int8 for the flag)."""
    out: dict[str, np.ndarray] = {}
    if non.get(DATA_SOURCE_KEY) is not None:
        out[DATA_SOURCE_KEY] = np.array([str(v) for v in _objects(non[DATA_SOURCE_KEY], DATA_SOURCE_KEY, rows, where)],
                                        dtype=object)
    flags = np.zeros(rows, dtype=np.int8)
    encoded = False
    if non.get(REWARD_MODEL_KEY) is not None:
        infos = _objects(non[REWARD_MODEL_KEY], REWARD_MODEL_KEY, rows, where)
        texts = []
        for i, info in enumerate(infos):
            if not isinstance(info, Mapping):
                raise BatchError(f"expected a mapping with {GROUND_TRUTH_KEY!r} (verl's reward_model), found "
                                 f"{type(info).__name__}", row=i, column=REWARD_MODEL_KEY, **where)
            text, exact = json_text(info.get(GROUND_TRUTH_KEY))
            texts.append(text)
            flags[i] |= not exact
        out[GROUND_TRUTH_KEY], encoded = np.array(texts, dtype=object), True
    if non.get(EXTRA_INFO_KEY) is not None:
        texts = []
        for i, info in enumerate(_objects(non[EXTRA_INFO_KEY], EXTRA_INFO_KEY, rows, where)):
            text, exact = json_text(info if info is not None else {})
            texts.append(text)
            flags[i] |= not exact
        out[EXTRA_INFO_KEY], encoded = np.array(texts, dtype=object), True
    if encoded:
        out[REWARD_INPUT_REPR_COLUMN] = flags
    return out


def _decodes(fn: Any) -> bool:
    """Whether ``fn`` is a decode that takes ``skip_special_tokens`` (by name or ``**kwargs``)."""
    if not callable(fn):
        return False
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: trust the name
        return True
    return any(p.name == "skip_special_tokens" or p.kind is inspect.Parameter.VAR_KEYWORD for p in params)


def decoded_texts(tokenizer: Any, ids: np.ndarray, lengths: np.ndarray) -> list[str] | None:
    """Each row's ids decoded as verl's reward manager decodes them (``skip_special_tokens=True``):
    ``ids`` flat ``(sum L_i,)``, ``lengths`` ``(rows,)``. One ``batch_decode`` call when the
    tokenizer has it (Hugging Face tokenizers do), else ``decode`` per row; None when the tokenizer
    has neither taking ``skip_special_tokens`` (a vocabulary that only names tokens)."""
    batch: Callable[..., Sequence[str]] | None = getattr(tokenizer, "batch_decode", None)
    single: Callable[..., str] | None = getattr(tokenizer, "decode", None)
    batch = batch if _decodes(batch) else None
    single = single if _decodes(single) else None
    if batch is None and single is None:
        return None
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    flat = ids.tolist()
    per_row = [flat[bounds[i]:bounds[i + 1]] for i in range(len(lengths))]
    if batch is not None:
        out = list(batch(per_row, skip_special_tokens=True))
    else:
        assert single is not None
        out = [single(r, skip_special_tokens=True) for r in per_row]
    if len(out) != len(per_row):
        raise BatchError(f"the tokenizer decoded {len(out)} texts for {len(per_row)} rows", column="response_text")
    return [str(t) for t in out]
