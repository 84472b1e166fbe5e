"""Plots (plots.py): the mean ± std band by hand, accuracies in percent with readable log ticks."""

import pytest

from fedfuse.plots import mean_band


def test_mean_band_by_hand():
    h1 = [{"round": 1, "x": 0.2}, {"round": 2, "x": 0.4}]
    h2 = [{"round": 1, "x": 0.4}, {"round": 2, "x": None}]
    xs, m, s, n = mean_band([h1, h2], "x")
    assert list(xs) == [1, 2] and list(n) == [2, 1]
    assert m[0] == pytest.approx(0.3) and s[0] == pytest.approx(0.1414213, rel=1e-5) and s[1] == 0.0


def test_plots_in_percent_with_readable_log_ticks(tmp_path):
    import matplotlib.pyplot as plt

    from fedfuse.plots import draw_metric

    hist = [{"round": r, "global_accuracy": 0.5 + 0.01 * r, "loss": 0.4 + 0.05 * r} for r in range(1, 9)]
    fig, (a, b) = plt.subplots(1, 2)
    assert draw_metric(a, {"x": [hist]}, "global_accuracy") and draw_metric(b, {"x": [hist]}, "loss")
    assert a.get_ylabel().endswith("(%)") and max(a.lines[0].get_ydata()) == pytest.approx(58.0)
    fig.canvas.draw()
    lo, hi = b.get_ylim()
    labels = [t.get_text() for t in b.get_yticklabels() if t.get_text() and lo <= t.get_position()[1] <= hi]
    assert len(labels) >= 3, labels  # 0.4..0.8 spans less than a decade: 0.5, 0.6, 0.7, ... not just 0.5
    plt.close(fig)


def test_equal_curves_stay_visible():
    """Two methods with the same curve (one would hide the other): each gets its own marker shape, line style
    and marker positions, and the legend shows the same styles."""
    import matplotlib.pyplot as plt

    from fedfuse.plots import draw_metric, plot_compare, plot_metrics

    hist = [{"round": r, "global_accuracy": 0.1 * r} for r in range(1, 17)]
    fig, ax = plt.subplots()
    assert draw_metric(ax, {"a": [hist], "b": [hist]}, "global_accuracy")
    a, b = ax.get_lines()
    assert list(a.get_ydata()) == list(b.get_ydata())
    assert a.get_marker() != b.get_marker() and a.get_linestyle() != b.get_linestyle()
    assert a.get_markevery() == (0, 2) and b.get_markevery() == (1, 2)  # markers side by side, not on top
    assert a.get_markerfacecolor() == "none"  # open markers: one underneath shows through
    plt.close(fig)
    fig = plot_metrics({"a": [hist], "b": [hist]}, ["global_accuracy"])
    legend = fig.legends[0].get_lines()
    assert [(h.get_marker(), h.get_linestyle()) for h in legend] == [(a.get_marker(), a.get_linestyle()),
                                                                      (b.get_marker(), b.get_linestyle())]
    plt.close(fig)
    assert plot_compare({"a": hist, "b": hist}, "cmp.png").stat().st_size > 0
