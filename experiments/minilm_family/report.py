"""The report: Kendall taus of every predictor against every gap, the paired comparisons, the adversarial control,
the certificates and the cost, written as JSON (with the figure) and as the doc's generated section, from what the
store holds; it measures nothing."""

from __future__ import annotations

import dataclasses
import math
import platform
import statistics
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

from hf_geosharp import durable
from hf_geosharp.leaderboard import kendall_taus, tau_differences, tau_if_raised

from .config import CALIBRATED_BALL, GAPS, GEODESIC, HIDDEN, PLAN, PROTOCOL, TRAIN_VERSION, TRIVIAL, Config, installed
from .cost import cost
from .figure import figure
from .prose import tables_markdown, write_generated
from .store import collect, column_name, compare_versions, complete, hide_options


def _tau_table(rows: list[dict[str, Any]], columns: list[str], config: Config) -> dict[str, dict[str, Any]]:
    """Kendall tau of each column against each gap, over the members that have the number (``n`` says how many);
    where some are uncertified ``steps="auto"`` numbers, also the range tau could take at their true maxima."""
    out: dict[str, dict[str, Any]] = {}
    for gap in GAPS:
        out[gap] = {}
        for col in columns:
            have = [r for r in rows if col in r["numbers"] and math.isfinite(r["numbers"][col]["value"])
                    and math.isfinite(r[gap])]
            if len(have) < 3:
                continue
            values, gap_values = [r["numbers"][col]["value"] for r in have], [r[gap] for r in have]
            tau = kendall_taus([{"x": x, "gap": g} for x, g in zip(values, gap_values, strict=True)], ["x"],
                               n_resamples=config.n_resamples)["x"]
            numbers = [r["numbers"][col] for r in have]
            tau["n_certified"] = sum(bool(n.get("converged", True)) for n in numbers)
            # a fixed-step number (AS23) is what its steps reach; an uncertified steps="auto" one is a lower bound
            lower_bounds = [not n.get("converged", True) and n["settings"].get("steps") == "auto" for n in numbers]
            if any(lower_bounds):
                tau["tau_if_raised"] = tau_if_raised(values, gap_values, lower_bounds)
            out[gap][col] = tau
    return out



def _versus_baseline(rows: list[dict[str, Any]], config: Config, baseline: str,
                     measures: Iterable[str]) -> dict[str, Any]:
    """Each of ``measures`` against ``baseline``, over the members that have both: the tau of the two with each other
    (do they rank the members alike?) and, against each gap, the difference of their taus with a paired bootstrap
    interval (does the measure rank the members by their gap better?)."""
    def values(col: str) -> dict[str, float]:
        return {r["member"]["name"]: r["numbers"][col]["value"] for r in rows if col in r["numbers"]
                and math.isfinite(r["numbers"][col]["value"])}

    base = values(baseline)
    out: dict[str, Any] = {"baseline": baseline, "with_baseline": {}, "differences": {gap: {} for gap in GAPS}}
    for col in measures:
        mine = values(col)
        both = [r for r in rows if r["member"]["name"] in mine and r["member"]["name"] in base]
        if len(both) < 3:
            continue
        alike = [{"x": mine[r["member"]["name"]], "gap": base[r["member"]["name"]]} for r in both]
        out["with_baseline"][col] = kendall_taus(alike, ["x"], n_resamples=config.n_resamples)["x"]
        for gap in GAPS:
            paired = [{"x": mine[r["member"]["name"]], "base": base[r["member"]["name"]], "gap": r[gap]} for r in both
                      if math.isfinite(r[gap])]
            out["differences"][gap][col] = tau_differences(paired, ["x"], "base", n_resamples=config.n_resamples)["x"]
    return out



