"""Overhead suite: geodesic sharpness (inv, mix) time / adaptive sharpness time, at equal steps and batches.

Target (docs/benchmarks.md): geodesic / adaptive <= 1.05. The fair denominator is the *clean* adaptive variant, which
runs the same solver with the same one forward and one backward per step; AS23 (an extra forward per step, ellipsoid
bisection) is reported next to it. Worst case, 20 steps, random-init BERT classifiers of MiniLM and BERT-base shape.

The clean solver recomputes the best point's gradient when a halving restarts from an earlier iterate (one more
forward and backward), so the count of passes depends on the run. Every case counts its objective calls (by wrapping
the objective's ``on_device`` in this benchmark only) and the JSON records ``extra_grad_passes``: gradient evaluations
beyond one per step, with their cost estimated at the plain forward+backward time measured in the same rounds.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import hf_geosharp as gs
from hf_geosharp.engine.model_function.objective import Objective

from .common import forward_backward, interleaved
from .config import RunConfig, Workload
from .models import SIZES, workload_inputs

TARGET = 1.05
SOLVES = ("adaptive_clean", "geodesic_inv", "geodesic_mix", "adaptive_as23")


@contextmanager
def counted_calls() -> Iterator[dict[str, int]]:
    """Count the objective's calls with and without a gradient while inside (the library is not changed)."""
    counts = {"with_grad": 0, "without_grad": 0}
    original = Objective.on_device  # what the solver calls (a call of the objective goes through it too)

    pending = Objective.pending  # a last iterate: a gradient only where it is taken

    def counting(self: Objective, xi: Any, need_grad: bool, out: Any = None) -> Any:
        counts["with_grad" if need_grad else "without_grad"] += 1
        return original(self, xi, need_grad, out=out)

    @contextmanager
    def counting_pending(self: Objective, xi: Any, out: Any) -> Iterator[Any]:
        taken = [False]
        with pending(self, xi, out) as (value, take):
            def counted_take() -> None:
                taken[0] = True
                take()

            yield value, counted_take
        counts["with_grad" if taken[0] else "without_grad"] += 1

    Objective.on_device, Objective.pending = counting, counting_pending
    try:
        yield counts
    finally:
        Objective.on_device, Objective.pending = original, pending


def _counting(solve: Callable[[], float]) -> Callable[[], dict[str, Any]]:
    def run() -> dict[str, Any]:
        with counted_calls() as counts:
            value = solve()
        return {"value": value, **counts}

    return run


def workloads(cfg: RunConfig) -> list[Workload]:
    return [
        cfg.pick(Workload("minilm", 32, 128, 20), Workload("minilm", 8, 64, 10)),
        cfg.pick(Workload("base", 16, 128, 20), Workload("base", 4, 64, 5)),
    ]


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    for w in cfg.chosen(workloads(cfg)):
        model, batches, smap, source = workload_inputs(w, cfg.device)
        kw = dict(rho=cfg.rho, steps=w.steps, progress=False)
        cases = {name: _counting(solve) for name, solve in {
            "adaptive_clean": lambda: gs.adaptive_sharpness(model, batches, variant="clean", **kw).value,
            "geodesic_inv": lambda: gs.geodesic_sharpness(model, batches, metric="inv", symmetry_map=smap, **kw).value,
            "geodesic_mix": lambda: gs.geodesic_sharpness(model, batches, metric="mix", symmetry_map=smap, **kw).value,
            "adaptive_as23": lambda: gs.adaptive_sharpness(model, batches, variant="as23", **kw).value,
        }.items()}
        cases["forward_backward"] = lambda: forward_backward(model, batches[0])
        warmup = lambda: forward_backward(model, batches[0])  # noqa: E731
        timings, results = interleaved(cases, cfg.repeats, cfg.device, warmup=warmup)
        clean, as23 = timings["adaptive_clean"], timings["adaptive_as23"]
        rows.append({
            "model": SIZES[w.size].name,
            "n_params": sum(p.numel() for p in model.parameters()),
            "workload": vars(w),
            "symmetry_map": source,
            "timings": {k: t.to_dict() for k, t in timings.items()},
            "values": {k: results[k]["value"] for k in SOLVES},
            "objective_calls": {k: {c: results[k][c] for c in ("with_grad", "without_grad")} for k in SOLVES},
            "extra_grad_passes": _extra_passes(results, timings, w),
            "ratios_wall": {
                "inv/clean": timings["geodesic_inv"].wall / clean.wall,
                "mix/clean": timings["geodesic_mix"].wall / clean.wall,
                "inv/as23": timings["geodesic_inv"].wall / as23.wall,
                "mix/as23": timings["geodesic_mix"].wall / as23.wall,
                "as23/clean": as23.wall / clean.wall,
            },
            "ratios_cpu": {
                "inv/clean": timings["geodesic_inv"].cpu / clean.cpu,
                "mix/clean": timings["geodesic_mix"].cpu / clean.cpu,
                "as23/clean": as23.cpu / clean.cpu,
            },
            "ratios_paired": {basis: {f"{a}/clean": _paired_median(timings, name, "adaptive_clean", basis)
                                      for a, name in (("inv", "geodesic_inv"), ("mix", "geodesic_mix"),
                                                      ("as23", "adaptive_as23"))}
                              for basis in ("walls", "cpus")},
        })
        del model, batches
    return {"suite": "overhead", "target": {"geodesic/adaptive_clean": TARGET}, "rows": rows}


