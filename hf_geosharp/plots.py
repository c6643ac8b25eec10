"""Figures of where a worst case is: the loss along the worst direction (:func:`profile_figure`) and the breakdown by
layer and head as a heat map (:func:`breakdown_heatmap`). matplotlib's object API only (no pyplot: no global figure
registry), imported inside the functions (importing it writes its font cache). Every face draws with these, and every
figure of the package and its experiments is made with the one style below: legible at the width the README shows it."""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .durable import atomic_path
from .engine.result import BlockShare, Breakdown, certificate_words, certified
from .measures import MEASURES, key_of_engine_name

if TYPE_CHECKING:
    from matplotlib.figure import Figure

#: Every figure is WIDTH inches wide and saved at DPI (1245 px wide); the README and the docs show it DISPLAY_PX wide.
WIDTH, DPI, DISPLAY_PX = 8.3, 150, 830
#: Font sizes in points, none below SMALL: at DISPLAY_PX a point is 830 / (72 * 8.3) = 1.39 px, so SMALL (7 pt) reads
#: as 9.7 px, above the 8 px that text needs there. matplotlib's defaults (10 pt, 12 pt titles) are above it too.
TITLE, LABEL, TICK, SMALL = 10.0, 9.0, 8.0, 7.0
#: The smallest text, in display pixels, that a figure may hold.
MIN_PX = 8.0
#: The longest line of a title: a longer one is shortened (:func:`short_title`).
TITLE_CHARS = 70
#: The profile's and the heat map's size.
SIZE = (WIDTH, 4.5)


def display_px(points: float, width: float = WIDTH) -> float:
    """How tall text of ``points`` reads, in pixels, in a figure ``width`` inches wide shown :data:`DISPLAY_PX` wide
    (independent of the saved dpi).

    Args:
        points: a font size.
        width: the figure's width in inches.

    Returns:
        The size in display pixels.
    """
    return points * DISPLAY_PX / (72.0 * width)


def new_figure(height: float) -> Figure:
    """A figure of the shared width, :data:`WIDTH`, and ``height`` inches: the one way a figure is begun.

    Args:
        height: its height in inches.

    Returns:
        The empty figure.
    """
    from matplotlib.figure import Figure

    return Figure(figsize=(WIDTH, height))


def short_title(text: str, limit: int = TITLE_CHARS, lines: int = 3) -> str:
    """``text`` wrapped at words into lines of at most ``limit`` characters, and at most ``lines`` of them (the last
    one cut, with an ellipsis, when more would be needed): a title that fits the figure's width.

    Args:
        text: a title, maybe of several lines already.
        limit: the longest line.
        lines: the most lines.

    Returns:
        The title as drawn.
    """
    import textwrap

    wrapped = [part for line in text.split("\n") for part in textwrap.wrap(line, limit) or [""]]
    if len(wrapped) > lines:
        last = " ".join(wrapped[lines - 1:])
        wrapped = [*wrapped[:lines - 1], last[:limit - 1].rstrip() + "\u2026"]
    return "\n".join(wrapped)


def model_label(model: str) -> str:
    """How a figure names a model: a local folder by its own name (never its path, a site-packages one say), a Hub
    id as it is.

    Args:
        model: a model's folder or Hub id.

    Returns:
        The short name.
    """
    path = Path(model).expanduser()
    if path.is_absolute() or path.exists() or model.startswith((".", "~")):
        return path.resolve().name or model
    return model


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
        title: what the figure shows: the model, by :func:`model_label` (shortened to :data:`TITLE_CHARS`).

    Returns:
        The figure (save it with :func:`save_figure`).
    """
    fig = new_figure(SIZE[1])
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
    ax.set_xlabel("distance along the direction (the worst case sits at rho, the dotted line)", fontsize=LABEL)
    ax.set_ylabel("loss increase over the clean loss", fontsize=LABEL)
    ax.set_title(short_title(f"Loss along the worst direction: {title}"), fontsize=TITLE)
    ax.tick_params(labelsize=TICK)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=TICK)
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
    breakdown = as_breakdown(breakdown)
    fig = new_figure(SIZE[1])
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
        ax.set_xticks(range(len(columns)), [str(c) for c in columns], fontsize=TICK)
        ax.set_yticks(range(len(names)), [str(i) for i in range(len(names))], fontsize=TICK)
        ax.set_xlabel("head", fontsize=LABEL)
        ax.set_ylabel("layer", fontsize=LABEL)
        ax.set_title(label, fontsize=LABEL)
        fig.colorbar(image, ax=ax, fraction=0.046, pad=0.04).ax.tick_params(labelsize=TICK)
    fig.suptitle(short_title(f"Where the sharpness is: {title}"), fontsize=TITLE)
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
        The figure (1245 x 840 pixels with :func:`save_figure`).
    """
    rhos = [float(r) for r in sweep["rhos"]]
    measures = sweep["measures"]
    fig = new_figure(5.6)
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
        ax.tick_params(labelsize=LABEL)
    top.set_ylabel("Kendall tau vs gap\n(95 % interval)", fontsize=LABEL)
    bottom.set_ylabel("certified fraction", fontsize=LABEL)
    bottom.set_ylim(-0.05, 1.05)
    bottom.set_xticks(rhos, [f"{r:g}" for r in rhos])
    bottom.minorticks_off()
    ball = sweep.get("settings", {}).get("ball")
    bottom.set_xlabel(f"radius rho{f' ({ball} ball)' if ball else ''}; dotted: the leaderboard's rho", fontsize=LABEL)
    handles, labels = top.get_legend_handles_labels()
    fig.legend(handles, labels, loc="upper center", ncol=len(labels), fontsize=LABEL, frameon=False,
               bbox_to_anchor=(0.5, 0.925))
    what = f": {title}" if title else ""
    examples = f", {sweep['n_examples']} examples each" if sweep.get("n_examples") else ""
    fig.suptitle(short_title(f"The reading depends on the radius{what}\n{sweep['n_models']} models{examples}; gap: "
                             f"test minus train {sweep['gap_metric']}"), fontsize=TITLE, y=0.99)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    return fig


def save_figure(fig: Figure, path: str | os.PathLike[str]) -> None:
    """Write ``fig`` as a PNG at the shared :data:`DPI` (1245 px wide at :data:`WIDTH`), durably."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, dpi=DPI, format="png")
