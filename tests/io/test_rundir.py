from __future__ import annotations

import pytest

from rldiag.errors import ConfigError
from rldiag.io.rundir import iter_metrics_lines, parse_steps


@pytest.mark.parametrize(
    "spec, expected",
    [(None, [1, 2, 5, 9]), ("5", [5]), ("2:5", [2, 5]), ("5:", [5, 9]), (":2", [1, 2]), ("9,1", [1, 9])],
)
def test_parse_steps(spec, expected):
    assert parse_steps(spec, [1, 2, 5, 9]) == expected


@pytest.mark.parametrize("spec", ["3", "x", "5:2", "20:30"])
def test_parse_steps_errors(spec):
    with pytest.raises(ConfigError):
        parse_steps(spec, [1, 2, 5, 9])


def test_metrics_lines_both_forms_and_partial_last_line(tmp_path):
    p = tmp_path / "metrics.jsonl"
    p.write_text(
        '{"step": 1, "data": {"actor/pg_clipfrac": 0.1, "note": "x"}}\n'
        'garbage\n'
        '{"step": 2, "actor/pg_clipfrac": 0.2, "flag": true}\n'
        '{"step": 3, "actor/pg_clip'
    )
    assert list(iter_metrics_lines(p)) == [(1, {"actor/pg_clipfrac": 0.1}), (2, {"actor/pg_clipfrac": 0.2})]
    with p.open("a") as fh:
        fh.write('frac": 0.3}\n')
    assert list(iter_metrics_lines(p))[-1] == (3, {"actor/pg_clipfrac": 0.3})
