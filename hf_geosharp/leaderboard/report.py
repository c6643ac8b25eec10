"""A leaderboard's outputs: the ranked table and the taus as Markdown, the table as CSV, the scatter plot, and the
folder of files, each written durably."""

from __future__ import annotations

import csv
import math
from pathlib import Path
from typing import Any

from ..durable import atomic_path, write_json, write_text
from ..engine.result import LOWER_BOUND, NOT_CERTIFIED, certified, shown
from .run import TRIVIAL, Leaderboard


def ranked(board: Leaderboard) -> list[dict[str, Any]]:
    """Rows sorted by the first measure, flattest first, with a 1-based ``rank``.

    Args:
        board: a finished leaderboard.

    Returns:
        The rows, flattest first.
    """
    key = board.measures[0]
    order = sorted(board.rows, key=lambda r: (math.isnan(r[key]), r[key], r["model"]))
    return [{"rank": i, **row} for i, row in enumerate(order, 1)]


def _fmt(value: Any, spec: str = ".4g") -> str:
    if value is None or isinstance(value, float) and math.isnan(value):  # None: a NaN read back from strict JSON
        return "n/a"
    return format(value, spec) if isinstance(value, float) else str(value)


def table_markdown(board: Leaderboard) -> str:
    """The ranked table as Markdown; an uncertified worst case shows as a lower bound (``≥``, the one display rule).

    Args:
        board: a finished leaderboard.

    Returns:
        The Markdown table.
    """
    table = ranked(board)
    cols = list(table[0])
    uncertified = set(board.not_converged())

    def cell(row: dict[str, Any], col: str) -> str:
        value = row[col]
        if (row["model"], col) in uncertified and isinstance(value, float) and not math.isnan(value):
            return shown(value, False, compact=True)
        return _fmt(value)

    lines = ["| " + " | ".join(cols) + " |", "|" + "|".join("---" for _ in cols) + "|"]
    lines += ["| " + " | ".join(cell(row, c) for c in cols) + " |" for row in table]
    if uncertified:
        lines.append(f"\n≥: {NOT_CERTIFIED} ({LOWER_BOUND}).")
    return "\n".join(lines) + "\n"


def taus_markdown(board: Leaderboard) -> str:
    """Each predictor's Kendall tau against the gap, with its interval, as Markdown (empty without a gap).

    Args:
        board: a finished leaderboard.

    Returns:
        The Markdown table, or ``""`` without a gap.
    """
    if not board.taus:
        return ""
    lines = [f"Kendall tau against the generalisation gap (test minus train {board.gap_metric}), "
             f"{len(board.rows)} models, bootstrap 95 % interval; last column: the measure's tau minus the parameter "
             "norm's over the same resampled models (an interval above zero: it ranks the models better than the "
             "parameter norm does):", "",
             "| predictor | tau | 95 % CI | p-value | certified | minus param_norm's tau [95 % CI] |",
             "|---|---|---|---|---|---|"]
    for name, t in board.taus.items():
        ci = f"[{_fmt(t['ci_low'], '+.3f')}, {_fmt(t['ci_high'], '+.3f')}]"
        certified = board.certified(name)
        count = "-" if certified is None else f"{certified[0]} of {certified[1]}"
        d = board.versus_param_norm.get(name)
        versus = "-" if d is None else (f"{_fmt(d['difference'], '+.3f')} "
                                        f"[{_fmt(d['ci_low'], '+.3f')}, {_fmt(d['ci_high'], '+.3f')}]")
        lines.append(f"| {name} | {_fmt(t['tau'], '+.3f')} | {ci} | {_fmt(t['p_value'], '.3g')} | {count} | "
                     f"{versus} |")
    return "\n".join(lines) + "\n"


def markdown(board: Leaderboard) -> str:
    """The ranked table and, when there is a gap, the taus.

    Args:
        board: a finished leaderboard.

    Returns:
        The Markdown text.
    """
    return "\n".join(filter(None, (table_markdown(board), taus_markdown(board))))


