"""The figures of a comparison (minifloat.training.compare): loss curves against BF16 and per-layer cast numerics."""

from __future__ import annotations

import math
import pathlib
import statistics
from typing import TYPE_CHECKING

from minifloat.fp8.recipes import ROLES

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from minifloat.fp8 import telemetry

BASELINE = "bf16"
SMOOTHING = 0.9  # EMA weight of the previous smoothed loss (TensorBoard's slider)
RANGE_BAND_PCT = 1.0  # a common acceptance band for low-precision loss curves
# DeepSeek-V3 technical report (arXiv:2412.19437), §3.3: FP8 training's relative loss error vs BF16 "consistently
# remains below 0.25%"
DEEPSEEK_V3_PCT = 0.25
TAIL_FRACTION = 0.25  # the last quarter of the steps, whose per-step differences the top-right panel shows
NOISE_SIGMAS = 2  # the difference panel's noise band: ± this many standard deviations (~95% of the steps)
# a smoothed curve within this fraction of the loss panel's height from BF16's lies under BF16's line (a 1.8 pt line
# is about 0.7% of the panel's 3.6 inches): the loss panel leaves it out and names it instead
VISIBLE_FRACTION = 0.01
ZERO_LABEL = f"= {BASELINE}"  # the difference panel's zero line, written at the line
# One style per non-BF16 preset, so the curves stay apart in grayscale too. Okabe & Ito's colour-blind-safe palette;
# 7 colours, 4 dash patterns and 5 markers are coprime: the first 140 presets get distinct combinations
COLORS = ("#E69F00", "#0072B2", "#009E73", "#D55E00", "#CC79A7", "#56B4E9", "#F0E442")
LINESTYLES = ("--", "-.", ":", (0, (6, 1.5, 1, 1.5, 1, 1.5)))
MARKERS = ("o", "s", "^", "D", "v")
MARKS_PER_CURVE = 10
ANNOTATE_FRACTION = 0.0005  # saturated / underflowed fractions below this print as 0.0%, so are left out
def _ema(values: list[float], beta: float = SMOOTHING) -> list[float]:
    """Bias-corrected exponential moving average; non-finite values (poisoned steps) are passed over."""
    out, avg, weight = [], 0.0, 0.0
    for v in values:
        if math.isfinite(v):
            avg, weight = beta * avg + (1 - beta) * v, beta * weight + (1 - beta)
        out.append(avg / weight if weight else math.nan)
    return out


def _styles(names: list[str]) -> dict[str, dict]:
    """Matplotlib line style per preset: BF16 solid black, the others a colour, a dash pattern and a marker each."""
    others = [n for n in names if n != BASELINE]
    styles = {BASELINE: {"color": "black", "linestyle": "-", "linewidth": 1.8}}
    for i, name in enumerate(others):
        styles[name] = {"color": COLORS[i % len(COLORS)], "linestyle": LINESTYLES[i % len(LINESTYLES)],
                        "marker": MARKERS[i % len(MARKERS)], "markersize": 4, "linewidth": 1.5}
    return styles


