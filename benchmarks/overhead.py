"""Overhead suite: geodesic sharpness (inv, mix) time / adaptive sharpness time, at equal steps and batches.

Target (docs/benchmarks.md): geodesic / adaptive <= 1.05. The fair denominator is the *clean* adaptive variant, which
runs the same solver with the same one forward and one backward per step; AS23 (an extra forward per step, ellipsoid
bisection) is reported next to it. Worst case, 20 steps, random-init BERT classifiers of MiniLM and BERT-base shape.
"""

from __future__ import annotations

from typing import Any

import hf_geosharp as gs

from .common import forward_backward, interleaved
from .config import RunConfig, Workload
from .models import SIZES, bert_batches, bert_classifier, symmetry_map

TARGET = 1.05


def workloads(cfg: RunConfig) -> list[Workload]:
    return [
        cfg.pick(Workload("minilm", 32, 128, 20), Workload("minilm", 8, 64, 10)),
        cfg.pick(Workload("base", 16, 128, 20), Workload("base", 4, 64, 5)),
    ]


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    for w in workloads(cfg):
        model = bert_classifier(SIZES[w.size], device=cfg.device)
        batches = bert_batches(model, n_batches=w.n_batches, batch_size=w.batch_size, seq_len=w.seq_len)
        smap, source = symmetry_map(model)
        kw = dict(rho=cfg.rho, steps=w.steps, progress=False)
        cases = {
            "adaptive_clean": lambda: gs.adaptive_sharpness(model, batches, variant="clean", **kw).value,
            "geodesic_inv": lambda: gs.geodesic_sharpness(model, batches, metric="inv", symmetry_map=smap, **kw).value,
            "geodesic_mix": lambda: gs.geodesic_sharpness(model, batches, metric="mix", symmetry_map=smap, **kw).value,
            "adaptive_as23": lambda: gs.adaptive_sharpness(model, batches, variant="as23", **kw).value,
        }
        warmup = lambda: forward_backward(model, batches[0])  # noqa: E731
        timings, values = interleaved(cases, cfg.repeats, cfg.device, warmup=warmup)
        clean, as23 = timings["adaptive_clean"], timings["adaptive_as23"]
        rows.append({
            "model": SIZES[w.size].name,
            "n_params": sum(p.numel() for p in model.parameters()),
            "workload": vars(w),
            "symmetry_map": source,
            "timings": {k: t.to_dict() for k, t in timings.items()},
            "values": values,
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
        })
        del model, batches
    return {"suite": "overhead", "target": {"geodesic/adaptive_clean": TARGET}, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | batch x seq | steps | clean s | inv s | mix s | AS23 s | inv/clean | mix/clean | inv/AS23 "
        "| mix/AS23 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        w, t, q = r["workload"], r["timings"], r["ratios_wall"]
        lines.append(
            f"| {r['model']} | {w['batch_size']}x{w['seq_len']} | {w['steps']} | {t['adaptive_clean']['wall']:.2f} | "
            f"{t['geodesic_inv']['wall']:.2f} | {t['geodesic_mix']['wall']:.2f} | {t['adaptive_as23']['wall']:.2f} | "
            f"{_mark(q['inv/clean'])} | {_mark(q['mix/clean'])} | {q['inv/as23']:.3f} | {q['mix/as23']:.3f} |"
        )
    lines.append(f"\nWall-clock minima over the repeats; target geodesic / clean adaptive <= {TARGET} "
                 "(CPU-time ratios in the JSON).")
    return "\n".join(lines)


def _mark(ratio: float) -> str:
    return f"{ratio:.3f} {'ok' if ratio <= TARGET else 'MISS'}"
