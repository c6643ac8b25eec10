"""Floor suite: the share of a solver run spent outside the model's forward and backward passes.

The physical floor of a worst-case run is ``(steps + 1) x batches x (forward + backward)`` (docs/spec.md §4.2);
the plain forward+backward is timed in the same process, interleaved with the solver runs. The non-model share
``1 - floor / total`` covers everything else: building the space (Gram factors, Sylvester eigen-factors), writing the
perturbed weights, the geometry of each step, bookkeeping. Target: <= 5 %. Since that work scales with the number of
parameters and the model's with the number of tokens, the suite measures more than one batch size.

Method, robust to other processes' load: in every round each solve is timed right after two plain forward+backward
passes (the faster of them is its floor pass), so each round gives a paired share, and the reported share is the
median over the rounds (the minima over the repeats, the older estimate, are kept in the JSON as
``non_model_share_wall_min``). On a loaded machine the wall share measures the neighbours as much as the solver;
the CPU-time share (process CPU seconds, both basis recorded) does not count the time a thread waits for a core. Run
it with ``OMP_WAIT_POLICY=PASSIVE`` there: OpenMP threads that spin while they wait for each other count as CPU time
(and, on a busy machine, take cores from the thread they wait for); with passive waiting the CPU-time share is close
to the one-thread share, which is below the two-thread wall share (the model's products use both cores, a step's
other work less so: the threads table in docs/benchmarks.md).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from typing import Any

import torch

import hf_geosharp as gs

from .common import Timing, forward_backward, load_average, time_once
from .config import RunConfig, Workload
from .models import SIZES, workload_inputs

TARGET = 0.05
#: Plain forward+backward passes timed right before each solve in a round (the faster is the solve's floor pass).
FLOOR_PASSES = 2


def workloads(cfg: RunConfig) -> list[Workload]:
    return cfg.pick(
        [Workload("minilm", 8, 128, 20), Workload("minilm", 32, 128, 20), Workload("minilm", 64, 128, 20),
         Workload("base", 8, 128, 20)],
        [Workload("minilm", 8, 64, 10), Workload("minilm", 32, 64, 10)],
    )


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    for w in cfg.chosen(workloads(cfg)):
        model, batches, smap, source = workload_inputs(w, cfg.device)
        kw = dict(rho=cfg.rho, steps=w.steps, progress=False)
        cases = {
            "adaptive_clean": lambda: gs.adaptive_sharpness(model, batches, variant="clean", **kw).value,
            "geodesic_inv": lambda: gs.geodesic_sharpness(model, batches, metric="inv", symmetry_map=smap, **kw).value,
            "geodesic_mix": lambda: gs.geodesic_sharpness(model, batches, metric="mix", symmetry_map=smap, **kw).value,
        }
        load = load_average()
        timings, paired = paired_rounds(cases, cfg.repeats, cfg.device, lambda: forward_backward(model, batches[0]))
        rows.append({
            **workload_row(w, model, source),
            "timings": {k: t.to_dict() for k, t in timings.items()},
            "shares": shares_of(timings, paired, (w.steps + 1) * w.n_batches),
            "load_average": {"start": load, "end": load_average()},
        })
        del model, batches
    return {"suite": "floor", "target": {"non_model_share": TARGET}, "rows": rows}


def workload_row(w: Workload, model: torch.nn.Module, source: str) -> dict[str, Any]:
    """The fields that name a timed workload in every suite's row: model, size, tokens and the map's source."""
    return {
        "model": SIZES[w.size].name,
        "n_params": sum(p.numel() for p in model.parameters()),
        "tokens_per_batch": w.batch_size * w.seq_len,
        "workload": vars(w),
        "symmetry_map": source,
    }


def shares_of(timings: dict[str, Timing], paired: dict[str, list[dict[str, float]]], passes: int
              ) -> dict[str, dict[str, Any]]:
    """Per case of :func:`paired_rounds`'s output: its non-model shares and extra time per step against ``passes``
    forward+backward passes (the module docstring)."""
    fb = timings["forward_backward"]
    shares = {}
    for name, rounds in paired.items():
        t = timings[name]
        shares[name] = {
            "floor_s": passes * statistics.median(r["floor_wall"] for r in rounds),
            "total_s": statistics.median(r["wall"] for r in rounds),
            "non_model_share_wall": statistics.median(1 - passes * r["floor_wall"] / r["wall"] for r in rounds),
            "non_model_share_cpu": statistics.median(1 - passes * r["floor_cpu"] / r["cpu"] for r in rounds),
            "non_model_share_wall_min": 1 - passes * fb.wall / t.wall,
            "non_model_share_cpu_min": 1 - passes * fb.cpu / t.cpu,
            "per_step_extra_ms": statistics.median(1e3 * (r["wall"] - passes * r["floor_wall"]) / passes
                                                   for r in rounds),
            "per_step_extra_cpu_ms": statistics.median(1e3 * (r["cpu"] - passes * r["floor_cpu"]) / passes
                                                       for r in rounds),
            "rounds": rounds,
        }
    return shares


def paired_rounds(cases: dict[str, Callable[[], Any]], repeats: int, device: str, plain: Callable[[], Any]
            ) -> tuple[dict[str, Timing], dict[str, list[dict[str, float]]]]:
    """Each case ``repeats`` times, round-robin, each run right after :data:`FLOOR_PASSES` ``plain`` passes; the
    minima per case (``forward_backward``: the plain pass) and, per case, every round's times with its floor pass."""
    plain()  # warm-up: lazy init, kernel selection
    walls: dict[str, list[float]] = {name: [] for name in ("forward_backward", *cases)}
    cpus: dict[str, list[float]] = {name: [] for name in walls}
    paired: dict[str, list[dict[str, float]]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            floor = [time_once(plain, device)[1:] for _ in range(FLOOR_PASSES)]
            _, wall, cpu = time_once(fn, device)
            for fw, fc in floor:
                walls["forward_backward"].append(fw)
                cpus["forward_backward"].append(fc)
            walls[name].append(wall)
            cpus[name].append(cpu)
            paired[name].append({"wall": wall, "cpu": cpu, "floor_wall": min(f[0] for f in floor),
                                 "floor_cpu": min(f[1] for f in floor)})
    timings = {name: Timing(min(walls[name]), min(cpus[name]), walls[name], cpus[name]) for name in walls}
    return timings, paired


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | batch x seq | steps | fwd+bwd s | measure | total s | floor s | non-model share (wall) | (cpu) "
        "| extra ms/step (wall) | (cpu) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        w = r["workload"]
        for name, s in r["shares"].items():
            mark = "ok" if s["non_model_share_wall"] <= TARGET else "MISS"
            lines.append(
                f"| {r['model']} | {w['batch_size']}x{w['seq_len']} | {w['steps']} | "
                f"{r['timings']['forward_backward']['wall']:.3f} | {name} | {s['total_s']:.2f} | {s['floor_s']:.2f} | "
                f"{100 * s['non_model_share_wall']:.1f} % {mark} | {100 * s['non_model_share_cpu']:.1f} % | "
                f"{s['per_step_extra_ms']:.0f} | {s.get('per_step_extra_cpu_ms', float('nan')):.0f} |"
            )
    lines.append(
        "\nfloor = (steps + 1) x batches x (forward + backward), timed in the same run right before each solve; "
        f"medians over the rounds of each round's paired share; target <= {100 * TARGET:.0f} %."
    )
    return "\n".join(lines)
