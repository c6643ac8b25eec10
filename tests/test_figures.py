"""Every figure the package and its experiments draw is legible at the width the README and the docs show it
(``plots.DISPLAY_PX``, 830 px): made at the one shared width, every text it draws at least ``plots.MIN_PX`` display
pixels tall and inside the figure, every axes with data labelled on both axes (or sharing that axis with one that is),
and no title line longer than ``plots.TITLE_CHARS``. Each figure is built from small synthetic inputs; a figure in the
old style (12 inches wide, 7 pt ticks) is caught."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

pytest.importorskip("matplotlib")

from hf_geosharp import plots  # noqa: E402


def _problems(fig: Any, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """What in ``fig`` would not be legible at the README's width; empty when all is well."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.text import Text

    drawn: list[Text] = []
    draw = Text.draw

    def recording(self: Text, renderer: Any) -> None:
        if self.get_visible() and self.get_text().strip():
            drawn.append(self)
        draw(self, renderer)

    with monkeypatch.context() as patch:
        patch.setattr(Text, "draw", recording)
        canvas = FigureCanvasAgg(fig)
        canvas.draw()
    renderer, box = canvas.get_renderer(), fig.bbox
    problems = [] if fig.get_figwidth() == plots.WIDTH else [f"width {fig.get_figwidth()} in, not {plots.WIDTH}"]
    assert drawn, "the figure drew no text"
    for text in drawn:
        px = plots.display_px(text.get_fontsize(), fig.get_figwidth())
        if px < plots.MIN_PX:
            problems.append(f"{text.get_text()!r}: {px:.1f} px at {plots.DISPLAY_PX} px wide")
        extent = text.get_window_extent(renderer)
        if (extent.x0 < box.x0 - 1 or extent.x1 > box.x1 + 1 or extent.y0 < box.y0 - 1 or extent.y1 > box.y1 + 1):
            problems.append(f"{text.get_text()!r}: drawn outside the figure")
    for ax in fig.axes:
        with_data = ax.lines or ax.collections or ax.patches or ax.images
        if not ax.get_visible() or not with_data or ax.get_label() == "<colorbar>":
            continue
        for name, shared, label in (("x", ax.get_shared_x_axes(), "get_xlabel"),
                                    ("y", ax.get_shared_y_axes(), "get_ylabel")):
            if not any(getattr(other, label)().strip() for other in shared.get_siblings(ax)):
                problems.append(f"an axes ({ax.get_title()!r}) has no {name} label")
    titles = [ax.get_title(loc) for ax in fig.axes for loc in ("center", "left", "right")] + [fig.get_suptitle()]
    problems += [f"title line of {len(line)} characters: {line!r}" for title in titles for line in title.split("\n")
                 if len(line) > plots.TITLE_CHARS]
    return problems


