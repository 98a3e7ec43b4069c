"""``rldiag app`` serves Streamlit's static files with the plotly component preloaded."""

from __future__ import annotations

from pathlib import Path

from streamlit import file_util

from rldiag.app import chartjs

STATIC = Path(file_util.get_static_dir())


def test_the_installed_streamlit_has_one_plotly_component():
    name = chartjs.component_file(STATIC)
    assert name is not None and name.startswith("PlotlyChart.") and name.endswith(".js")


def test_index_gets_the_preload_after_streamlits_main_script():
    html = (STATIC / "index.html").read_text()
    name = chartjs.component_file(STATIC)
    out = chartjs.with_preload(html, name)
    main = out.index('src="./static/js/index.')
    pre = out.index(f'<link rel="modulepreload" crossorigin href="./static/js/{name}">')
    imp = out.index(f'<script type="module">import("./static/js/{name}")')
    assert main < pre < imp < out.index("</head>")
    assert name not in html
    assert [line for line in out.splitlines() if name not in line] == html.splitlines()  # nothing else changed
    assert sum(name in line for line in out.splitlines()) == 2
    assert chartjs.with_preload("<html><head></head></html>", name) is None


def test_preload_dir_links_everything_else(tmp_path):
    built = chartjs.preload_dir(STATIC, tmp_path / "static")
    assert built == tmp_path / "static"
    names = {p.name for p in built.iterdir()}
    assert names == {p.name for p in STATIC.iterdir()}
    for p in built.iterdir():
        if p.name != "index.html":
            assert p.is_symlink() and p.resolve() == (STATIC / p.name).resolve()
    assert "modulepreload" in (built / "index.html").read_text()
    assert (built / "static" / "js" / chartjs.component_file(STATIC)).is_file()


def test_no_component_no_change(tmp_path):
    other = tmp_path / "other"
    (other / "static" / "js").mkdir(parents=True)
    (other / "index.html").write_text("<html></html>")
    assert chartjs.component_file(other) is None
    assert chartjs.preload_dir(other, tmp_path / "out") is None and not (tmp_path / "out").exists()


def test_install_points_streamlit_at_the_preloading_dir(monkeypatch):
    monkeypatch.setattr(file_util, "get_static_dir", file_util.get_static_dir)
    built = chartjs.install()
    assert built is not None and file_util.get_static_dir() == str(built)
    assert "modulepreload" in (Path(file_util.get_static_dir()) / "index.html").read_text()
