"""The family's figure: every predictor's tau against each gap, and each measure's paired difference with the
parameter norm's."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .config import GAPS, HIDDEN, PLAN, TRIVIAL


def figure(out: dict[str, Any], path: Path | None = None) -> Any:
    """Kendall tau with its 95 % interval of every predictor (main, hidden, sweep) against each of the four gaps, and
    below, each measure's tau minus the parameter norm's with its paired interval, in the shared style of
    :mod:`hf_geosharp.plots`; drawn from the report alone (``minilm_family.json``), written to ``path`` if given."""
    from hf_geosharp.plots import SMALL, TICK, new_figure, save_figure, short_title

    entries: list[tuple[str, dict[str, dict[str, Any]], str, str]] = []
    for col in list(PLAN) + list(TRIVIAL):
        entries.append((col, out["taus"], col, "#c44e52" if col in TRIVIAL else
                        "#4c72b0" if col.startswith("geodesic") else "#55a868"))
    for name in HIDDEN:
        entries.append((f"{name} (hidden)", out["adversarial"]["taus"], f"hidden_{name}", "#dd8452"))
    for rho, taus in out["rho_sweep"].items():
        if float(rho) != out["config"]["rho"]:
            for name in out["config"]["sweep_measures"]:
                entries.append((f"{name} @ rho {rho}", taus, f"{name}@{rho}", "#8172b2"))
    versus = out["versus_param_norm"]["differences"]
    measures = [col for col in PLAN if any(col in versus[gap] for gap in GAPS)]
    fig = new_figure(0.26 * (len(entries) + len(measures)) + 2.4)
    axes = fig.subplots(2 if measures else 1, len(GAPS), squeeze=False, sharey="row",
                        gridspec_kw={"height_ratios": [len(entries), len(measures)] if measures else [1]})

    def bar(ax: Any, y: int, x: float, low: float, high: float, color: str) -> None:
        err = [[x - low], [high - x]] if math.isfinite(low) else None
        ax.errorbar([x], [y], xerr=err, fmt="o", color=color, ms=4, capsize=2, lw=1)

    for ax, gap in zip(axes[0], GAPS):
        for y, (_, table, col, color) in enumerate(entries):
            if (t := table.get(gap, {}).get(col)) is not None:
                bar(ax, y, t["tau"], t["ci_low"], t["ci_high"], color)
        ax.axvline(0, color="#999999", lw=0.8)
        ax.set_xlim(-1.05, 1.05)
        ax.set_xticks([-1, -0.5, 0, 0.5, 1], ["-1", "-0.5", "0", "0.5", "1"])
        definition = out["gaps"][gap].replace(" - ", " -\n")
        ax.set_title(f"{gap}\n({definition})", fontsize=SMALL)
        ax.tick_params(labelsize=SMALL)
        ax.set_xlabel("Kendall tau [95 % CI]", fontsize=SMALL)
    axes[0][0].set_yticks(range(len(entries)), [e[0] for e in entries])
    axes[0][0].set_ylabel("predictor", fontsize=TICK)
    axes[0][0].invert_yaxis()
    if measures:  # the paired comparison: does a measure rank the members better than the parameter norm?
        for ax, gap in zip(axes[1], GAPS):
            for y, col in enumerate(measures):
                if (d := versus[gap].get(col)) is not None:
                    bar(ax, y, d["difference"], d["ci_low"], d["ci_high"], "#4c72b0" if col.startswith("geodesic")
                        else "#55a868")
            ax.axvline(0, color="#999999", lw=0.8)
            ax.set_xlim(-1.05, 1.05)
            ax.set_xticks([-1, -0.5, 0, 0.5, 1], ["-1", "-0.5", "0", "0.5", "1"])
            ax.tick_params(labelsize=SMALL)
            ax.set_xlabel("tau minus param_norm's\n[paired 95 % CI]", fontsize=SMALL)
        axes[1][0].set_yticks(range(len(measures)), measures)
        axes[1][0].set_ylabel("measure", fontsize=TICK)
        axes[1][0].invert_yaxis()
    p = out["progress"]
    fig.suptitle(short_title(f"all-MiniLM-L6-v2 fine-tunes on SpamAssassin: {p['main_complete']} of {p['members']} "
                             f"members (hf_geosharp {out['library']['hf_geosharp']})"), fontsize=TICK)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig
