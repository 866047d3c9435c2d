"""What `perf compare` writes adds up: an output path is never called a setting in the provenance
warning, the two-file compare draws its trend plot (--plot, or beside --markdown), and the
trend plot's x labels tell two runs of one commit apart."""

from __future__ import annotations

import pytest

from harness import perf
from harness.base.provenance import provenance
from harness.cli import main as cli_main
from tests.perf.test_perf_regression import history_run, pair
from tests.plot_extra import require_plot_extra


def _write_pair(tmp_path, base_settings: dict, cur_settings: dict):
    tmp_path = tmp_path / str(len(list(tmp_path.iterdir())))
    tmp_path.mkdir()
    base, cur = pair(7, scale=1.0)
    base["provenance"] = provenance(base_settings, {})
    cur["provenance"] = provenance(cur_settings, {})
    perf.write_json(tmp_path / "base.json", base)
    perf.write_json(tmp_path / "bench.json", cur)
    return tmp_path / "base.json", tmp_path / "bench.json"


def test_output_paths_are_not_settings_in_the_compare_warning(tmp_path, capsys):
    """docs/performance.md's recipe: two benches that differ only in --out (and --history, --force,
    --json) compare without a settings warning; a real setting (--kv-len) is still named."""
    common = {"command": "bench", "model": "tiny", "runs": 20, "kv_len": 256}
    base, cur = _write_pair(tmp_path, {**common, "out": "base.json", "force": False, "json": None},
                            {**common, "out": "bench.json", "force": True, "history": "h", "json": "x.json"})
    assert cli_main(["perf", "compare", "--baseline", str(base), "--current", str(cur)]) == 0
    err = capsys.readouterr().err
    assert "different settings" not in err and "settings.out" not in err, err
    base, cur = _write_pair(tmp_path, {**common, "out": "base.json"}, {**common, "out": "bench.json", "kv_len": 512})
    assert cli_main(["perf", "compare", "--baseline", str(base), "--current", str(cur)]) == 0
    err = capsys.readouterr().err
    assert "settings.kv_len: 256 vs 512" in err and "settings.out" not in err, err


def test_the_two_file_compare_writes_its_trend_plot(tmp_path, capsys):
    base, cur = pair(11, scale=1.3)
    perf.write_json(tmp_path / "base.json", base)
    perf.write_json(tmp_path / "cur.json", cur)
    comp = perf.compare_files(tmp_path / "base.json", tmp_path / "cur.json")
    assert [p["median"] for p in comp.trend["prefill_ms"]] == [
        pytest.approx(perf.compare_files(tmp_path / "base.json", tmp_path / "base.json").trend["prefill_ms"][0]["median"]),
        pytest.approx(comp.metrics[0].current_median)]
    require_plot_extra()
    from harness.cli.perf_compare import _png_is_ours

    png, md = tmp_path / "two.png", tmp_path / "rep.md"
    code = cli_main(["perf", "compare", "--baseline", str(tmp_path / "base.json"), "--current", str(tmp_path / "cur.json"),
                     "--plot", str(png), "--markdown", str(md)])
    assert code == 1 and _png_is_ours(png)  # a 1.3x slowdown: exit 1, the plot drawn anyway
    assert "two.png" in md.read_text() and not (tmp_path / "rep-trend.png").exists()
    assert cli_main(["perf", "compare", "--baseline", str(tmp_path / "base.json"), "--current",
                     str(tmp_path / "cur.json"), "--markdown", str(md)]) == 1
    assert _png_is_ours(tmp_path / "rep-trend.png") and "rep-trend.png" in md.read_text()


def test_history_labels_tell_two_runs_of_one_commit_apart(tmp_path):
    from harness.report.perf_plot import run_labels

    for minute, commit in enumerate(["aaaaaaa1", "bbbbbbb2", "bbbbbbb2", "ccccccc3"]):
        perf.append_history(history_run(minute, 1.0, minute, git_commit=commit), tmp_path)
    comp = perf.compare_history(tmp_path)
    labels = run_labels(comp.trend["prefill_ms"])
    assert labels == ["aaaaaaa", "bbbbbbb #1", "bbbbbbb #2", "ccccccc"]
    require_plot_extra()
    from matplotlib.figure import Figure

    from harness.report.perf_plot import _panel

    ax = Figure().subplots()
    _panel(ax, "prefill_ms", comp.trend["prefill_ms"], comp, None)
    drawn = [t.get_text() for t in ax.get_xticklabels()]
    assert drawn == labels and len(set(drawn)) == 4
