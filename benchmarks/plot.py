"""benchmarks.png: WKV7's and MoBA's time against T, and LoRA training tokens/s against
mlx-lm's, drawn from a report's measurements where matplotlib is installed."""

from __future__ import annotations

import functools
import io

from benchmarks.report import DATA_ERRORS, PLOT_NAME
from benchmarks.train import tokens_per_s

import numpy as np


def _first(pair):
    return pair[0]


def _draw_times(ax, lines: list, Ts: list, title: str) -> None:
    """Time against T, log-log: ``lines`` of (label, color, line style, points)."""
    for label, color, style, points in lines:
        ax.plot(*zip(*points, strict=True), style, color=color, marker="o", label=label)
    ax.set(xscale="log", yscale="log", xlabel="T (tokens)", ylabel="seconds", title=title)
    ax.set_xticks(Ts, [str(T) for T in Ts])
    ax.set_xticks([], minor=True)
    ax.legend(fontsize=7)


def _times_panel(rows: list, series: list, title: str):
    """``_draw_times`` of ``rows`` of (T, runs), ``series`` of (key, label, color, line style);
    runs that did not run (None) are left out."""
    lines = []
    for key, label, color, style in series:
        points = [(int(T), float(runs[key]["time"])) for T, runs in rows if runs.get(key)]
        if points:
            lines.append((label, color, style, points))
    Ts = sorted({int(T) for T, _ in rows})
    return functools.partial(_draw_times, lines=lines, Ts=Ts, title=title)


def _fwd_and_fb(implementations) -> list:
    """``_times_panel`` series of ``(run key prefix, label, color)``: fwd solid, fwd+bwd dashed."""
    return [
        (f"{key}_{kind}", f"{label} {name}", color, style)
        for kind, name, style in (("fwd", "fwd", "-"), ("fb", "fwd+bwd", "--"))
        for key, label, color in implementations
    ]


def _wkv7_panel(r: dict):
    H = r["base"][1]
    rows = sorted(((row["T"], row["runs"]) for row in r["rows"] if row["H"] == H), key=_first)
    implementations = (("ours", "wkv7", "C0"), ("ref", "step loop", "C1"), ("lm", "mlx-lm", "C2"))
    return _times_panel(rows, _fwd_and_fb(implementations), f"WKV7, B=1 H={H} N={r['N']}")


def _moba_panel(r: dict):
    rows = [(row["T"], row["runs"]) for row in r["rows"]]
    series = _fwd_and_fb((("moba", "MoBA", "C0"), ("dense", "dense SDPA", "C3")))
    return _times_panel(rows, series, f"MoBA vs dense causal attention, H={r['H']} D={r['D']}")


def _draw_bars(ax, names: list, rates: list, ratios: list, ylim: tuple, title: str) -> None:
    """Tokens/s of ours and mlx-lm's per shape, log scale, each pair with its ratio."""
    x = np.arange(len(names))
    for i, (label, color) in enumerate((("mlx_rwkvx", "C0"), ("mlx-lm", "C2"))):
        ax.bar(x + (i - 0.5) * 0.4, [rate[i] for rate in rates], 0.4, label=label, color=color)
    for xi, (ours, _), ratio in zip(x, rates, ratios, strict=True):
        ax.annotate(f"{ratio:.1f}x", (xi, ours), ha="center", va="bottom", fontsize=8)
    ax.set(xticks=x, xticklabels=names, yscale="log", ylabel="tokens/s (log)", title=title)
    ax.set_ylim(*ylim)
    ax.legend(fontsize=7)


def _train_panel(r: dict):
    shapes = r["shapes"]
    rates = [tuple(map(float, tokens_per_s(s))) for s in shapes.values()]
    ratios = [ours / theirs for ours, theirs in rates]
    names = [f"{n}\nT={s['shape']['T']}, batch {s['shape']['batch']}" for n, s in shapes.items()]
    ylim = (min(min(rate) for rate in rates) / 3, 3 * max(max(rate) for rate in rates))
    title = f"LoRA training step (rank {r['rank']}): ours vs mlx-lm"
    return functools.partial(
        _draw_bars, names=names, rates=rates, ratios=ratios, ylim=ylim, title=title
    )


# Each panel's function reads its section's results into a drawer of one axes: data of a
# layout it no longer reads fails there, before anything is drawn.
PLOT_PANELS = (("wkv7", _wkv7_panel), ("moba", _moba_panel), ("train", _train_panel))


def plot_panels(report: dict) -> list:
    """The drawers of the panels whose sections the report holds; a panel whose data does not
    fit (an older version's layout) is left out, with one printed line."""
    drawers = []
    for name, panel in PLOT_PANELS:
        entry = report["sections"].get(name, {})
        if "results" not in entry:
            continue
        try:
            drawers.append(panel(entry["results"]))
        except DATA_ERRORS as e:
            print(f"{PLOT_NAME}: the {name} panel is left out, its data does not fit ({e!r})")
    return drawers


def plot_png(report: dict) -> bytes | None:
    """benchmarks.png of a report: the panels of ``plot_panels``. None, with one printed line,
    where matplotlib is not installed or no panel has data."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"{PLOT_NAME} not drawn: matplotlib is not installed (pip install 'mlx_rwkvx[plot]')")
        return None
    drawers = plot_panels(report)
    if not drawers:
        names = ", ".join(n for n, _ in PLOT_PANELS)
        print(f"{PLOT_NAME} not drawn: no {names} section run, or none whose data fits")
        return None
    fig, axes = plt.subplots(1, len(drawers), figsize=(5.5 * len(drawers), 4.2), squeeze=False)
    for ax, draw in zip(axes[0], drawers, strict=True):
        draw(ax)
    note = " (--quick: these numbers mean nothing)" if report["quick"] else ""
    fig.suptitle(f"scripts/bench.py, {report['date']}{note}", fontsize=9)
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    plt.close(fig)
    return png.getvalue()
