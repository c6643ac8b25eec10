"""The result store's keys and what it holds: every number keyed by the member, the measure's settings, the measuring
set, the stage and the library version; :func:`collect` reads a population back (measuring nothing)."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from hf_geosharp.leaderboard.store import ResultStore
from hf_geosharp.measures import Settings

from .config import CALIBRATED_BALL, HIDDEN, PAPER_BALL, PLAN, PROTOCOL, Config, digest, installed, members
from .training import trained_metrics


def hide_options(config: Config) -> dict[str, Any]:
    """What decides the moved member besides its target."""
    return {"condition": config.hide_condition, "search_steps": config.hide_steps, "seed": 0, "rho": config.rho}


def measure_key(row: dict[str, Any], name: str, settings: Settings, stage: str, config: Config,
                library: str | None = None, max_steps: int | None = None) -> str:
    """The store key of one number: the member (its folder and its weights' digest), the measure and its settings,
    the measuring set, the stage (``original``, or ``hidden-<target>`` with the hide options), the protocol, the
    library version (default the installed one) and, for a measurement again with a larger step budget, that budget
    (``max_steps``; None: the engine's default)."""
    hidden = hide_options(config) if stage.startswith("hidden") else None
    budget = {} if max_steps is None else {"max_steps": max_steps}
    return digest(member=Path(row["folder"]).name, weights=row["weights_digest"], name=name,
                   settings=settings.as_dict(), stage=stage, hide=hidden,  # no ball: the paper's, as stored
                   measuring=config.measuring, protocol=PROTOCOL, library=library or installed(), **budget)


def needs_more_steps(record: dict[str, Any], config: Config) -> bool:
    """Whether a stored number is one ``steps="auto"`` left uncertified with a smaller budget than
    ``config.retry_max_steps``: it is measured again with that budget."""
    return (record["settings"]["steps"] == "auto" and not record["converged"]
            and record["config"].get("max_steps", config.retry_max_steps) < config.retry_max_steps)


def hide_key(row: dict[str, Any], target: str, config: Config, library: str | None = None) -> str:
    """The store key of the record of one ``gs.hide`` (its proxy and its function check)."""
    return digest(member=Path(row["folder"]).name, weights=row["weights_digest"], hide=hide_options(config),
                   target=target, measuring=config.measuring,
                   protocol=PROTOCOL, library=library or installed())


def hide_targets(rows: list[dict[str, Any]], config: Config) -> tuple[float, dict[str, str]] | None:
    """The population's median ``hide_gap`` and each member's target (``"flat"`` above it, ``"sharp"`` otherwise);
    None until every member is trained."""
    if len(rows) < config.n_models:
        return None
    median = statistics.median(r[config.hide_gap] for r in rows)
    return median, {r["member"]["name"]: "flat" if r[config.hide_gap] > median else "sharp" for r in rows}


def tasks(row: dict[str, Any], config: Config, target: str | None,
          calibrated: bool = True) -> list[tuple[str, str, float, str]]:
    """Every number one member needs: ``(stage, measure, rho, store stage)``; the hidden ones only with a target,
    the calibrated ball's with ``calibrated``."""
    out = [("main", name, config.rho, "original") for name in PLAN]
    if target is not None:
        out += [("adversarial", name, config.rho, f"hidden-{target}") for name in HIDDEN]
    out += [("sweep", name, rho, "original") for rho in config.sweep_rhos if rho != config.rho
            for name in config.sweep_measures]
    if calibrated:
        out += [("calibrated", name, config.rho, "original") for name in config.calibrated_measures]
    return out


def ball_of(stage: str) -> str:
    """The ball a stage measures under."""
    return CALIBRATED_BALL if stage == "calibrated" else PAPER_BALL



def store_path(cache: Path, store: Path | None) -> Path:
    """The store a run uses: ``store``, else the cache's."""
    return cache / "results.jsonl" if store is None else store


def collect(config: Config, cache: Path, store: Path | None = None, library: str | None = None,
            calibrated_library: str | None = None) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """What the store holds for a library version (default the installed one) and the settings: one row per trained
    member (metrics, gaps, and one record per number: ``numbers[column]``, the one measured again with
    ``config.retry_max_steps`` where there is one, with the first under ``first_try``; ``more_steps``: the columns
    still waiting for it), and the population's hide split. The calibrated ball's numbers are those of
    ``calibrated_library`` (default the installed version: the versions before the radius convention have none);
    one that is missing goes into ``calibrated_missing``, not ``missing``. Measures nothing."""
    records = ResultStore(store_path(cache, store))
    rows = [r for m in members(config) if (r := trained_metrics(m, config, cache, records)) is not None]
    split = hide_targets(rows, config)
    for row in rows:
        target = None if split is None else split[1][row["member"]["name"]]
        row["hide_target"] = target
        row["numbers"], row["missing"], row["more_steps"], row["calibrated_missing"] = {}, [], [], []
        for stage, name, rho, store_stage in tasks(row, config, target):
            settings = config.settings(name, rho, ball_of(stage))
            version = calibrated_library if stage == "calibrated" else library
            record = records.get(measure_key(row, name, settings, store_stage, config, version,
                                             config.first_budget(name)))
            column = column_name(stage, name, rho)
            if record is None:
                row["calibrated_missing" if stage == "calibrated" else "missing"].append(column)
                continue
            if needs_more_steps(record, config):
                again = records.get(measure_key(row, name, settings, store_stage, config, version,
                                                max_steps=config.retry_max_steps))
                if again is None:
                    row["more_steps"].append(column)
                else:
                    record = again | {"first_try": record}
            row["numbers"][column] = record
        if target is not None:
            row["hide"] = records.get(hide_key(row, target, config, library))
        clean = next((r["clean_loss"] for n, r in row["numbers"].items() if n in PLAN), None)
        if clean is not None:  # the trivial predictors go with the measured members, so that the taus compare
            row["numbers"]["param_norm"] = {"value": row["param_norm"]}
            row["numbers"]["clean_loss"] = {"value": clean}
    info = {"median_gap": None if split is None else split[0], "store_records": len(records.records)}
    return rows, info


def complete(row: dict[str, Any]) -> bool:
    """Whether a collected member has every number (measured again where needed) and its adversarial record."""
    return not row["missing"] and not row["more_steps"] and bool(row.get("hide"))


def column_name(stage: str, name: str, rho: float) -> str:
    """The report's column of a number: ``geodesic_inv`` (main), ``hidden_geodesic_inv``, ``geodesic_inv@0.05``,
    ``geodesic_mix_calibrated``."""
    return {"main": name, "adversarial": f"hidden_{name}", "calibrated": f"{name}_{CALIBRATED_BALL}"}.get(
        stage, f"{name}@{rho:g}")


def compare_versions(config: Config, cache: Path, store: Path | None, library: str | None,
                     previous: str) -> dict[str, Any]:
    """The main numbers that two library versions stored for the same members, batch by batch: how many batch
    values are bit-equal, how many numbers each version certified, and both versions' values where a batch changed.
    Measures nothing."""
    then = {r["member"]["name"]: r for r in collect(config, cache, store, previous)[0]}
    columns: dict[str, dict[str, Any]] = {}
    for row in collect(config, cache, store, library)[0]:
        before = then.get(row["member"]["name"], {}).get("numbers", {})
        for col in PLAN:
            a, b = before.get(col), row["numbers"].get(col)
            if a is None or b is None:
                continue
            slot = columns.setdefault(col, {"members": 0, "batches": 0, "batches_bit_equal": 0,
                                            "certified_before": 0, "certified_now": 0, "changed": []})
            equal = [x == y for x, y in zip(a["per_batch"], b["per_batch"])]
            slot["members"] += 1
            slot["batches"] += len(equal)
            slot["batches_bit_equal"] += sum(equal)
            slot["certified_before"] += bool(a.get("converged"))
            slot["certified_now"] += bool(b.get("converged"))
            if not all(equal):
                slot["changed"].append({"member": row["member"]["name"], "value": [a["value"], b["value"]],
                                        "converged": [a.get("converged"), b.get("converged")],
                                        "steps_used": [a.get("steps_used"), b.get("steps_used")],
                                        "batches_changed": [i for i, e in enumerate(equal) if not e]})
    return {"versions": [previous, library or installed()], "columns": columns}
