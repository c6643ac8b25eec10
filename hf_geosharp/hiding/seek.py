"""Hide & seek on a population of models: the paper's argument that adaptive sharpness is not a generalisation
measure, and its report (printed lines and a figure).

Every model is measured as it is, under a random element of its symmetry group, and after :func:`hide` pushed it
against its gap; its function is checked each time. Geodesic sharpness does not move; adaptive sharpness does, and so
does its Kendall tau against the gap. See docs/hide_and_seek.md.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..engine.result import certified, shown
from ..measures import DEFAULT_MEASURES, Settings
from ..pipeline import Request, measure
from .transform import DEFAULT_CONDITION, hide, reparametrize_checked

#: ``cache(name, key, compute) -> record``: see :func:`hide_and_seek`.
Cache = Callable[[str, str, Callable[[], dict[str, Any]]], dict[str, Any]]


@dataclass
class SeekReport:
    """Hide & seek on a population of models (see :func:`hide_and_seek`).

    Attributes:
        names: the models, in the order of every list below.
        gaps: their generalisation gaps.
        measures: the bundle keys measured (geodesic ones first).
        original, random, adversarial: ``{key: [value per model]}`` on the original models, under a random group
            element each, and after :func:`hide` (``targets`` says which way each model was pushed).
        targets: ``"flat"`` for models whose gap is above the median (they should look sharp), ``"sharp"`` below.
        rank_taus: Kendall tau between the original and the randomly transformed values, per measure.
        gap_taus: ``{"original": ..., "adversarial": ...}``, each ``kendall_taus`` of every measure against the gap.
        showcase: (ii) the flattest model by adaptive sharpness pushed sharp and the sharpest pushed flat, with
            every measure before and after (``before``, ``after``) and their certificates (``before_certified``,
            ``after_certified``).
        max_output_deviation: the largest probe deviation over every transformation applied.
        certified: ``{"original"|"random"|"adversarial": {key: [certified per model]}}``, as the values: False for
            a worst case that is not certified (its value a lower bound), None for a measure without a certificate.
    """

    names: list[str]
    gaps: list[float]
    measures: list[str]
    original: dict[str, list[float]]
    random: dict[str, list[float]]
    adversarial: dict[str, list[float]]
    targets: list[str]
    rank_taus: dict[str, float]
    gap_taus: dict[str, dict[str, dict[str, float]]]
    showcase: list[dict[str, Any]]
    max_output_deviation: float
    certified: dict[str, dict[str, list[bool | None]]]

    def uncertified(self) -> int:
        """How many of the report's values are not certified (lower bounds).

        Returns:
            The count of values whose certificate is False (values without a certificate are not counted).
        """
        return sum(c is False for what in self.certified.values() for cs in what.values() for c in cs)

    def to_dict(self) -> dict[str, Any]:
        """Every field, for JSON.

        Returns:
            The fields as JSON-ready values.
        """
        return dict(self.__dict__)


def hide_and_seek(
    names: list[str],
    load: Callable[[str], tuple[nn.Module, list]],
    gaps: list[float],
    *,
    settings: Settings | None = None,
    measures: tuple[str, ...] = DEFAULT_MEASURES,
    condition: float = DEFAULT_CONDITION,
    seed: int = 0,
    cache: Cache | None = None,
    on_model: Callable[[str], None] | None = None,
    on_stage: Callable[[str, str], None] | None = None,
    dtype: torch.dtype = torch.float64,
) -> SeekReport:
    """The paper's point on a population: (i) a random symmetry element per model leaves every geodesic ranking
    intact and scrambles adaptive's; (ii) the flattest model by adaptive sharpness can be made to look sharp and the
    sharpest flat; (iii) pushing each model against its gap (flat when the gap is large) destroys adaptive's
    correlation with the gap and leaves geodesic's as it was. The function of every model is unchanged (checked).

    Args:
        names: the models.
        load: ``load(name) -> (model, batches)``: a fresh copy of the model and the batches to measure it on.
        gaps: each model's generalisation gap.
        settings: the measurement settings (the same for every measure and model; default the bundle's).
        measures: bundle keys; must include ``"adaptive_sharpness"``.
        condition: the largest condition number of the group elements (random and searched).
        seed: seeds the random elements (model ``i`` gets ``seed + i``) and the search.
        cache: ``cache(name, key, compute) -> record``: the stored record of model ``name`` under ``key`` (which
            holds every setting), or ``compute()``'s, stored (so an interrupted run resumes).
        on_model: called with each model's name before it is worked on (progress).
        on_stage: called with a model's name and the stage (``"original"``, ``"random"``, ``"flat"``, ``"sharp"``)
            before that stage is measured; not when ``cache`` holds it (a log's progress lines).
        dtype: every model and batch is measured in this dtype. float64 by default: with float32 weights, the
            solver's round-off on an element of condition 1000 moves even geodesic sharpness by about 1 %, which
            would blur the very invariance on show.

    Returns:
        The :class:`SeekReport`: every value, tau and function check.
    """
    settings = Settings() if settings is None else settings
    if "adaptive_sharpness" not in measures:
        raise ValueError("hide_and_seek needs 'adaptive_sharpness' among the measures (it is what is hidden).")
    median = statistics.median(gaps)
    targets = ["flat" if g > median else "sharp" for g in gaps]
    stage = _stages(load, settings, measures, condition, seed, cache, dtype, on_stage)

    records: dict[str, list[dict[str, Any]]] = {"original": [], "random": [], "adversarial": []}
    for i, name in enumerate(names):
        if on_model is not None:
            on_model(name)
        records["original"].append(stage(name, i, "original"))
        records["random"].append(stage(name, i, "random"))
        records["adversarial"].append(stage(name, i, targets[i]))
    values = {what: {k: [r["values"][k] for r in recs] for k in measures} for what, recs in records.items()}
    certificates = {what: {k: [_certified(r, k) for r in recs] for k in measures} for what, recs in records.items()}
    adaptive = values["original"]["adaptive_sharpness"]
    flattest, sharpest = adaptive.index(min(adaptive)), adaptive.index(max(adaptive))
    showcase = []
    for index, target in ((flattest, "sharp"), (sharpest, "flat")):
        after = stage(names[index], index, target)
        records["adversarial"].append(after)  # counted in the deviation below
        showcase.append({"model": names[index], "target": target, "before": records["original"][index]["values"],
                         "after": after["values"], "deviation": after["deviation"],
                         "before_certified": {k: _certified(records["original"][index], k) for k in measures},
                         "after_certified": {k: _certified(after, k) for k in measures}})
    return _report(names, gaps, measures, targets, values, showcase, records, seed, certificates)


def _certified(record: dict[str, Any], key: str) -> bool | None:
    """A stored record's certificate of ``key``; a record that stores none (measured before certificates were
    stored) counts as not certified."""
    return record.get("certified", {}).get(key, False)


def _stages(
    load: Callable[[str], tuple[nn.Module, list]], settings: Settings, measures: tuple[str, ...], condition: float,
    seed: int, cache: Cache | None, dtype: torch.dtype, on_stage: Callable[[str, str], None] | None = None,
) -> Callable[[str, int, str], dict[str, Any]]:
    """``stage(name, index, how)``: the values of model ``name`` as loaded (``how="original"``), under a random group
    element (``"random"``) or pushed ``"flat"``/``"sharp"`` by :func:`hide`, with the probe's deviation; each record
    cached under a key that holds every setting."""
    cache = cache or (lambda name, key, compute: compute())
    tag = dict(settings.as_dict(), condition=condition, seed=seed, dtype=str(dtype))

    def measured(model: nn.Module, batches: list) -> dict[str, dict[str, Any]]:
        results = measure(Request(model, batches, measures, settings))
        return {"values": {k: float(r.value) for k, r in results.items()},
                "certified": {k: certified(r) for k, r in results.items()}}

    def stage(name: str, index: int, how: str) -> dict[str, Any]:
        def compute() -> dict[str, Any]:
            if on_stage is not None:
                on_stage(name, how)
            model, batches = load(name)
            model = model.to(dtype)
            batches = [{k: v.to(dtype) if torch.is_floating_point(v) else v for k, v in b.items()} for b in batches]
            deviation = 0.0
            if how == "random":
                deviation = reparametrize_checked(model, batches, seed=seed + index, condition=condition)[1]
            elif how in ("flat", "sharp"):
                deviation = hide(model, batches, target=how, condition=condition, seed=seed, settings=settings,
                                 evaluate=False).max_output_deviation
            return {**measured(model, batches), "deviation": deviation}

        return cache(name, json.dumps({**tag, "how": how}, sort_keys=True), compute)

    return stage


def _report(
    names: list[str], gaps: list[float], measures: tuple[str, ...], targets: list[str],
    values: dict[str, dict[str, list[float]]], showcase: list[dict[str, Any]],
    records: dict[str, list[dict[str, Any]]], seed: int, certificates: dict[str, dict[str, list[bool | None]]],
) -> SeekReport:
    """The taus of (i) and (iii) from the measured values, and the largest probe deviation over every record."""
    from scipy import stats

    from ..leaderboard import kendall_taus

    def tau(a: list[float], b: list[float]) -> float:
        return float(stats.kendalltau(a, b).statistic)

    def gap_rows(vals: dict[str, list[float]]) -> list[dict[str, float]]:
        return [{**{k: vals[k][i] for k in measures}, "gap": gaps[i]} for i in range(len(names))]

    return SeekReport(
        names=list(names), gaps=list(gaps), measures=list(measures), original=values["original"],
        random=values["random"], adversarial=values["adversarial"], targets=targets,
        rank_taus={k: tau(values["original"][k], values["random"][k]) for k in measures},
        gap_taus={what: kendall_taus(gap_rows(values[what]), list(measures), seed=seed)
                  for what in ("original", "adversarial")},
        showcase=showcase,
        max_output_deviation=max(r["deviation"] for recs in records.values() for r in recs),
        certified=certificates,
    )


def seek_lines(report: SeekReport, condition: float) -> list[str]:
    """The hide & seek section as printed lines: values to 3 significant digits and taus to 2 decimals, the digits
    that agree across machines (the solver's float round-off moves later digits).

    Args:
        report: the experiment's report.
        condition: the condition number of the random elements, as the heading states it.

    Returns:
        The lines.
    """
    width = max(len(k) for k in report.measures) + 2
    lines = [f"hide & seek: {len(report.names)} models moved along their attention symmetries (group elements of "
             f"condition <= {condition:g}); function unchanged: max relative output change "
             f"{report.max_output_deviation:.0e}", "",
             "(i) a random symmetry element per model: Kendall tau between the original and the transformed ranking"]
    lines += [f"    {k:{width}s}{report.rank_taus[k]:+.2f}" for k in report.measures]
    flat_model, sharp_model = report.showcase[0], report.showcase[1]
    lines += ["", f"(ii) adversarial: {flat_model['model']}, the flattest model by adaptive sharpness, pushed "
                  f"{flat_model['target']}; {sharp_model['model']}, the sharpest, pushed {sharp_model['target']}",
              f"    {'measure':{width}s}" + "".join(f"{c['model'] + ' -> ' + c['target']:>28s}"
                                                for c in report.showcase)]
    for k in report.measures:
        cells = "".join(f"{shown(c['before'][k], c['before_certified'][k], 3, compact=True):>13s} -> "
                        f"{shown(c['after'][k], c['after_certified'][k], 3, compact=True):<11s}"
                        for c in report.showcase)
        lines.append(f"    {k:{width}s}{cells}".rstrip())
    adaptive = report.original["adaptive_sharpness"]
    lines.append(f"    (original adaptive sharpness across the zoo: {min(adaptive):.3g} to {max(adaptive):.3g})")
    total = sum(len(cs) for what in report.certified.values() for cs in what.values())
    lines.append(f"    certified: {total - report.uncertified()} of {total} values" + (
        "" if not report.uncertified() else "; the others are lower bounds of their maxima (shown with ≥)"))
    lines += ["", "(iii) Kendall tau against the gap: original zoo vs every model pushed against its gap "
                  "(flat if its gap is above the median, sharp below)",
              f"    {'measure':{width}s}{'original':>24s}{'adversarial':>26s}"]
    for k in report.measures:
        cells = []
        for what in ("original", "adversarial"):
            t = report.gap_taus[what][k]
            ci = "" if math.isnan(t["ci_low"]) else f" [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}]"
            cells.append(f"{t['tau']:+.2f}{ci}")
        lines.append(f"    {k:{width}s}{cells[0]:>24s}{cells[1]:>26s}")
    return lines


def seek_figure(report: SeekReport, path: Any = None) -> Any:
    """Before/after bars per measure: (i) rank tau under random elements, (ii) after/before of the two pushed
    models, (iii) tau against the gap before and after the adversarial push, in the shared style of
    :mod:`hf_geosharp.plots`. Written atomically to ``path`` when one is given.

    Args:
        report: the experiment's report (or one read back from its saved fields).
        path: where the PNG goes, or None to only draw it.

    Returns:
        The matplotlib ``Figure``.
    """
    from ..plots import LABEL, SMALL, TICK, new_figure, save_figure

    keys = report.measures
    short = [k.replace("geodesic_sharpness_", "geodesic\n").replace("_sharpness", "") for k in keys]
    fig = new_figure(3.6)
    axes = fig.subplots(1, 3)
    x = torch.arange(len(keys)).numpy()
    axes[0].bar(x, [report.rank_taus[k] for k in keys], color=["#4c72b0" if "geodesic" in k else "#dd8452"
                                                                for k in keys])
    axes[0].set_title("(i) a random symmetry element", fontsize=LABEL)
    axes[0].set_ylabel("tau(original, transformed ranking)", fontsize=TICK)
    axes[0].set_ylim(-1, 1.05)
    for j, case in enumerate(report.showcase):
        ratios = [case["after"][k] / case["before"][k] for k in keys]
        bars = axes[1].bar(x + (j - 0.5) * 0.38, ratios, width=0.38, label=f"{case['model']} pushed {case['target']}",
                           color=["#c44e52", "#55a868"][j])
        for bar, k in zip(bars, keys):  # a ratio with a lower bound in it: hollow and hatched
            if case.get("before_certified", {}).get(k) is False or case.get("after_certified", {}).get(k) is False:
                bar.set_fill(False)
                bar.set_hatch("//")
                bar.set_edgecolor(["#c44e52", "#55a868"][j])
    axes[1].set_yscale("log")
    axes[1].axhline(1.0, color="k", lw=0.8, ls=":")
    axes[1].set_title("(ii) adversarial, same function", fontsize=LABEL)
    axes[1].set_ylabel("value after / before (hatched: not certified)", fontsize=TICK)
    axes[1].legend(fontsize=SMALL)
    for j, what in enumerate(("original", "adversarial")):
        taus = [report.gap_taus[what][k]["tau"] for k in keys]
        axes[2].bar(x + (j - 0.5) * 0.38, taus, width=0.38, label=what, color=["#8172b2", "#dd8452"][j])
    axes[2].axhline(0.0, color="k", lw=0.8)
    axes[2].set_ylim(-1, 1)
    axes[2].set_title("(iii) against the gap", fontsize=LABEL)
    axes[2].set_ylabel("Kendall tau vs the gap", fontsize=TICK)
    axes[2].legend(fontsize=SMALL, title="zoo", title_fontsize=SMALL)
    for ax in axes:
        ax.set_xticks(x, short, fontsize=TICK)
        ax.set_xlabel("measure", fontsize=TICK)
        ax.tick_params(labelsize=TICK)
    fig.tight_layout()
    if path is not None:
        save_figure(fig, path)
    return fig
