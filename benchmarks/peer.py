"""Peer suite: our adaptive sharpness against an AS23-style solver loop, same model, batch and number of steps.

Target (docs/benchmarks.md): ours >= 1.4 x faster. "Ours" is ``gs.adaptive_sharpness(variant="clean")`` (one forward
and one backward per step, the model never mutated). The peer is :mod:`benchmarks.as23_reference`, the reference code's
per-step work rebuilt from docs/spec.md §5.1 (deep copies of the state dict, per-parameter Python loops, an extra
forward per step, ellipsoid bisection). The library's own faithful variant, ``variant="as23"``, is timed alongside:
same algorithm as the peer, so its value should agree with the peer's, and the gap in time is what the engineering
buys.
"""

from __future__ import annotations

import copy
from typing import Any

import hf_geosharp as gs

from .as23_reference import as23_sharpness
from .common import forward_backward, interleaved
from .config import RunConfig, Workload
from .models import SIZES, bert_batches, bert_classifier

TARGET = 1.4


def workloads(cfg: RunConfig) -> list[Workload]:
    return cfg.pick([Workload("minilm", 16, 128, 20)], [Workload("minilm", 8, 64, 10)])


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    for w in workloads(cfg):
        model = bert_classifier(SIZES[w.size], device=cfg.device)
        peer_model = copy.deepcopy(model)  # the peer mutates its model; ours must not be touched by it
        batches = bert_batches(model, n_batches=1, batch_size=w.batch_size, seq_len=w.seq_len)
        kw = dict(rho=cfg.rho, steps=w.steps, progress=False)
        cases = {
            "ours_clean": lambda: gs.adaptive_sharpness(model, batches, variant="clean", **kw).value,
            "ours_as23": lambda: gs.adaptive_sharpness(model, batches, variant="as23", **kw).value,
            "peer_as23_loop": lambda: as23_sharpness(peer_model, batches[0], rho=cfg.rho, steps=w.steps),
        }
        warmup = lambda: forward_backward(model, batches[0])  # noqa: E731
        timings, values = interleaved(cases, cfg.repeats, cfg.device, warmup=warmup)
        peer = timings["peer_as23_loop"]
        rows.append({
            "model": SIZES[w.size].name,
            "workload": vars(w),
            "timings": {k: t.to_dict() for k, t in timings.items()},
            "values": values,
            "speedup_wall": {k: peer.wall / timings[k].wall for k in ("ours_clean", "ours_as23")},
            "speedup_cpu": {k: peer.cpu / timings[k].cpu for k in ("ours_clean", "ours_as23")},
        })
        del model, peer_model, batches
    return {"suite": "peer", "target": {"peer/ours_clean": TARGET}, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = [
        "| model | batch x seq | steps | peer AS23 loop s | ours clean s | ours as23 s | peer / ours clean "
        "| peer / ours as23 | values (peer, ours as23, ours clean) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        w, t, s, v = r["workload"], r["timings"], r["speedup_wall"], r["values"]
        mark = "ok" if s["ours_clean"] >= TARGET else "MISS"
        lines.append(
            f"| {r['model']} | {w['batch_size']}x{w['seq_len']} | {w['steps']} | {t['peer_as23_loop']['wall']:.2f} | "
            f"{t['ours_clean']['wall']:.2f} | {t['ours_as23']['wall']:.2f} | {s['ours_clean']:.2f} {mark} | "
            f"{s['ours_as23']:.2f} | {v['peer_as23_loop']:.4g}, {v['ours_as23']:.4g}, {v['ours_clean']:.4g} |"
        )
    lines.append(f"\nWall-clock minima over the repeats; target peer / ours (clean) >= {TARGET}.")
    return "\n".join(lines)