def certificates(board: Leaderboard) -> dict[str, dict[str, bool | None]]:
    """Each model's certificate per measure, as the CSV's ``<measure>_certified`` columns: True, False (the value is
    a lower bound of the maximum, ``≥`` in the Markdown table) or None (no certificate: not a worst case, or no
    record).

    Args:
        board: a finished leaderboard.

    Returns:
        model -> ``<measure>_certified`` -> the flag.
    """
    return {model: {f"{name}_certified": None if record is None else certified(record)
                    for name, record in zip(board.measures, records)}
            for model, records in board.results.items()}


def write_csv(board: Leaderboard, path: Path) -> None:
    """Write the ranked table as CSV, one row per model, floats in full precision (``repr``), and after the error
    bars one ``<measure>_certified`` column per measure (:func:`certificates`; empty where there is no certificate).

    Args:
        board: a finished leaderboard.
        path: where the CSV goes.
    """
    flags = certificates(board)
    columns = [f"{name}_certified" for name in board.measures]
    table = []
    for row in ranked(board):
        cut = max((i for i, k in enumerate(row) if k.endswith("_stderr")), default=len(row) - 1) + 1
        items = list(row.items())
        table.append({**dict(items[:cut]), **{c: flags.get(row["model"], {}).get(c) for c in columns},
                      **dict(items[cut:])})
    with atomic_path(path) as tmp, open(tmp, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(table[0]))
        writer.writeheader()
        writer.writerows({k: repr(v) if isinstance(v, float) else "" if v is None else v for k, v in row.items()}
                         for row in table)


#: Most panels per row of the scatter figure: six predictors make a 2 x 3 grid that stays legible at a README's
#: width.
SCATTER_COLUMNS = 3


def public_name(name: str) -> str:
    """The name a reader knows a predictor by: the measure's public key (``geodesic_inv_worst`` ->
    ``geodesic_sharpness_inv``; an average-case one with ``(average)``), or the column's own name (``param_norm``).

    Args:
        name: the engine's name of a result, or a trivial predictor's column.

    Returns:
        The name for titles and labels.
    """
    from ..measures import key_of_engine_name

    key = key_of_engine_name(name)
    if key is None:
        return name
    return f"{key} (average)" if name.endswith("_average") else key


def scatter_plot(board: Leaderboard, path: Path) -> None:
    """Write :func:`scatter_figure` to ``path`` (PNG, the shared width and dpi of :mod:`hf_geosharp.plots`).

    Args:
        board: a finished leaderboard.
        path: where the PNG goes.
    """
    from ..plots import save_figure

    save_figure(scatter_figure(board), path)


