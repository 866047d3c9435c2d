"""The report's rendering: the per-layer verdict column, the error plot's axes and no matplotlib
warnings."""

from __future__ import annotations

import warnings

from harness.report.bisect import diagnosis_lines
from harness.report.formats import layer_rows
from tests.plot_extra import require_plot_extra


def _layer(index: int, **over) -> dict:
    layer = {"index": index, "type": "sliding_attention", "rel_l2": 1e-2, "cosine": 0.9999, "max_abs": 0.1,
             "envelope_rel_l2": 5e-3, "ratio": 2.0, "position_ratio": 2.5, "cumulative_ratio": 2.5,
             "local_ratio": 1.0, "local_rel_l2": 5e-3, "local_envelope_rel_l2": 5e-3, "pass": True,
             "component": None}
    layer.update(over)
    return layer


def test_a_layer_carrying_upstream_error_is_not_blamed():
    """Layer 3 fails alone (attention); layer 4 fails only cumulatively, passing alone."""
    rows = layer_rows([_layer(3, ratio=9.0, local_ratio=8.0, **{"pass": False}, component="attention"),
                       _layer(4, ratio=6.0, carries_upstream_error=True)])
    assert [r[-1] for r in rows] == ["FAIL (attention)", "pass alone (upstream error)"]


def test_bisect_diagnosis_names_the_failing_points_and_the_pattern_by_layer_type():
    """Keys wrong and values right in layer 0; every sliding layer fails alone, every full layer
    passes: said in words (what the PNG shows). A mixed pattern gives the counts only."""
    def point(part, passed, ratio):
        return {"part": part, "passed": passed, "ratio": ratio, "where": "port's run"}

    payload = {"diagnosis": {"layer": 0, "type": "sliding_attention",
                             "points": [point("k", False, 40.0), point("v", True, 1.0), point("attn_residual", False, 9.0)],
                             "by_type": {"sliding_attention": {"layers": 10, "fail_alone": 10},
                                         "full_attention": {"layers": 2, "fail_alone": 0}}}}
    lines = diagnosis_lines(payload)
    assert lines[0].startswith("diagnosis: layer 0 (sliding): keys WRONG (40.00x, port's run); values right")
    assert "keys wrong, values right" in lines[1]
    assert lines[2].endswith("sliding 10 of 10 fail, full 0 of 2 fail: every sliding layer fails alone, "
                             "every full layer passes")
    payload["diagnosis"]["points"] = [point("k", True, 1.0), point("v", False, 7.0)]
    payload["diagnosis"]["by_type"]["full_attention"]["fail_alone"] = 1
    lines = diagnosis_lines(payload)
    assert "values wrong, keys right" in lines[1] and lines[2].endswith("full 1 of 2 fail")
    assert diagnosis_lines({"diagnosis": None}) == []


def test_the_fp32_column_names_the_first_layer_the_fp32_stage_fails():
    """An fp32-only failure (bf16 passes every layer): the fp32 column shows each layer's worst ratio,
    the first failing layer names its point, later ones point back to it; a bf16 failure keeps its verdict."""
    layers = [_layer(0, fp32_ratio=1.1, fp32_pass=True, fp32_point=None),
              _layer(1, fp32_ratio=9.5, fp32_pass=False, fp32_point="layers.1.mlp_residual"),
              _layer(2, fp32_ratio=12.0, fp32_pass=False, fp32_point="kv.2.k"),
              _layer(3, fp32_ratio=None, fp32_pass=False, fp32_point="kv.3.k", **{"pass": False}, component="mlp")]
    rows = layer_rows(layers)
    assert [r[-2] for r in rows] == ["1.10", "9.50", "12.00", "nan/inf"]
    assert [r[-1] for r in rows] == ["pass", "FAIL fp32 (layers.1.mlp_residual)", "fp32 fails (first at layer 1)",
                                     "FAIL (mlp)"]
    assert len(rows[0]) == len(layer_rows([_layer(0)])[0]) + 1  # no fp32 stage, no column


def _ratio_axes(layers):
    require_plot_extra()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from harness.report.plot import _plot_ratios

    fig, ax = plt.subplots()
    _plot_ratios(ax, layers, [5], ("cumulative_ratio", "local_ratio"))
    return fig, ax


def test_ratio_panel_spans_the_data_not_1e_minus_15():
    """The green band under the tolerance starts near the data: a log axis from 0 spanned 1e-15."""
    fig, ax = _ratio_axes([_layer(i, cumulative_ratio=1.5 + i, local_ratio=0.8) for i in range(4)])
    bottom, top = ax.get_ylim()
    assert 0.1 < bottom < 0.8 and top >= 4.0


def test_check_plot_raises_no_warning(tmp_path):
    """A check's plot (no local series on some layers, nothing failing) draws without warnings
    (an empty legend was one)."""
    require_plot_extra()
    from harness.report.plot import plot_layer_errors

    layers = [_layer(i, local_rel_l2=None, local_envelope_rel_l2=None, local_ratio=None) for i in range(3)]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert plot_layer_errors(tmp_path / "p.png", layers, "t", full_layers=[2],
                                 cumulative=("rel_l2", "envelope_rel_l2", "cumulative"),
                                 ratio_keys=("cumulative_ratio", "local_ratio"), num_layers=3)
    assert (tmp_path / "p.png").stat().st_size > 0
