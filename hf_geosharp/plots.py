"""Figures of where a worst case is: the loss along the worst direction (:func:`profile_figure`) and the breakdown by
layer and head as a heat map (:func:`breakdown_heatmap`). matplotlib's object API only (no pyplot: no global figure
registry), imported inside the functions (importing it writes its font cache). Every face draws with these."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .durable import atomic_path
from .engine.result import BlockShare, Breakdown, certificate_words, certified
from .measures import MEASURES, key_of_engine_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: 800 x 450 pixels at the saved resolution.
SIZE, DPI = (8.0, 4.5), 100


def _title(key: str) -> str:
    """The public name of a measure key (or of an engine result name), else the key itself."""
    spec = MEASURES.get(key) or MEASURES.get(key_of_engine_name(key) or "")
    return spec.title if spec is not None else key


def profile_figure(results: Mapping[str, Any], title: str) -> Figure:
    """The loss increase along each worst case's direction, from the clean point to twice the radius (mean over
    batches): for a geodesic measure its geodesic and the straight Euclidean segment to the same end point, for a
    first-order measure (adaptive sharpness) its segment. The value at rho is a dot, hollow and named in the legend
    when it is not certified (a lower bound). ``results``: measure key -> result with a ``profile``.

    Args:
        results: measure key -> :class:`~hf_geosharp.engine.result.SharpnessResult` (those without a profile are
            skipped).
        title: what the figure shows (the model).

    Returns:
        The figure (save it with :func:`save_figure`).
    """
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE)
    ax = fig.subplots()
    colors = iter(["#4c72b0", "#c44e52", "#55a868", "#8172b2", "#ccb974"])
    drawn = 0
    for key, res in results.items():
        profile = getattr(res, "profile", None)
        if profile is None:
            continue
        rho = float(res.config.get("rho", 1.0))
        radius = [t * rho for t in profile.t]
        color, name = next(colors, "#333333"), _title(key)
        first_order = res.config.get("metric") is None
        if not first_order:
            ax.plot(radius, profile.mean(profile.geodesic), color=color, lw=2, label=f"{name}: geodesic")
        ax.plot(radius, profile.mean(profile.segment), color=color, lw=1.5, ls="--" if not first_order else ":",
                label=f"{name}: straight segment" if not first_order else f"{name}: its worst case (straight)")
        bound = certified(res) is False  # the best point found, a lower bound of the maximum: a hollow marker
        ax.plot([rho], [res.value], marker="o", color=color, ls="none", markerfacecolor="none" if bound else color,
                label=f"{name}: {certificate_words(False)}" if bound else None)
        drawn += 1
    if not drawn:
        raise ValueError("no result has a profile: run the worst case with profile_points (the CLI's --profile).")
    rhos = sorted({float(r.config.get("rho", 1.0)) for r in results.values() if getattr(r, "profile", None)})
    for rho in rhos:
        ax.axvline(rho, color="#999999", lw=0.8, ls=":")
    ax.set_xlabel("distance along the direction (the worst case sits at rho, the dotted line)")
    ax.set_ylabel("loss increase over the clean loss")
    ax.set_title(f"Loss along the worst direction: {title}", fontsize=11)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def as_breakdown(breakdown: Any) -> Breakdown:
    """A :class:`~hf_geosharp.engine.result.Breakdown`, also from its plain-data form (a results file, a store)."""
    if isinstance(breakdown, Breakdown):
        return breakdown
    return Breakdown([BlockShare(**b) for b in breakdown["layers"]], [BlockShare(**b) for b in breakdown["heads"]],
                     BlockShare(**breakdown["outside_pairs"]), breakdown["norm_sq"], breakdown["first_order"])


def heatmap_matrix(breakdown: Any, what: str = "norm_share") -> tuple[list[str], list[int], list[list[float]]]:
    """The breakdown's heads as a layers x heads matrix of ``what`` (``"norm_share"`` or ``"first_order_share"``),
    the pairs of one head (QK and VO) added together: ``(layer names, head numbers, rows)``; NaN where a layer has no
    such head. Pairs outside the layers are left out. ``breakdown``: a ``Breakdown`` or its plain-data form."""
    breakdown = as_breakdown(breakdown)
    heads = [h for h in breakdown.heads if h.layer is not None and h.head is not None]
    layers = sorted({h.layer for h in heads})
    columns = sorted({h.head for h in heads})
    names = {b.layer: b.name for b in breakdown.layers if b.layer is not None}
    matrix = [[float("nan")] * len(columns) for _ in layers]
    for h in heads:
        i, j = layers.index(h.layer), columns.index(h.head)
        value = getattr(h, what)
        matrix[i][j] = value if math.isnan(matrix[i][j]) else matrix[i][j] + value
    return [names.get(layer, str(layer)) for layer in layers], columns, matrix


def breakdown_heatmap(breakdown: Any, title: str) -> Figure:
    """Two heat maps, layers x heads: each head's share of the worst-case perturbation's squared norm (in the
    measure's metric) and of the loss increase's first-order term (QK and VO pairs of a head added).

    Args:
        breakdown: a :class:`~hf_geosharp.engine.result.Breakdown` with heads (a geodesic measure's), or its
            plain-data form.
        title: what it shows (model and measure).

    Returns:
        The figure.
    """
    from matplotlib.figure import Figure

    breakdown = as_breakdown(breakdown)
    fig = Figure(figsize=SIZE)
    axes = fig.subplots(1, 2)
    for ax, what, label in zip(axes, ("norm_share", "first_order_share"),
                               ("share of ||xi||_g^2", "share of <grad, xi>_g")):
        names, columns, matrix = heatmap_matrix(breakdown, what)
        if not matrix:
            raise ValueError("the breakdown has no attention heads (adaptive sharpness has none; use a geodesic "
                             "measure).")
        values = [v for row in matrix for v in row if not math.isnan(v)]
        if min(values, default=0.0) < 0:  # parts pointing downhill: a diverging map centred on 0
            limit = max(abs(v) for v in values)
            image = ax.imshow(matrix, aspect="auto", cmap="coolwarm", vmin=-limit, vmax=limit, interpolation="nearest")
        else:
            image = ax.imshow(matrix, aspect="auto", cmap="viridis", vmin=0.0, interpolation="nearest")
        ax.set_xticks(range(len(columns)), [str(c) for c in columns], fontsize=7)
        ax.set_yticks(range(len(names)), [str(i) for i in range(len(names))], fontsize=7)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(label, fontsize=9)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04)
    fig.suptitle(f"Where the sharpness is: {title}", fontsize=11)
    fig.tight_layout()
    return fig


def _number(value: Any) -> float:
    """A number read from plain data: ``None`` (strict JSON's ``null`` for NaN) is NaN."""
    return math.nan if value is None else float(value)


def rho_sweep_figure(sweep: Mapping[str, Any], title: str = "") -> Figure:
    """Each measure's Kendall tau against the generalisation gap (with its bootstrap 95 % interval) and its certified
    fraction across radii, on one figure: two panels sharing a logarithmic radius axis, the leaderboard's own radius
    dotted.

    Args:
        sweep: a rho sweep's plain data (:func:`hf_geosharp.leaderboard.run.rho_sweep`, its ``rho_sweep.json``).
        title: what was ranked (the zoo, the population); the figure's title.

    Returns:
        The figure (800 x 560 pixels with :func:`save_figure`).
    """
    from matplotlib.figure import Figure

    rhos = [float(r) for r in sweep["rhos"]]
    measures = sweep["measures"]
    fig = Figure(figsize=(SIZE[0], 5.6))
    top, bottom = fig.subplots(2, 1, sharex=True, height_ratios=(3, 2))
    colors = iter(["#4c72b0", "#c44e52", "#55a868", "#8172b2", "#ccb974", "#64b5cd"])
    spread = 1.04  # intervals of neighbouring measures side by side, not on top of each other (log axis)
    for i, (name, entry) in enumerate(measures.items()):
        color, label = next(colors, "#333333"), _title(entry.get("key", name))
        shift = spread ** (i - (len(measures) - 1) / 2)
        x = [r * shift for r in rhos]
        tau = [_number(t) for t in entry["tau"]]
        low = [t - lo if not math.isnan(lo) else 0.0 for t, lo in zip(tau, map(_number, entry["ci_low"]))]
        high = [hi - t if not math.isnan(hi) else 0.0 for t, hi in zip(tau, map(_number, entry["ci_high"]))]
        top.errorbar(x, tau, yerr=[low, high], color=color, marker="o", ms=5, lw=1.8, capsize=3, label=label)
        fraction = [c / n if n else math.nan for c, n in zip(entry["certified"], entry["total"])]
        bottom.plot(rhos, fraction, color=color, marker="o", ms=5, lw=1.8, label=label)
    top.axhline(0.0, color="#999999", lw=0.8)
    for ax in (top, bottom):
        ax.axvline(float(sweep["rho"]), color="#999999", lw=0.8, ls=":")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.tick_params(labelsize=9)
    top.set_ylabel("Kendall tau vs gap\n(95 % interval)", fontsize=10)
    bottom.set_ylabel("certified fraction", fontsize=10)
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xticks(rhos, [f"{r:g}" for r in rhos])
    bottom.minorticks_off()
    ball = sweep.get("settings", {}).get("ball")
    bottom.set_xlabel(f"radius rho{f' ({ball} ball)' if ball else ''}; dotted: the leaderboard's rho", fontsize=10)
    handles, labels = top.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=9, frameon=False,
               bbox_to_anchor=(0.5, 0.925))
    what = f": {title}" if title else ""
    examples = f", {sweep['n_examples']} examples each" if sweep.get("n_examples") else ""
    fig.suptitle(f"The reading depends on the radius{what}\n{sweep['n_models']} models{examples}; gap: test minus "
                 f"train {sweep['gap_metric']}", fontsize=11, y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Write ``fig`` as a PNG (800 px wide), durably."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")
