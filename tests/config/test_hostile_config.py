"""Hostile and broken config files: every one gives a one-line ConfigError naming the file, fast
and within bounded memory, through the API and the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from rldiag.cli.main import main
from rldiag.config import yaml_bounded
from rldiag.config.settings import parse_override, read_yaml, resolve_settings
from rldiag.errors import ConfigError
from rldiag.synth import SynthSpec, write_synth_run


def laughs_list(levels: int = 8) -> str:
    """"Billion laughs": each level a list of ten aliases of the one below (10^levels leaves)."""
    lines = ['a0: &a0 ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} [" + ",".join([f"*a{i - 1}"] * 10) + "]")
    return "\n".join(lines) + "\nalgorithm:\n  gamma: 1.0\n"


def laughs_mapping(levels: int = 8) -> str:
    """The same with mappings, which flattening to dotted keys would expand in full."""
    lines = ["a0: &a0 {" + ", ".join(f"k{j}: 1" for j in range(10)) + "}"]
    for i in range(1, levels + 1):
        lines.append(f"a{i}: &a{i} {{" + ", ".join(f"k{j}: *a{i - 1}" for j in range(10)) + "}")
    return "\n".join(lines) + "\n"


def big_config(size: int) -> str:
    """A plain mapping of ``size`` bytes or a little more."""
    line = "  key_{:08d}: 0.123456789\n"
    return "algorithm:\n" + "".join(line.format(i) for i in range(size // len(line.format(0)) + 1))


CASES = {
    "billion-laughs-list": (lambda: laughs_list().encode(), "holds more than 200,000 values once its aliases are expanded"),
    "billion-laughs-mapping": (lambda: laughs_mapping().encode(), "holds more than 200,000 values once its aliases are expanded"),
    "20MB": (lambda: big_config(20 << 20).encode(), "is larger than 2 MiB"),
    "not-utf8": (lambda: b"algorithm:\n  gamma: \xff\xfe0.9\n", "is not UTF-8 text (byte 20: invalid start byte)"),
    "5000-deep-flow": (lambda: ("a: " + "[" * 5000 + "]" * 5000 + "\n").encode(), "is not valid YAML"),
    "150-deep-flow": (lambda: ("a: " + "[" * 150 + "]" * 150 + "\n").encode(), "nests deeper than 100 levels (line 1)"),
    "150-deep-block": (
        lambda: ("".join(" " * i + f"k{i}:\n" for i in range(150)) + " " * 150 + "x: 1\n").encode(),
        "nests deeper than 100 levels (line 101)",
    ),
    "bad-syntax": (lambda: b"algorithm:\n  gamma: [1, 2\n  lam: }\n", "is not valid YAML: while parsing a flow sequence"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hostile_config_is_one_clear_error(tmp_path, case):
    make, expected = CASES[case]
    (tmp_path / "run.yaml").write_bytes(make())
    with pytest.raises(ConfigError) as exc:
        resolve_settings(tmp_path)
    msg = str(exc.value)
    assert msg.startswith(f"config file {tmp_path / 'run.yaml'} ")
    assert expected in msg
    assert "\n" not in msg


def test_billion_laughs_through_the_cli(tmp_path, capsys):
    run = write_synth_run(tmp_path / "run", SynthSpec(steps=2, seed=1))
    (run / "run.yaml").write_text(laughs_list())
    # exit codes as documented: 1, and 2 for doctor and verify ("cannot be read" / "cannot verify")
    for cmd, code in ((["check", str(run)], 1), (["recompute", str(run), "--no-progress"], 1),
                      (["doctor", str(run)], 2), (["verify", str(run)], 2)):
        assert main(cmd) == code
        err = capsys.readouterr().err.strip().splitlines()
        assert "Traceback" not in "\n".join(err)
        assert err[0] == (f"ConfigError: config file {run / 'run.yaml'} holds more than 200,000 values once its "
                       "aliases are expanded; rldiag reads configs up to that size")
    assert not (run / "rldiag" / "scenarios" / "baseline").exists()


def test_a_config_within_the_bounds_is_read_whole(tmp_path):
    # anchors and aliases that stay small are fine; so is a config just under the size bound
    (tmp_path / "run.yaml").write_text(
        "defaults: &d {gamma: 0.99, lam: 0.95}\nalgorithm:\n  <<: *d\n  adv_estimator: gae\n"
    )
    s = resolve_settings(tmp_path)
    assert (s["algorithm.gamma"], s["algorithm.lam"], s.estimator) == (0.99, 0.95, "gae")
    text = big_config(yaml_bounded.MAX_BYTES - 4096)
    assert len(text.encode()) <= yaml_bounded.MAX_BYTES
    (tmp_path / "run.yaml").write_text(text.replace("algorithm:\n", "algorithm:\n  gamma: 0.5\n", 1))
    assert resolve_settings(tmp_path)["algorithm.gamma"] == 0.5


def test_alias_expansion_is_counted_exactly():
    # three levels of ten: 1,000 leaves, well within the bound; six levels: 10^6, refused
    text = laughs_list(levels=3)
    assert len(yaml_bounded.load_yaml(text, "t")["a3"]) == 10
    with pytest.raises(ConfigError, match="more than 200,000 values"):
        yaml_bounded.load_yaml(laughs_list(levels=6), "t")


def test_rules_files_and_overrides_are_bounded_too(tmp_path):
    rules = tmp_path / "rules.yaml"
    rules.write_text(laughs_list())
    with pytest.raises(ConfigError, match=r"rules file .*rules.yaml holds more than 200,000 values"):
        read_yaml(rules, "rules file")
    with pytest.raises(ConfigError, match="nests deeper than 100 levels"):
        parse_override("algorithm.gamma=" + "[" * 500 + "]" * 500)
    assert parse_override("a.b=[1, 2") == ("a.b", "[1, 2")  # not YAML: taken as text, as before


MEMORY_PROBE = textwrap.dedent("""
    import json, resource, sys
    from pathlib import Path
    from rldiag.config.settings import resolve_settings
    from rldiag.errors import ConfigError
    out = {}
    for d in sorted(Path(sys.argv[1]).iterdir()):
        try:
            resolve_settings(d)
            out[d.name] = "ok"
        except ConfigError as exc:
            out[d.name] = type(exc).__name__
    # peak resident memory of this process image: /proc's VmHWM (ru_maxrss would also count the
    # pytest process this one was forked from, on Linux it survives exec)
    try:
        hwm = [l for l in open("/proc/self/status") if l.startswith("VmHWM:")][0]
        out["maxrss_mb"] = int(hwm.split()[1]) / 1024
    except (OSError, IndexError):
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        out["maxrss_mb"] = rss / (1 << 20 if sys.platform == "darwin" else 1024)
    print(json.dumps(out))
""")


@pytest.mark.slow
def test_every_config_case_stays_under_500_mb(tmp_path):
    """All the hostile files, and the largest file within the bounds, read in one fresh process:
    its peak resident memory (imports included) stays under 500 MB."""
    for name, (make, _) in CASES.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "run.yaml").write_bytes(make())
    (tmp_path / "largest-accepted").mkdir()
    (tmp_path / "largest-accepted" / "run.yaml").write_text(big_config(yaml_bounded.MAX_BYTES - 4096))
    proc = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(tmp_path)], capture_output=True, text=True,
                          timeout=600, cwd=Path(__file__).parent)
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out.pop("largest-accepted") == "ok"
    assert out.pop("maxrss_mb") < 500
    assert out == {name: "ConfigError" for name in CASES}
