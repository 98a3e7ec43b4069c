"""rldiag.viz.transcript: one row's transcript as HTML (escaped, one span per token, tool
observations marked, colours by sign), the filter the Rollouts widgets make, the tables' columns."""

from __future__ import annotations

import re

import polars as pl

from rldiag.viz.colours import NEGATIVE_RGB as NEG
from rldiag.viz.colours import POSITIVE_RGB as POS
from rldiag.viz.transcript import (
    ONE,
    colour,
    filter_expression,
    pages,
    row_label,
    segments,
    shown,
    sql_string,
    table_columns,
    transcript_html,
    values_at,
)

TOKENS = ["Hi", " <script>alert(1)</script>", " & ", "\n", "obs", "erv", "ed", " ok", "."]
MASK = [1, 1, 1, 1, 0, 0, 0, 1, 1]


def _spans(body: str) -> list[str]:
    return re.findall(r'<span class="tok[^"]*"[^>]*>.*?</span>', body)


def test_one_span_per_token_text_escaped_and_tool_tokens_marked():
    body = transcript_html(["What", "?"], TOKENS, MASK, [0.5, -0.5, 0.0, 1.0, 9.0, 9.0, 9.0, -1.0, None], "advantage")
    spans = _spans(body)
    assert len(spans) == len(TOKENS) == body.count('class="tok')
    assert "<script>" not in body and "&lt;script&gt;alert(1)&lt;/script&gt;" in body
    assert "&amp;" in body and "⏎<br>" in body
    tool = [s for s in spans if 'class="tok tool"' in s]
    assert len(tool) == 3 and all("background" not in s for s in tool)  # tool tokens: grey, never coloured
    assert body.count("tool observation (not trained on)") == 1
    assert body.count(">turn 1<") == 1 and body.count(">turn 2<") == 1
    assert "What?" in body and "no prompt text" not in body


def test_colours_by_sign_around_the_neutral_value():
    body = transcript_html(None, ["a", "b", "c", "d"], [1, 1, 1, 1], [2.0, -1.0, 0.0, None], "advantage")
    a, b, c, d = _spans(body)
    # the app's convention (rldiag.viz.colours): blue above the neutral value, red below
    assert POS == (33, 102, 172) and NEG == (178, 24, 43)
    assert f"rgba({POS[0]},{POS[1]},{POS[2]},0.850)" in a  # the largest |value|: full colour, blue above 0
    assert f"rgba({NEG[0]},{NEG[1]},{NEG[2]},0.425)" in b  # half as far, red below
    assert "background: transparent" in c and "background: transparent" in d
    assert "no prompt text" in body and "advantage: blue above 0, red below" in body
    ratio = _spans(transcript_html(None, ["a", "b"], [1, 1], [1.5, 0.5], "ratio"))
    assert f"rgba({POS[0]}" in ratio[0] and f"rgba({NEG[0]}" in ratio[1]  # ratios diverge around 1
    weight = _spans(transcript_html(None, ["a", "b"], [1, 1], [0.2, 0.0], "loss_weight"))
    assert f"rgba({ONE[0]},{ONE[1]},{ONE[2]},0.850)" in weight[0] and "transparent" in weight[1]  # one hue from 0


def test_without_text_each_token_is_a_dot_and_values_may_be_sparse():
    body = transcript_html(None, None, [1, 0, 1], values_at(3, [0, 2], [0.1, -0.2]), "rollout_kl")
    assert len(_spans(body)) == 3 and body.count(">·</span>") == 3
    assert values_at(4, [1, 3, 9], [1.0, 2.0, 3.0]) == [None, 1.0, None, 2.0]
    assert transcript_html(None, [], [], None, "advantage").count('class="tok') == 0


def test_segments_and_colour_edges():
    assert segments([1, 1, 0, 0, 1, 0]) == [("turn", 0, 2), ("tool", 2, 4), ("turn", 4, 5), ("tool", 5, 6)]
    assert segments([]) == []
    assert colour(float("nan"), 0.0, 1.0) == "transparent" and colour(1.0, 0.0, 0.0) == "transparent"
    assert colour(-5.0, 0.0, 1.0, signed=False) == "transparent"  # below 0 on a one-hue scale: no colour


def test_the_filter_the_widgets_make():
    assert filter_expression() is None
    got = filter_expression({"is_weight_seq": (5, None), "length": (None, 100)}, cap=512, no_signal=True,
                            sign_differs="sign(a) <> sign(b)", where=" score > 0 OR reward < 0 ")
    assert got == ('"is_weight_seq" >= 5.0 AND "length" <= 100.0 AND length = 512 AND group_has_signal = 0 '
                   "AND (sign(a) <> sign(b)) AND (score > 0 OR reward < 0)")
    assert sql_string("it's") == "'it''s'"


def test_table_columns_labels_and_pages():
    assert table_columns(["acc", "row", "step", "response", "uid"]) == ["step", "row", "uid", "response", "acc"]
    frame = pl.DataFrame({"row": [0, 1], "step": [1, 1], "response": [None, None], "acc": [1.0, 0.0]})
    assert shown(frame).columns == ["step", "row", "acc"]  # no text: no response column
    assert shown(frame.with_columns(pl.Series("response", ["a", None])), ["row", "response"]).columns == ["row", "response"]
    assert row_label({"step": 3, "row": 5, "uid": "p1", "score": 1.0, "advantage_mean": 0.4123}) == (
        "step 3 · row 5 · uid p1 · score 1 · adv 0.412")
    assert pages(0, 50) == 1 and pages(50, 50) == 1 and pages(51, 50) == 2