def _markevery(i: int, n_presets: int, n_steps: int) -> tuple[int, int]:
    """MARKS_PER_CURVE markers per curve, each preset's shifted so that overlapping curves show every marker."""
    every = max(1, n_steps // MARKS_PER_CURVE)
    return (i * every // max(1, n_presets), every)


def _rel_pct(values: list[float], base: list[float]) -> list[float]:
    """Each step's value relative to the baseline's, in % (nan where either is not finite)."""
    return [100 * (v - b) / b if math.isfinite(v) and math.isfinite(b) and b else math.nan
            for v, b in zip(values, base)]


def noise_band_pct(losses: dict[str, list[float]], beta: float = SMOOTHING) -> float:
    """Half-width (%) of the band an EMA (weight `beta`) of the difference to BASELINE stays in when a preset
    differs from it only by step-to-step noise: NOISE_SIGMAS standard deviations; 0.0 with nothing to measure.
    Every preset trains on the same batches, so its per-step loss minus BF16's is a drift plus noise. First
    differences cancel the drift and have variance 2σ², so σ = std(first differences) / √2 (the presets' median);
    an EMA of independent noise has the standard deviation σ·sqrt((1 - β) / (1 + β))."""
    sigmas = []
    for name in (n for n in losses if n != BASELINE):
        rel = [d for d in _rel_pct(losses[name], losses[BASELINE]) if math.isfinite(d)]
        if len(rel) > 2:
            sigmas.append(statistics.stdev([b - a for a, b in zip(rel, rel[1:])]) / math.sqrt(2))
    return NOISE_SIGMAS * statistics.median(sigmas) * math.sqrt((1 - beta) / (1 + beta)) if sigmas else 0.0


def loss_curves_figure(losses: dict[str, list[float]], *, title: str) -> Figure:
    """The loss-curve figure, built without drawing it (plot_loss_curves writes it as a PNG). Its axes (by label):
    "loss", BF16's training loss per step (raw, faint) and smoothed, and each preset whose smoothed curve leaves
    BF16's by over VISIBLE_FRACTION of the panel's height (the title names the others), the last TAIL_FRACTION of
    the steps shaded; "tail", per
    preset, its per-step loss difference to BF16 (%) over those steps as a box (quartiles, 5-95% whiskers, mean);
    "diff", each preset's smoothed loss minus BF16's in %, with the zero line labelled at the line, the band of
    step-to-step noise (`noise_band_pct`), DeepSeek-V3's ±DEEPSEEK_V3_PCT and, where they fall in the view fitted
    to the curves, the ±RANGE_BAND_PCT lines. One legend below the axes names every line once.

    Args:
        losses: per preset, its training loss per step; must hold BASELINE.
        title: first line of the figure's title.
    Returns:
        The matplotlib Figure (no pyplot: no global backend to switch, no figure registry to close).
    """
    from matplotlib.figure import Figure

    styles = _styles(list(losses))
    smooth = {name: _ema(values) for name, values in losses.items()}
    others = [name for name in losses if name != BASELINE]
    n_steps = max(len(values) for values in losses.values())
    tail_from = min(n_steps - 1, int(n_steps * (1 - TAIL_FRACTION)))

    fig = Figure(figsize=(12, 9.5), layout="constrained")
    grid = fig.add_gridspec(2, 2, width_ratios=(3, 2), height_ratios=(1, 1))
    loss_ax, tail_ax = fig.add_subplot(grid[0, 0], label="loss"), fig.add_subplot(grid[0, 1], label="tail")
    diff_ax = fig.add_subplot(grid[1, :], sharex=loss_ax, label="diff")

    # -- loss: what training did; presets drawn only where they do not lie on BF16's line
    raw = losses[BASELINE]
    loss_ax.plot(range(len(raw)), raw, color="black", alpha=0.25, linewidth=0.7, label=f"{BASELINE} per step")
    finite = [v for v in (*raw, *smooth[BASELINE]) if math.isfinite(v)] or [0.0]
    near = VISIBLE_FRACTION * (max(finite) - min(finite))  # a curve this close to BF16's is under its line
    apart = [n for n in others if any(abs(a - b) > near for a, b in zip(smooth[n], smooth[BASELINE]))]
    for i, name in enumerate(smooth):
        if name == BASELINE or name in apart:
            loss_ax.plot(range(len(smooth[name])), smooth[name], label=name,
                         markevery=_markevery(i, len(smooth), n_steps), **styles[name])
    loss_ax.axvspan(tail_from, n_steps - 1, color="0.92")
    on_line = [name for name in others if name not in apart]
    loss_ax.set_title(f"training loss, smoothed ({BASELINE} per step faint)"
                      + (f"\non {BASELINE}'s line at this scale: {', '.join(on_line)}" if on_line else ""))
    loss_ax.set_ylabel("training loss (nats / token)")

    # -- tail: how far from BF16 each preset ends, and how much that varies from step to step
    spread = {name: [d for d in _rel_pct(losses[name][tail_from:], raw[tail_from:]) if math.isfinite(d)]
              for name in others}
    shown = [name for name in others if spread[name]]
    if shown:
        boxes = tail_ax.boxplot([spread[n] for n in shown], whis=(5, 95), showfliers=False, showmeans=True,
                                patch_artist=True, medianprops={"color": "black"})
        for name, box, mean in zip(shown, boxes["boxes"], boxes["means"]):
            color = styles[name]["color"]
            box.set(facecolor="white", edgecolor=color, linewidth=1.5)
            mean.set(marker=styles[name]["marker"], markerfacecolor=color, markeredgecolor=color)
        tail_ax.set_xticks(range(1, len(shown) + 1), shown, rotation=20)
    tail_ax.axhline(0, color="black", linewidth=1.2)
    tail_ax.set_title(f"per-step loss vs {BASELINE}, last {TAIL_FRACTION:.0%} of the steps\n"
                      f"box: quartiles, whiskers: 5-95%, marker: mean")
    tail_ax.set_ylabel(f"loss vs {BASELINE} (%)")

    # -- diff: the smoothed difference over the whole run, against the noise it would have by chance alone
    rel = {name: _rel_pct(smooth[name], smooth[BASELINE]) for name in others}
    for i, name in enumerate(smooth):
        if name != BASELINE:
            diff_ax.plot(range(len(rel[name])), rel[name], label=name,
                         markevery=_markevery(i, len(smooth), n_steps), **styles[name])
    values = [v for line in rel.values() for v in line if math.isfinite(v)] or [0.0]
    margin = 0.1 * (max(values) - min(values))  # DeepSeek-V3's lines always in view
    low, high = min(min(values) - margin, -1.5 * DEEPSEEK_V3_PCT), max(max(values) + margin, 1.5 * DEEPSEEK_V3_PCT)
    diff_ax.set_ylim(low, high)
    band = noise_band_pct(losses)
    if band > 0:
        diff_ax.axhspan(-band, band, color="0.9", zorder=0,
                        label=f"noise: ±{NOISE_SIGMAS}σ of the smoothed step-to-step difference (±{band:.2g}%)")
    for sign in (1, -1):
        diff_ax.axhline(sign * DEEPSEEK_V3_PCT, color="0.35", linestyle=(0, (2, 2)), linewidth=1,
                        label=f"±{DEEPSEEK_V3_PCT}% (DeepSeek-V3 FP8 vs BF16)" if sign == 1 else None)
        if low < sign * RANGE_BAND_PCT < high:  # outside the view it would only stretch the y axis
            diff_ax.axhline(sign * RANGE_BAND_PCT, color="0.6", linestyle=(0, (6, 3)), linewidth=1,
                            label=f"±{RANGE_BAND_PCT:g}% (common acceptance band)" if sign == 1 else None)
    diff_ax.axhline(0, color="black", linewidth=1.2)  # BF16: labelled in the right margin, not in the legend
    diff_ax.annotate(ZERO_LABEL, xy=(1, 0), xycoords=("axes fraction", "data"), xytext=(4, 0),
                     textcoords="offset points", ha="left", va="center")
    diff_ax.set(xlabel="step", ylabel=f"smoothed loss vs {BASELINE} (%)")
    diff_ax.set_title(f"smoothed difference to {BASELINE} (positive: higher loss than {BASELINE})")
    for ax in (loss_ax, tail_ax, diff_ax):
        ax.grid(alpha=0.3)

    handles = {}  # one entry per label: the presets (from the difference panel, where all are drawn) first
    for ax in (diff_ax, loss_ax):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, handle)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(4, len(handles)),
               fontsize="small")
    fig.suptitle(f"{title}\nsmoothed: bias-corrected EMA of the per-step loss (β = {SMOOTHING})")
    return fig


