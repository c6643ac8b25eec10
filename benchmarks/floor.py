"""Floor suite: the share of a solver run spent outside the model's forward and backward passes.

The physical floor of a worst-case run is ``(steps + 1) x batches x (forward + backward)`` (docs/spec.md §4.2);
the plain forward+backward is timed in the same process, interleaved with the solver runs. The non-model share
``1 - floor / total`` covers everything else: building the space (Gram factors, Sylvester eigen-factors), writing the
perturbed weights, the geometry of each step, bookkeeping. Target: <= 5 %. Since that work scales with the number of
parameters and the model's with the number of tokens, the suite measures more than one batch size.
"""

from __future__ import annotations

from typing import Any

import hf_geosharp as gs

from .common import forward_backward, interleaved
from .config import RunConfig, Workload
from .models import SIZES, workload_inputs

TARGET = 0.05


def workloads(cfg: RunConfig) -> list[Workload]:
    return cfg.pick(
        [Workload("minilm", 8, 128, 20), Workload("minilm", 32, 128, 20), Workload("minilm", 64, 128, 20),
         Workload("base", 8, 128, 20)],
        [Workload("minilm", 8, 64, 10), Workload("minilm", 32, 64, 10)],
    )


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    for w in workloads(cfg):
        model, batches, smap, source = workload_inputs(w, cfg.device)
        kw = dict(rho=cfg.rho, steps=w.steps, progress=False)
        cases = {
            "forward_backward": lambda: forward_backward(model, batches[0]),
            "adaptive_clean": lambda: gs.adaptive_sharpness(model, batches, variant="clean", **kw).value,
            "geodesic_inv": lambda: gs.geodesic_sharpness(model, batches, metric="inv", symmetry_map=smap, **kw).value,
            "geodesic_mix": lambda: gs.geodesic_sharpness(model, batches, metric="mix", symmetry_map=smap, **kw).value,
        }
        timings, _ = interleaved(cases, cfg.repeats, cfg.device, warmup=lambda: forward_backward(model, batches[0]))
        fb = timings["forward_backward"]
        passes = (w.steps + 1) * w.n_batches
        shares = {}
        for name in ("adaptive_clean", "geodesic_inv", "geodesic_mix"):
            t = timings[name]
            shares[name] = {
                "floor_s": passes * fb.wall,
                "total_s": t.wall,
                "non_model_share_wall": 1 - passes * fb.wall / t.wall,
                "non_model_share_cpu": 1 - passes * fb.cpu / t.cpu,
                "per_step_extra_ms": 1e3 * (t.wall - passes * fb.wall) / passes,
            }
        rows.append({
            "model": SIZES[w.size].name,
            "n_params": sum(p.numel() for p in model.parameters()),
            "tokens_per_batch": w.batch_size * w.seq_len,
            "workload": vars(w),
            "symmetry_map": source,
            "timings": {k: t.to_dict() for k, t in timings.items()},
            "shares": shares,
        })
        del model, batches
    return {"suite": "floor", "target": {"non_model_share": TARGET}, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | batch x seq | steps | fwd+bwd s | measure | total s | floor s | non-model share (wall) | (cpu) "
        "| extra ms/step |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        w = r["workload"]
        for name, s in r["shares"].items():
            mark = "ok" if s["non_model_share_wall"] <= TARGET else "MISS"
            lines.append(
                f"| {r['model']} | {w['batch_size']}x{w['seq_len']} | {w['steps']} | "
                f"{r['timings']['forward_backward']['wall']:.3f} | {name} | {s['total_s']:.2f} | {s['floor_s']:.2f} | "
                f"{100 * s['non_model_share_wall']:.1f} % {mark} | {100 * s['non_model_share_cpu']:.1f} % | "
                f"{s['per_step_extra_ms']:.0f} |"
            )
    lines.append(
        "\nfloor = (steps + 1) x batches x (forward + backward), timed in the same run; "
        f"target <= {100 * TARGET:.0f} %."
    )
    return "\n".join(lines)