def scatter_figure(board: Leaderboard) -> Any:
    """One panel per predictor in a grid of at most :data:`SCATTER_COLUMNS` columns, the gap on the shared y axis, the
    public name with tau and its interval in the title (like the paper's Figs 3-5).

    Args:
        board: a leaderboard with its taus.

    Returns:
        The matplotlib ``Figure``.
    """
    from matplotlib.ticker import MaxNLocator

    from ..plots import LABEL, SMALL, TICK, new_figure  # no pyplot: no global backend switch, no GUI, safe in threads

    names = board.predictors
    rows = -(-len(names) // SCATTER_COLUMNS)
    columns = -(-len(names) // rows)  # rows as full as they can be: four panels make 2 x 2
    fig = new_figure(2.7 * rows + 0.3)
    axes = fig.subplots(rows, columns, squeeze=False, sharey=True).ravel()
    gap = [r["gap"] for r in board.rows]
    uncertified = set(board.not_converged())
    for ax, name in zip(axes, names):
        color = "#c44e52" if name in TRIVIAL else "#4c72b0"
        hollow = [(r["model"], name) in uncertified for r in board.rows]  # a lower bound, not the maximum
        for flag, face in ((False, color), (True, "none")):
            points = [(r[name], g) for r, g, h in zip(board.rows, gap, hollow) if h == flag]
            if points:
                ax.scatter(*zip(*points), s=20, facecolors=face, edgecolors=color,
                           label="not certified" if flag else None)
        if any(hollow):
            ax.legend(fontsize=SMALL, loc="best")
        t = board.taus[name]
        ci = f"[{_fmt(t['ci_low'], '+.2f')}, {_fmt(t['ci_high'], '+.2f')}]"
        ax.set_title(f"{public_name(name)}\n\u03c4 = {_fmt(t['tau'], '+.2f')} {ci}", fontsize=LABEL)
        ax.set_xlabel("predictor value", fontsize=TICK)
        ax.xaxis.set_major_locator(MaxNLocator(4))  # few ticks: legible when the figure is scaled down
        ax.tick_params(labelsize=LABEL)
        ax.xaxis.get_offset_text().set_fontsize(TICK)
    for ax in axes[len(names):]:
        ax.set_visible(False)
    for ax in axes[::columns]:
        ax.set_ylabel(f"generalisation gap ({board.gap_metric})", fontsize=LABEL)
    fig.tight_layout()
    return fig


def heatmaps(board: Leaderboard, out_dir: Path) -> list[Path]:
    """Per model and measure whose stored result has heads in its breakdown (the geodesic worst cases), the heat
    map (layers x heads) of where the worst case sits: ``where/<model>__<measure>.png``."""
    from ..plots import breakdown_heatmap, model_label, save_figure

    written = []
    for model, records in board.results.items():
        for name, record in zip(board.measures, records):
            breakdown = None if record is None else record.get("breakdown")
            if not breakdown or not breakdown.get("heads"):
                continue
            safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in model)
            path = out_dir / "where" / f"{safe}__{name}.png"
            path.parent.mkdir(parents=True, exist_ok=True)
            bound = f" ({NOT_CERTIFIED}: the best perturbation found)" if certified(record) is False else ""
            save_figure(breakdown_heatmap(breakdown, f"{model_label(model)}, {name}{bound}"), path)
            written.append(path)
    return written


def write_outputs(board: Leaderboard, out_dir: Path) -> dict[str, Path]:
    """``leaderboard.md``, ``leaderboard.csv``, the heat maps of where each geodesic worst case sits
    (``where/``, :func:`heatmaps`) and, with a gap, ``taus.json`` and ``scatter.png``, each replaced durably (a
    failed write leaves the previous file intact).

    Args:
        board: a finished leaderboard.
        out_dir: the folder the files go to.

    Returns:
        Each written file's name -> its path.
    """
    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"markdown": out_dir / "leaderboard.md", "csv": out_dir / "leaderboard.csv"}
    write_text(paths["markdown"], markdown(board))
    write_csv(board, paths["csv"])
    if maps := heatmaps(board, out_dir):
        paths["where"] = maps[0].parent
    if board.taus:
        paths["taus"] = out_dir / "taus.json"
        certified = {name: list(count) for name in board.measures if (count := board.certified(name)) is not None}
        write_json(paths["taus"], {"gap_metric": board.gap_metric, "taus": board.taus, "certified": certified,
                                   "versus_param_norm": board.versus_param_norm})
        paths["plot"] = out_dir / "scatter.png"
        scatter_plot(board, paths["plot"])
    return paths


def sweep_markdown(sweep: dict[str, Any]) -> str:
    """A rho sweep as Markdown: per measure and radius, its tau with interval and its certified count."""
    rhos = sweep["rhos"]
    lines = [f"Kendall tau against the gap [95 % interval] and certified count per radius ({sweep['n_models']} "
             "models)\n", "| measure | " + " | ".join(f"rho {r:g}" for r in rhos) + " |",
             "|---|" + "---|" * len(rhos)]
    for name, e in sweep["measures"].items():
        cells = [f"{_fmt(t, '+.2f')} [{_fmt(lo, '+.2f')}, {_fmt(hi, '+.2f')}], {c}/{n}"
                 for t, lo, hi, c, n in zip(e["tau"], e["ci_low"], e["ci_high"], e["certified"], e["total"])]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def write_sweep(sweep: dict[str, Any], out_dir: Path, title: str = "") -> dict[str, Path]:
    """``rho_sweep.json`` (the data behind the figure) and ``rho_sweep.png``
    (:func:`~hf_geosharp.plots.rho_sweep_figure`), each replaced durably."""
    from ..plots import rho_sweep_figure, save_figure

    out_dir.mkdir(parents=True, exist_ok=True)
    paths = {"sweep": out_dir / "rho_sweep.json", "sweep plot": out_dir / "rho_sweep.png"}
    write_json(paths["sweep"], sweep)
    save_figure(rho_sweep_figure(sweep, title), paths["sweep plot"])
    return paths