def plot_loss_curves(losses: dict[str, list[float]], path: pathlib.Path, *, title: str) -> None:
    """Write loss_curves_figure(losses, title=title) to `path` as a PNG."""
    loss_curves_figure(losses, title=title).savefig(path, dpi=120)


def plot_numerics(numerics: dict[str, telemetry.Recorder], path: pathlib.Path) -> None:
    """One heatmap per FP8 preset: rows are layers, columns tensor roles; colour and number are the SQNR (dB) of the
    cast, averaged over the batch's casts; a second line gives the saturated / underflowed fractions when non-zero."""
    from matplotlib.colors import Normalize
    from matplotlib.figure import Figure

    tables = {}
    for name, rec in numerics.items():
        cells = rec.by_layer()
        layers = list(dict.fromkeys(layer for layer, _ in cells))
        tables[name] = (layers, cells)
    roles = [r.value for r in ROLES]
    values = [sum(r.sqnr_db for r in recs) / len(recs) for _, cells in tables.values() for recs in cells.values()]
    finite = [v for v in values if math.isfinite(v)] or [0.0]
    norm = Normalize(vmin=min(finite), vmax=max(finite))
    # one layer axis for every panel (a preset that keeps some layers in high precision, nvfp4's last block or
    # --fp8-layers, leaves its rows empty): each panel's rows were its own, labelled by the first panel's names
    rows = list(dict.fromkeys(layer for layers, _ in tables.values() for layer in layers))
    n_layers = len(rows)

    # constrained layout: the two-line title above the panels' own titles, whatever the number of panels
    fig = Figure(figsize=(2.2 + 3.6 * len(tables), 1.6 + 0.55 * n_layers), layout="constrained")
    axes = fig.subplots(1, len(tables), squeeze=False)
    image = None
    for ax, (name, (_, cells)) in zip(axes[0], tables.items()):
        grid = [[math.nan] * len(roles) for _ in rows]
        for (layer, role), recs in cells.items():
            i, j = rows.index(layer), roles.index(role)
            grid[i][j] = sum(r.sqnr_db for r in recs) / len(recs)
            sat = max(r.saturated for r in recs)
            under = max(r.underflow for r in recs)
            text = f"{grid[i][j]:.1f}"
            if sat >= ANNOTATE_FRACTION or under >= ANNOTATE_FRACTION:
                text += f"\nsat {sat:.1%} uf {under:.1%}"
            dark = norm(grid[i][j]) < 0.5 if math.isfinite(grid[i][j]) else False
            ax.text(j, i, text, ha="center", va="center", fontsize=8, color="white" if dark else "black")
        image = ax.imshow(grid, cmap="viridis", norm=norm, aspect="auto")
        ax.set_xticks(range(len(roles)), roles)
        ax.set_yticks(range(len(rows)), rows if ax is axes[0][0] else [""] * len(rows))
        fmts = sorted({r.fmt for recs in cells.values() for r in recs})
        ax.set_title(f"{name}\n({', '.join(fmts)})", fontsize=10)
        ax.set_xlabel("tensor role")
    axes[0][0].set_ylabel("layer")
    fig.suptitle("Low-precision cast numerics after training: SQNR (dB, higher is better) per layer and role, one "
                 "batch\nsecond line: saturated (sat) / flushed-to-zero (uf) fractions where ≥ 0.05%; layers the "
                 "policy keeps in high precision (first q/k/v projections, kept blocks, head) are absent", fontsize=10)
    fig.colorbar(image, ax=axes[0].tolist(), label="SQNR (dB)", fraction=0.03, pad=0.02)
    fig.savefig(path, dpi=120, bbox_inches="tight")