def _paired_median(timings: dict[str, Any], case: str, over: str, basis: str) -> float:
    """The median over the rounds of ``case``'s time over ``over``'s in the same round (``basis``: ``walls`` or
    ``cpus``): the cases run round-robin, so a round's two runs are seconds apart and share the machine's load."""
    return statistics.median(a / b for a, b in zip(getattr(timings[case], basis), getattr(timings[over], basis)))


def _extra_passes(results: dict[str, Any], timings: dict[str, Any], w: Workload) -> dict[str, dict[str, float]]:
    """Forward+backward passes of the clean solver beyond one per step (restarts from an earlier best point), and
    their estimated wall time: that many plain forward+backward passes, as a share of the solve's time."""
    fb = timings["forward_backward"].wall
    out = {}
    for k in SOLVES[:3]:
        extra = results[k]["with_grad"] - w.steps * w.n_batches
        out[k] = {"passes": extra, "seconds": extra * fb, "share_of_solve": extra * fb / timings[k].wall}
    return out


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | batch x seq | steps | clean s | inv s | mix s | AS23 s | inv/clean | mix/clean | inv/AS23 "
        "| mix/AS23 | extra fwd+bwd clean / inv / mix |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        w, t, q = r["workload"], r["timings"], r["ratios_wall"]
        lines.append(
            f"| {r['model']} | {w['batch_size']}x{w['seq_len']} | {w['steps']} | {t['adaptive_clean']['wall']:.2f} | "
            f"{t['geodesic_inv']['wall']:.2f} | {t['geodesic_mix']['wall']:.2f} | {t['adaptive_as23']['wall']:.2f} | "
            f"{_mark(q['inv/clean'])} | {_mark(q['mix/clean'])} | {q['inv/as23']:.3f} | {q['mix/as23']:.3f} | "
            f"{_passes(r)} |"
        )
    lines.append(f"\nWall-clock minima over the repeats (medians of the per-round ratios, wall and CPU, in the JSON's "
                 f"`ratios_paired`); target geodesic / clean adaptive <= {TARGET} "
                 "(CPU-time ratios in the JSON). Extra fwd+bwd: gradient passes beyond one per step (restarts), with "
                 "their estimated share of the solve's time.")
    return "\n".join(lines)


def _mark(ratio: float) -> str:
    return f"{ratio:.3f} {'ok' if ratio <= TARGET else 'MISS'}"


def _passes(row: dict[str, Any]) -> str:
    extra = row["extra_grad_passes"]
    return " / ".join(f"{extra[k]['passes']} ({100 * extra[k]['share_of_solve']:.0f} %)" for k in SOLVES[:3])
