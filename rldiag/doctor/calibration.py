"""The shipped calibration: each rule's (and gap cause's) measured precision, recall, false alarms
and lead time on the calibration corpus, attached to every finding as ``evidence.calibration``.

``rldiag/doctor/calibration.json`` is what ``rldiag calibrate`` wrote for the shipped corpus
(:mod:`rldiag.analysis.calibrate`; its ``runs`` list left out). The figures are the ``test``
split's (thresholds are tuned on ``train`` only). ``python -m rldiag.doctor.calibration`` prints
docs/calibration.md, rendered from that file (:func:`render_markdown`); a test pins the two.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

#: the calibration shipped with rldiag
SHIPPED = Path(__file__).with_name("calibration.json")
#: the split whose figures findings carry
REPORTED_SPLIT = "test"
KEYS = ("precision", "recall", "false_alarms_per_100_steps", "lead_steps", "corpus")


@lru_cache(maxsize=4)
def load(path: Path = SHIPPED) -> dict[str, Any] | None:
    """The calibration file (None when absent)."""
    if not path.is_file():
        return None
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def corpus_name(cal: dict[str, Any]) -> str:
    c = cal.get("corpus", {})
    return f"rldiag toy corpus ({c.get('size') or 'custom'}, seed {c.get('seed')}, {REPORTED_SPLIT} split)"


def row_for(cal: dict[str, Any] | None, rule: str, cause: str | None, split: str = REPORTED_SPLIT) -> dict[str, Any] | None:
    if cal is None:
        return None
    for row in cal.get("splits", {}).get(split, {}).get("rules", []):
        if row["rule"] == rule and row.get("cause") == cause:
            return dict(row)
    return None


def calibration_for(rule: str, cause: str | None = None, cal: dict[str, Any] | None = None) -> dict[str, Any]:
    """``evidence.calibration`` of a finding of ``rule`` (and ``cause``): ``precision``,
    ``recall``, ``false_alarms_per_100_steps``, ``lead_steps`` (median steps from the first
    alert to the labelled onset; positive = early), ``corpus``, and ``status`` (``calibrated``,
    ``not enough data``, ``uncalibrated``: fires on no planted run, ``never fired``, or ``no
    calibration``); the figures are None unless calibrated. ``text``: the one line the report
    and the Health page show."""
    cal = load() if cal is None else cal
    row = row_for(cal, rule, cause)
    out: dict[str, Any] = dict.fromkeys(KEYS)
    if cal is not None:
        out["corpus"] = corpus_name(cal)
    if row is None:
        out["status"] = "no calibration"
    else:
        out["status"] = row["status"]
        out["detects"] = row.get("detects")
        out["alerted_runs"] = row.get("fired")
        if row["status"] == "calibrated":
            for k in ("precision", "recall", "false_alarms_per_100_steps", "lead_steps"):
                out[k] = row.get(k)
            out["precision_ci"], out["recall_ci"] = row.get("precision_ci"), row.get("recall_ci")
    out["text"] = sentence(out)
    return out


def _num(v: float | None, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def steps_text(n: float) -> str:
    """``1 step``, ``2.5 steps``."""
    return f"{n:g} step" + ("" if n == 1 else "s")


def lead_words(lead: float | None, kind: str | None) -> str:
    what = f"the onset of {kind}" if kind else "the labelled onset"
    if lead is None:
        return f"no lead time ({what} not labelled)"
    if lead > 0:
        return f"fires {steps_text(lead)} before {what}"
    if lead < 0:
        return f"fires {steps_text(-lead)} after {what}"
    return f"fires at {what}"


def sentence(cal: dict[str, Any]) -> str:
    """One line: what the calibration corpus says of a finding like this one."""
    status = cal.get("status")
    if status == "calibrated":
        return (f"on the calibration corpus: precision {_num(cal['precision'])}, recall {_num(cal['recall'])}, "
                f"{lead_words(cal['lead_steps'], cal.get('detects'))}, "
                f"{_num(cal['false_alarms_per_100_steps'])} false alarms per 100 healthy steps")
    if status == "no calibration":
        return "no calibration: the calibration corpus has no figures for this rule"
    if status == "not enough data":
        return (f"not calibrated: alerted on {cal.get('alerted_runs')} run(s) of the calibration corpus, "
                "too few to measure")
    if status == "uncalibrated":
        return "uncalibrated: on the calibration corpus it fired only on healthy runs (no planted problem it detects)"
    return "not calibrated: it never fired on the calibration corpus"


# ---- docs/calibration.md ----------------------------------------------------------------------------

#: the page's prose (rldiag/doctor/calibration_intro.md), before the tables
INTRO_FILE = Path(__file__).with_name("calibration_intro.md")


def _ci(ci: list[float] | None) -> str:
    return "" if not ci else f" [{ci[0]:.2f}, {ci[1]:.2f}]"


def render_table(split: dict[str, Any]) -> str:
    """One split's figures as a markdown table, the rules that alerted first."""
    lines = ["| rule | cause | severity | runs | fired | TP | FP | FN | precision [95 %] | recall [95 %] | detects "
             "| false alarms / 100 healthy steps | median lead (steps) | status |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    rows = sorted(split["rules"], key=lambda r: (r["fired"] == 0, r["rule"], r.get("cause") or ""))
    for r in rows:
        if r["fired"] == 0 and r.get("cause"):
            continue  # a gap cause that never alerted: listed once, below
        floor = {True: ", meets the floor", False: ", below the floor"}.get(r["meets_floor"], "")
        prec = "-" if r["precision"] is None else f"{r['precision']:.2f}{_ci(r['precision_ci'])}"
        rec = "-" if r["recall"] is None else f"{r['recall']:.2f}{_ci(r['recall_ci'])}"
        lead = "-" if r["lead_steps"] is None else f"{r['lead_steps']:g} ({r['lead_runs']} runs)"
        lines.append(f"| `{r['rule']}` | {r.get('cause') or ''} | {r['severity']} | {r['runs']} | {r['fired']} | "
                     f"{r['tp']} | {r['fp']} | {r['fn']} | {prec} | {rec} | {r['detects'] or '-'} | "
                     f"{_num(r['false_alarms_per_100_steps'])} | {lead} | {r['status']}{floor} |")
    silent = sorted(r["cause"] for r in split["rules"] if r["fired"] == 0 and r.get("cause"))
    out = "\n".join(lines) + "\n"
    if silent:
        out += f"\nGap causes that never alerted: {', '.join(silent)}.\n"
    return out


def lead_summary(split: dict[str, Any]) -> str:
    """Which calibrated rules warn before the labelled onset and which only confirm it after the
    fact (median lead > 0, <= 0), and the warning or critical ones below the floor."""
    rows = [r for r in split["rules"] if r["status"] == "calibrated" and r["lead_steps"] is not None]
    early = [f"`{key(r)}` ({steps_text(r['lead_steps'])} before {r['detects']})" for r in rows if r["lead_steps"] > 0]
    audit = [f"`{key(r)}` ({lead_words(r['lead_steps'], r['detects']).removeprefix('fires ')})"
             for r in rows if r["lead_steps"] <= 0]
    below = [f"`{key(r)}`" for r in split["rules"] if r["meets_floor"] is False]
    out = ["\nOn `test`:\n", "- early warnings (median lead > 0): " + (", ".join(early) or "none") + ";",
           "- audits (they confirm a problem at or after its onset): " + (", ".join(audit) or "none") + ";",
           "- warning or critical rules below the floor: " + (", ".join(below) or "none") + "."]
    return "\n".join(out) + "\n"


def key(row: dict[str, Any]) -> str:
    return row["rule"] + (f"/{row['cause']}" if row.get("cause") else "")


def render_markdown(cal: dict[str, Any] | None = None) -> str:
    """docs/calibration.md from the calibration ``cal`` (default the shipped one)."""
    cal = load() if cal is None else cal
    intro = INTRO_FILE.read_text()
    parts = [intro]
    if cal is None:
        return intro + "\nNo calibration is shipped yet.\n"
    c = cal["corpus"]
    parts.append(f"\n## The shipped figures\n\nCorpus: `--size {c.get('size')} --seed {c.get('seed')}`, "
                 f"{c.get('runs')} runs; rldiag {cal.get('rldiag_version')}.\n")
    parts.append(lead_summary(cal["splits"][REPORTED_SPLIT]))
    for split in ("test", "train"):
        s = cal["splits"][split]
        kinds = ", ".join(f"{k} {n}" for k, n in sorted(s["runs_by_kind"].items()))
        left = f"; left out (pathology not produced): {', '.join(s['left_out'])}" if s["left_out"] else ""
        parts.append(f"\n### `{split}`\n\n{s['runs']} runs ({kinds}); {s['healthy_steps']} healthy steps{left}.\n\n")
        parts.append(render_table(s))
    return "".join(parts)


def ship(source: Path, target: Path = SHIPPED) -> dict[str, Any]:
    """Write ``source`` (a ``calibration.json`` that ``rldiag calibrate`` wrote) as the shipped
    calibration: its per-run list left out, the corpus path kept by name only."""
    cal = json.loads(source.read_text())
    cal.pop("runs", None)
    cal["corpus"]["path"] = Path(cal["corpus"].get("path") or "").name
    target.write_text(json.dumps(cal, indent=1, allow_nan=False) + "\n")
    load.cache_clear()
    return cal


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    ap = argparse.ArgumentParser(prog="python -m rldiag.doctor.calibration",
                                 description="print docs/calibration.md from the shipped calibration")
    ap.add_argument("--ship", type=Path, metavar="CORPUS/calibration.json",
                    help="first make this calibration the shipped one (rldiag/doctor/calibration.json)")
    args = ap.parse_args(argv)
    if args.ship is not None:
        ship(args.ship)
    sys.stdout.write(render_markdown())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