def test_a_figure_in_the_old_style_is_caught(monkeypatch):
    """The negative control: the hide & seek figure's old size and fonts (12 in wide, 7 pt ticks, no y labels)."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(12, 3.4))
    ax = fig.subplots()
    ax.bar([0, 1], [0.5, 1.0])
    ax.set_xticks([0, 1], ["geodesic inv", "adaptive"], fontsize=7)
    ax.set_title("x" * 80, fontsize=9)
    problems = _problems(fig, monkeypatch)
    assert any("width" in p for p in problems)
    assert any("'adaptive': 6.7 px" in p for p in problems)  # 7 pt at 12 in: 7 * 830 / 864
    assert any("no y label" in p for p in problems) and any("no x label" in p for p in problems)
    assert any("80 characters" in p for p in problems)


def test_display_pixels_follow_the_width_not_the_dpi():
    assert plots.display_px(72, plots.DISPLAY_PX / 72) == pytest.approx(72)  # a figure shown at its own size
    assert plots.display_px(plots.SMALL) >= plots.MIN_PX > plots.display_px(plots.SMALL, 12.0)


def test_titles_are_short_and_models_are_named_by_folder_or_hub_id():
    long = "Loss along the worst direction: " + "very-long-name-" * 12
    lines = plots.short_title(long).split("\n")
    assert all(len(line) <= plots.TITLE_CHARS for line in lines) and len(lines) <= 3
    assert plots.short_title("short\ntwo lines") == "short\ntwo lines"
    site = "/usr/lib/python3.12/site-packages/transformers/models/tiny-bert"
    assert plots.model_label(site) == "tiny-bert"
    assert plots.model_label("sentence-transformers/all-MiniLM-L6-v2") == "sentence-transformers/all-MiniLM-L6-v2"


def _profile_result(converged: bool, value: float, metric: str | None) -> Any:
    from hf_geosharp.engine.result import Profile, SharpnessResult

    profile = Profile(t=[0.0, 0.5, 1.0, 1.5, 2.0], geodesic=[[0.0, value / 4, value, 2 * value, 3 * value]],
                      segment=[[0.0, value / 5, value, 1.5 * value, 2 * value]])
    return SharpnessResult(value=value, per_batch=[value], clean_loss=0.3, per_batch_clean_loss=[0.3],
                           measure="geodesic_inv_worst" if metric else "adaptive_clean_worst",
                           config={"mode": "worst", "rho": 0.1, "metric": metric}, converged=converged,
                           profile=profile, certificate="certified" if converged else "not_certified")


def test_the_profile_is_legible_and_names_the_model_by_its_folder(monkeypatch):
    site = "/usr/lib/python3.12/site-packages/transformers/models/bert/tiny-bert-for-sequence-classification"
    fig = plots.profile_figure({"adaptive_sharpness": _profile_result(False, 0.2, None),
                                "geodesic_sharpness_inv": _profile_result(True, 0.1, "inv")}, plots.model_label(site))
    assert _problems(fig, monkeypatch) == []
    assert "site-packages" not in fig.axes[0].get_title() and "tiny-bert" in fig.axes[0].get_title()


def test_the_heat_map_is_legible(monkeypatch):
    from hf_geosharp.engine.result import BlockShare, Breakdown

    rng = np.random.default_rng(0)
    shares = rng.random((4, 12))
    heads = [BlockShare(f"layer {i} head {j}", i, j, "qk", float(s), float(s), float(s) / shares.sum(),
                        float(s) / shares.sum()) for (i, j), s in np.ndenumerate(shares)]
    layers = [BlockShare(f"bert.encoder.layer.{i}", i, None, None, 1.0, 1.0, 0.25, 0.25) for i in range(4)]
    breakdown = Breakdown(layers, heads, BlockShare("classifier", None, None, None, 0.0, 0.0, 0.0, 0.0), 1.0, 1.0)
    fig = plots.breakdown_heatmap(breakdown, "sentence-transformers/all-MiniLM-L6-v2, geodesic_inv_worst (not "
                                             "certified: the best perturbation found)")
    assert _problems(fig, monkeypatch) == []


def test_the_rho_sweep_is_legible(monkeypatch):
    rng = np.random.default_rng(1)
    measures = {name: {"key": key, "tau": rng.uniform(-0.5, 0.5, 3).tolist(), "ci_low": [-0.6] * 3,
                       "ci_high": [0.6] * 3, "certified": [20, 19, 20], "total": [20] * 3}
                for name, key in (("geodesic_inv_worst", "geodesic_sharpness_inv"),
                                  ("geodesic_mix_worst", "geodesic_sharpness_mix"),
                                  ("adaptive_clean_worst", "adaptive_sharpness"))}
    sweep = {"rhos": [0.03, 0.1, 0.3], "rho": 0.1, "gap_metric": "error", "n_models": 20, "n_examples": 64,
             "settings": {"ball": "calibrated"}, "measures": measures}
    assert _problems(plots.rho_sweep_figure(sweep, "the demo's zoo of small ViTs"), monkeypatch) == []


def test_the_leaderboard_scatter_is_legible(monkeypatch):
    from hf_geosharp.leaderboard import Leaderboard, kendall_taus
    from hf_geosharp.leaderboard.report import scatter_figure
    from hf_geosharp.leaderboard.run import TRIVIAL

    rng = np.random.default_rng(2)
    names = ["geodesic_inv_worst", "geodesic_mix_worst", "adaptive_clean_worst", "relative_flatness", *TRIVIAL]
    rows = [{"model": f"m{i}", "gap": float(rng.random()), **{n: float(rng.random() * 30) for n in names}}
            for i in range(12)]
    measures = names[:4]
    results = {row["model"]: [{"measure": m, "converged": not (i == 0 and m == measures[0])} for m in measures]
               for i, row in enumerate(rows)}
    board = Leaderboard(rows, measures, "error", results=results)
    board.taus = kendall_taus(rows, board.predictors, n_resamples=100)
    assert _problems(scatter_figure(board), monkeypatch) == []


def test_the_hide_and_seek_figure_is_legible(monkeypatch):
    from hf_geosharp.hiding.seek import SeekReport, seek_figure

    keys = ["geodesic_sharpness_inv", "geodesic_sharpness_mix", "adaptive_sharpness"]
    case = {"before": dict.fromkeys(keys, 0.1), "after": {**dict.fromkeys(keys, 0.1), "adaptive_sharpness": 900.0},
            "before_certified": dict.fromkeys(keys, True),
            "after_certified": {**dict.fromkeys(keys, True), "adaptive_sharpness": False}}
    taus = {what: {k: {"tau": t, "ci_low": math.nan, "ci_high": math.nan} for k in keys}
            for what, t in (("original", 0.2), ("adversarial", -0.4))}
    report = SeekReport(names=["zoo-0", "zoo-1"], gaps=[0.1, 0.2], measures=keys, original={}, random={},
                        adversarial={}, targets=["sharp", "flat"], rank_taus={k: 1.0 for k in keys}, gap_taus=taus,
                        showcase=[{**case, "model": "zoo-15", "target": "sharp"},
                                  {**case, "model": "zoo-12", "target": "flat"}],
                        max_output_deviation=1e-13, certified={})
    assert _problems(seek_figure(report), monkeypatch) == []


def test_the_diagonal_networks_figure_is_legible(monkeypatch):
    from experiments.diagonal_networks import SHARPNESS_MEASURES, Setting, plot_figure

    rng = np.random.default_rng(3)
    columns = {name: rng.random(20) for name in ("test_loss", *SHARPNESS_MEASURES)}
    columns["alpha"] = rng.uniform(0.01, 1.0, 20)
    tau = {name: {"tau": -0.9, "ci95": [-0.95, -0.85]} for name in SHARPNESS_MEASURES}
    assert _problems(plot_figure(columns, tau, Setting(), "metric"), monkeypatch) == []


def test_the_minilm_family_figure_is_legible(monkeypatch):
    from experiments.minilm_family.config import GAPS, HIDDEN, PLAN, TRIVIAL
    from experiments.minilm_family.figure import figure

    def tau(t: float) -> dict[str, float]:
        return {"tau": t, "ci_low": t - 0.2, "ci_high": t + 0.2}

    out = {"taus": {gap: {col: tau(0.3) for col in [*PLAN, *TRIVIAL]} for gap in GAPS},
           "adversarial": {"taus": {gap: {f"hidden_{n}": tau(-0.2) for n in HIDDEN} for gap in GAPS}},
           "rho_sweep": {"0.05": {gap: {"geodesic_inv@0.05": tau(0.3)} for gap in GAPS}},
           "config": {"rho": 0.1, "sweep_measures": ["geodesic_inv"]},
           "versus_param_norm": {"differences": {gap: {col: {"difference": 0.05, "ci_low": -0.1, "ci_high": 0.2}
                                                       for col in PLAN} for gap in GAPS}},
           "gaps": {gap: f"{a} - {b}" for gap, (a, b) in GAPS.items()},
           "progress": {"main_complete": 40, "members": 40}, "library": {"hf_geosharp": "0.0.0"}}
    assert _problems(figure(out), monkeypatch) == []