def report(config: Config, cache: Path, out_dir: Path, doc: Path | None = None,
           store: Path | None = None, library: str | None = None, previous: str | None = None,
           calibrated_library: str | None = None) -> dict[str, Any]:
    """Write ``minilm_family.json`` (and the figure, when there are taus) into ``out_dir`` from what is stored, and the
    generated tables into ``doc``; measures nothing. ``previous``: a library version whose stored main numbers are
    compared with these (:func:`compare_versions`); ``calibrated_library``: the version whose calibrated-ball numbers
    are shown (default the installed one)."""
    import transformers

    rows, info = collect(config, cache, store, library, calibrated_library)
    calibrated_cols = [column_name("calibrated", n, config.rho) for n in config.calibrated_measures]
    main_cols = list(PLAN) + calibrated_cols + list(TRIVIAL)
    hidden_cols = [f"hidden_{n}" for n in HIDDEN]
    sweep_cols = {rho: [column_name("sweep", n, rho) for n in config.sweep_measures] for rho in config.sweep_rhos
                  if rho != config.rho}
    out: dict[str, Any] = {
        "library": {"hf_geosharp": library or installed(), "calibrated_ball": calibrated_library or installed(),
                    "torch": torch.__version__,
                    "transformers": transformers.__version__, "report_written_with": installed()},
        "protocol": PROTOCOL, "train_version": TRAIN_VERSION,
        "machine": {"platform": platform.platform(), "threads": torch.get_num_threads()},
        "config": dataclasses.asdict(config),
        "settings": {name: config.settings(name).as_dict() for name in PLAN}
        | {column_name("calibrated", n, config.rho): config.settings(n, ball=CALIBRATED_BALL).as_dict()
           for n in config.calibrated_measures},
        "hide": hide_options(config),
        "measured_on": f"{config.n_measure_batches} batches of {config.measure_batch_size} training emails (true "
                       f"labels), their first {config.measure_length} tokens",
        "gaps": {gap: f"{te} - {tr}" for gap, (te, tr) in GAPS.items()},
        "progress": {"members": config.n_models, "trained": len(rows),
                     "main_complete": sum(all(n in r["numbers"] for n in PLAN) for r in rows),
                     "measured": sum(not r["missing"] and bool(r.get("hide")) for r in rows),
                     "complete": sum(complete(r) for r in rows),
                     "calibrated": sum(not r["calibrated_missing"] for r in rows)},
        "taus": _tau_table(rows, main_cols, config),
        "adversarial": {
            "rule": f"hide(target='flat') on members whose {config.hide_gap} is above the median, 'sharp' otherwise",
            "gap": config.hide_gap, "median_gap": info["median_gap"],
            "taus": _tau_table(rows, hidden_cols, config),
            "taus_unmoved": _tau_table([r for r in rows if all(c in r["numbers"] for c in hidden_cols)], list(HIDDEN),
                                       config),  # the same members before they were moved
            **_adversarial_summary(rows),
        },
        "versus_param_norm": _versus_baseline(rows, config, "param_norm", [*PLAN, *calibrated_cols]),
        "versus_adaptive_clean": _versus_baseline(rows, config, "adaptive_clean", [*GEODESIC, *calibrated_cols]),
        "rho_sweep": {f"{rho:g}": _tau_table(rows, cols, config) for rho, cols in sweep_cols.items()},
        "convergence": {col: {"n": sum(col in r["numbers"] for r in rows),
                              "certified": sum(bool(r["numbers"][col].get("converged")) for r in rows
                                               if col in r["numbers"])}
                        for col in list(PLAN) + calibrated_cols + hidden_cols
                        + [c for cols in sweep_cols.values() for c in cols]},
        "measured_again": _measured_again(rows, config),
        "cost": cost(rows),
        "calibrated_columns": calibrated_cols,
        "members": [_member_out(r) for r in rows],
    }
    if previous is not None:
        out["against_previous"] = compare_versions(config, cache, store, library, previous)
    out["rho_sweep"][f"{config.rho:g}"] = {gap: {c: t for c, t in taus.items() if c in config.sweep_measures}
                                           for gap, taus in out["taus"].items()}
    durable.write_json(out_dir / "minilm_family.json", out)
    png = out_dir / "minilm_family.png"
    has_taus = any(out["taus"][gap] for gap in GAPS)
    if has_taus:
        figure(out, png)
    else:
        png.unlink(missing_ok=True)  # no stale figure next to a JSON it does not match
    if doc is not None:
        write_generated(doc, tables_markdown(out, figure_link=has_taus))
    return out


