"""The one table of settings (rldiag/config/schema.py): the docs table is generated from it, every
key the settings resolve is declared there, and the What-if widgets' bounds sit inside the valid
ranges."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from rldiag.config import schema
from rldiag.config.settings import DEFAULTS, resolve_settings

DOC = Path(__file__).resolve().parents[2] / "docs" / "settings.md"


def test_the_docs_table_is_the_schemas():
    text = DOC.read_text()
    table = re.search(r"<!-- settings-table:start -->\n(.*)<!-- settings-table:end -->", text, re.S)
    assert table, "docs/settings.md has lost its generated table's markers"
    assert table.group(1) == schema.markdown_table(), "regenerate it: python -m rldiag.config.schema"


def test_every_resolved_key_is_declared_once():
    keys = [s.key for s in schema.SETTINGS]
    assert len(keys) == len(set(keys))
    assert set(resolve_settings().values) == set(keys) == set(DEFAULTS)


@pytest.mark.parametrize("s", [s for s in schema.SETTINGS if s.widget is not None], ids=lambda s: s.key)
def test_widget_bounds_are_valid_values(s):
    w = s.widget
    assert w.lo < w.hi and 0 < w.step <= w.hi - w.lo
    assert s.valid.contains(w.hi) and (s.valid.contains(w.lo) or (w.lo == s.valid.lo and s.valid.lo_open))
    assert s.default is None or w.lo <= s.default <= w.hi


def test_choices_name_real_registries():
    from rldiag.engine.advantage import ESTIMATORS
    from rldiag.engine.aggregation import AGG_MODES
    from rldiag.engine.kl import KL_ESTIMATORS
    from rldiag.engine.policy_loss import POLICY_LOSSES
    from rldiag.engine.rollout_correction import IS_LEVELS, RS_OPTIONS

    registries = dict(ESTIMATORS=ESTIMATORS, AGG_MODES=AGG_MODES, KL_ESTIMATORS=KL_ESTIMATORS,
                      POLICY_LOSSES=POLICY_LOSSES, IS_LEVELS=IS_LEVELS, RS_OPTIONS=RS_OPTIONS)
    for s in schema.SETTINGS:
        if s.choices is not None:
            reg = registries[s.choices]
            if s.default is not None:
                assert s.default in reg.names(), (s.key, s.default)
