"""Arrow <-> NumPy without pandas (rldiag.io.arrays): values, nulls, slices and types survive."""

from __future__ import annotations

import subprocess
import sys

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import settings as hsettings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from rldiag.io.arrays import floats_or_null, from_numpy, read_parquet, to_numpy

DTYPES = [np.int8, np.int32, np.int64, np.uint8, np.float32, np.float64]


@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip_keeps_values_and_type(dtype):
    values = (np.arange(50) * 3 - 20).astype(dtype)
    arr = from_numpy(values)
    assert arr.type == pa.from_numpy_dtype(np.dtype(dtype)) and arr.null_count == 0
    assert arr.to_pylist() == values.tolist()
    back = to_numpy(arr)
    assert back.dtype == values.dtype and np.array_equal(back, values)


@hsettings(deadline=None)  # a first call imports pyarrow's compute kernels: no timing assertions
@given(arrays(np.float32, st.integers(0, 64)), st.integers(0, 10), st.integers(0, 10))
def test_slices_read_their_own_window(values, start, length):
    arr = pa.array(values, type=pa.float32()).slice(start, length)
    got = to_numpy(arr)
    want = values[start:start + length]
    assert got.shape == want.shape and np.array_equal(got, want, equal_nan=True)


def test_booleans_and_nulls():
    b = pa.array([True, False, True, True])
    assert to_numpy(b).dtype == np.bool_ and to_numpy(b).tolist() == [True, False, True, True]
    assert to_numpy(b.slice(1, 2)).tolist() == [False, True]
    with_null = pa.array([1.0, None, 3.0])
    got = to_numpy(with_null)  # Arrow's own conversion: NaN where null
    assert got[0] == 1.0 and np.isnan(got[1]) and got[2] == 3.0


def test_valid_mask_makes_nulls_and_nan_stays_a_value():
    arr = from_numpy(np.array([1.5, np.nan, 2.5, 4.0]), np.array([True, True, False, True]))
    assert arr.null_count == 1
    py = arr.to_pylist()
    assert py[0] == 1.5 and np.isnan(py[1]) and py[2] is None and py[3] == 4.0
    assert floats_or_null([1.0, None, float("nan")]).to_pylist()[:2] == [1.0, None]
    assert np.isnan(floats_or_null([float("nan")]).to_pylist()[0])
    assert floats_or_null([]).to_pylist() == [] and floats_or_null([]).type == pa.float64()


def test_from_numpy_rejects_what_is_not_a_flat_number_array():
    with pytest.raises(TypeError, match="1-D number array"):
        from_numpy(np.zeros((2, 2)))
    with pytest.raises(TypeError, match="1-D number array"):
        from_numpy(np.array(["a", "b"]))


def test_non_contiguous_input_is_copied_not_misread():
    base = np.arange(10, dtype=np.int64)
    arr = from_numpy(base[::2])
    assert arr.to_pylist() == [0, 2, 4, 6, 8]


def test_read_parquet_reads_columns_from_a_path_or_a_buffer(tmp_path):
    table = pa.table({"a": from_numpy(np.arange(5, dtype=np.int64)), "b": floats_or_null([1.0, None, 3.0, 4.0, 5.0])})
    path = tmp_path / "t.parquet"
    pq.write_table(table, path)
    assert read_parquet(str(path)).equals(table)
    assert read_parquet(pa.BufferReader(path.read_bytes()), columns=["b"], threads=False).equals(table.select(["b"]))


@pytest.mark.slow
def test_recompute_does_not_import_pandas(tmp_path):
    """pandas costs 0.2 s to import; nothing on the recompute path needs it."""
    from rldiag.synth import SynthSpec, write_synth_run

    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=1))  # (synth itself may use pandas)
    code = (
        "import sys\n"
        "from rldiag.scenario.recompute import recompute\n"
        f"run = {str(run)!r}\n"
        "recompute(run, name='a', save_tokens=True)\n"
        "recompute(run, name='a', save_tokens=True)\n"  # the reuse path reads the scenario back
        "print('pandas' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip().splitlines()[-1] == "False"
