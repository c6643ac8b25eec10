"""What the population costs: seconds per task and stage from the records, and what is left with its estimate
(``--status``)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from .config import CALIBRATED_BALL, DEFAULT_CPU_SECONDS, PLAN, PROTOCOL, Config, installed, members
from .store import collect, column_name, complete, store_path, tasks


def cost(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Seconds per stage and per measure, from the records (wall and CPU), and per member; a number measured again
    with a larger step budget counts under its own task, its first measurement under the measure's."""
    per: dict[str, dict[str, float]] = {}

    def add(kind: str, rec: dict[str, Any]) -> None:
        slot = per.setdefault(kind, {"n": 0, "seconds": 0.0, "cpu_seconds": 0.0})
        slot["n"] += 1
        slot["seconds"] += rec.get("seconds", math.nan)
        slot["cpu_seconds"] += rec.get("cpu_seconds", math.nan)

    for row in rows:
        add("train", {"seconds": row["train_seconds"], "cpu_seconds": row["train_cpu_seconds"]})
        for col, rec in row["numbers"].items():
            if "seconds" in rec:
                kind = column_kind(col)
                if "first_try" in rec:
                    add(kind, rec["first_try"])
                    kind = again_kind(kind, rec["config"]["max_steps"])
                add(kind, rec)
        if row.get("hide"):
            add("adversarial/hide", row["hide"])
    for slot in per.values():
        slot["cpu_seconds_each"] = slot["cpu_seconds"] / slot["n"]
        slot["seconds_each"] = slot["seconds"] / slot["n"]
    stages: dict[str, dict[str, float]] = {}
    for kind, slot in per.items():
        stage = kind.split("/")[0]
        agg = stages.setdefault(stage, {"seconds": 0.0, "cpu_seconds": 0.0})
        agg["seconds"] += slot["seconds"]
        agg["cpu_seconds"] += slot["cpu_seconds"]
    return {"per_task": per, "per_stage": stages,
            "total_seconds": sum(s["seconds"] for s in stages.values()),
            "total_cpu_seconds": sum(s["cpu_seconds"] for s in stages.values())}


def _task_kind(stage: str, name: str) -> str:
    """A task's kind: ``stage/measure``."""
    return f"{stage}/{name}"


def column_kind(column: str) -> str:
    """The task kind of a report column (``hidden_adaptive_clean`` -> ``adversarial/adaptive_clean``)."""
    stage = ("adversarial" if column.startswith("hidden_") else "sweep" if "@" in column
             else "calibrated" if column.endswith(f"_{CALIBRATED_BALL}") else "main")
    return _task_kind(stage, column.split("@")[0].removeprefix("hidden_").removesuffix(f"_{CALIBRATED_BALL}"))


def again_kind(kind: str, max_steps: int) -> str:
    """The kind of a number measured again with ``max_steps``."""
    return f"{kind} again ({max_steps} steps)"


def remaining(config: Config, cache: Path, store: Path | None = None, library: str | None = None) -> dict[str, Any]:
    """What is left to compute, and its estimated CPU seconds (means of the stored records of each kind, else
    ``DEFAULT_CPU_SECONDS``; a number measured again with a larger step budget: its first measurement's seconds
    scaled by the budgets' ratio, as if every batch used the whole budget)."""
    rows, _ = collect(config, cache, store, library)
    per_task = cost(rows)["per_task"]

    def each(kind: str) -> float:
        if kind in per_task:
            return per_task[kind]["cpu_seconds_each"]
        return DEFAULT_CPU_SECONDS.get(kind, 100.0)

    todo: dict[str, int] = {}
    seconds: dict[str, float] = {}
    by_name = {r["member"]["name"]: r for r in rows}
    for member in members(config):
        row = by_name.get(member.name)
        kinds = [] if row is not None and row.get("hide") else ["adversarial/hide"]
        numbers = {} if row is None else row["numbers"]
        kinds += [_task_kind(s, n) for s, n, rho, _ in tasks({}, config, "flat")
                  if column_name(s, n, rho) not in numbers]
        again = [] if row is None else [(again_kind(column_kind(c), config.retry_max_steps), numbers[c])
                                        for c in row["more_steps"]]
        if row is None or ((kinds or again) and not (Path(row["folder"]) / "metrics.json").exists()):
            kinds.append("train/train")  # trained first, or again on this machine
        for kind, first in [(kind, None) for kind in kinds] + again:
            todo[kind] = todo.get(kind, 0) + 1
            scaled = None if first is None else (first["cpu_seconds"] * config.retry_max_steps
                                                 / first["config"]["max_steps"])
            seconds[kind] = seconds.get(kind, 0.0) + (each(kind) if scaled is None else scaled)
    return {"tasks": todo, "cpu_seconds": seconds, "total_cpu_seconds": sum(seconds.values())}


def status(config: Config, cache: Path, store: Path | None = None, library: str | None = None) -> str:
    """A few lines: members trained and measured, what is left, and its estimated time on one free core."""
    rows, info = collect(config, cache, store, library)
    left = remaining(config, cache, store, library)
    main = sum(all(n in r["numbers"] for n in PLAN) for r in rows)
    here = sum((Path(r["folder"]) / "metrics.json").exists() for r in rows)
    spent = cost(rows)
    lines = [f"hf_geosharp {library or installed()}, protocol {PROTOCOL}; cache {cache}, "
             f"store {store_path(cache, store)}",
             f"members: {len(rows)}/{config.n_models} trained ({here} in the cache), {main} with every main number, "
             f"{sum(complete(r) for r in rows)} complete (main, adversarial, sweep); {info['store_records']} records "
             "in the store (all versions)"]
    if info["median_gap"] is None:
        lines.append("adversarial targets: not yet (every member must be trained)")
    for stage, agg in spent["per_stage"].items():
        lines.append(f"  spent on {stage}: {agg['seconds'] / 3600:.2f} h wall, {agg['cpu_seconds'] / 3600:.2f} CPU h")
    if left["tasks"]:
        lines.append("left: " + ", ".join(f"{n} x {kind}" for kind, n in sorted(left["tasks"].items())))
    lines.append(f"estimated remaining: {left['total_cpu_seconds'] / 3600:.1f} CPU h (one thread on a free core; "
                 "divide by the shards running, multiply by the load's slowdown)")
    return "\n".join(lines)