#: What the report keeps of each number (the store keeps the rest: the library version and the measuring set, which
#: are the report's, and the engine's whole configuration).
NUMBER_FIELDS = ("value", "stderr", "converged", "convergence_note", "stationarity_gap", "steps_used", "settings",
                 "clean_loss", "per_batch", "seconds", "cpu_seconds")


def _member_out(row: dict[str, Any]) -> dict[str, Any]:
    keep = ("member", "train_loss", "train_error", "train_loss_clean", "train_error_clean", "train_error_fitted_labels",
            "test_loss", "test_error", "n_flipped", "flipped", "param_norm", "train_seconds", "train_cpu_seconds",
            "hide_target", *GAPS)
    def kept(rec: dict[str, Any]) -> dict[str, Any]:
        """The report's fields of a number, and the step budget of one measured with ``steps="auto"``."""
        auto = rec.get("settings", {}).get("steps") == "auto" and "max_steps" in rec.get("config", {})
        return {k: rec[k] for k in NUMBER_FIELDS if k in rec} | ({"max_steps": rec["config"]["max_steps"]} if auto
                                                                  else {})

    numbers = {col: kept(rec) | ({"first_try": kept(rec["first_try"])} if "first_try" in rec else {})
               for col, rec in row["numbers"].items()}
    hide = row.get("hide")
    return {k: row.get(k) for k in keep} | {"folder": Path(row["folder"]).name, "numbers": numbers,
                                            "hide": None if hide is None else {k: v for k, v in hide.items()
                                                                               if k not in ("key", "kind")},
                                            "missing": row["missing"]}


def _measured_again(rows: list[dict[str, Any]], config: Config) -> dict[str, Any]:
    """The numbers the engine's step budget left uncertified, each with its first and (where stored) its second
    measurement, with ``config.retry_max_steps``."""
    def brief(rec: dict[str, Any]) -> dict[str, Any]:
        return {"value": rec["value"], "converged": rec["converged"], "convergence_note": rec["convergence_note"],
                "max_steps": rec["config"]["max_steps"], "steps_used": rec["steps_used"],
                "cpu_seconds": rec["cpu_seconds"]}

    numbers = []
    for row in rows:
        for col, rec in row["numbers"].items():
            if "first_try" in rec or col in row["more_steps"]:
                first, again = (rec["first_try"], rec) if "first_try" in rec else (rec, None)
                numbers.append({"member": row["member"]["name"], "column": col, "first": brief(first),
                                "again": None if again is None else brief(again)})
    return {"max_steps": config.retry_max_steps, "numbers": numbers}


def _adversarial_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in rows if r.get("hide") and all(f"hidden_{n}" in r["numbers"] for n in HIDDEN)]
    if not done:
        return {"n": 0}

    def ratio(r: dict[str, Any], name: str) -> float:
        return r["numbers"][f"hidden_{name}"]["value"] / r["numbers"][name]["value"]

    out: dict[str, Any] = {"n": len(done),
                           "max_output_deviation": max(r["hide"]["max_output_deviation"] for r in done),
                           "max_condition": max(r["hide"]["max_condition"] for r in done)}
    inv = [abs(ratio(r, "geodesic_inv") - 1) for r in done if "geodesic_inv" in r["numbers"]]
    if inv:
        out["max_geodesic_inv_relative_change"] = max(inv)
    for target in ("flat", "sharp"):
        factors = [ratio(r, "adaptive_clean") for r in done if r["hide_target"] == target
                   and "adaptive_clean" in r["numbers"]]
        if factors:
            out[f"adaptive_clean_factor_{target}"] = {"n": len(factors), "min": min(factors),
                                                      "median": statistics.median(factors), "max": max(factors)}
    return out
