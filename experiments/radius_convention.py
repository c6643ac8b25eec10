"""The radius convention measured on demo zoo members: the figures of docs/method.md, "Radius convention", written to
``docs/results/radius_convention.json``.

For each member (the demo's data: 4 batches of 64 training digits, seed 0):

1. **Scaling direction**: for every attention pair, the norm of ``(G, H) -> (1 + t)(G, H)`` under each metric and
   ball, divided by its adaptive norm ``t sqrt((n + m) h)`` (calibrated: 1 by construction; the paper's: the spread
   the issue measured), and each head's ``||G H^T||_F / sqrt(h)``.
2. **The balls at rho 0.1** (``steps="auto"``): adaptive, and inv and mix under both balls: value, certificate, steps
   used, and at each batch's worst point the relative change of the attention weights (query, key, value and output
   projections, weights and biases: ``||Delta|| / ||W||``, Euclidean) and of the products ``G H^T`` (rms over heads of
   ``||Delta(G H^T)||_F / ||G H^T||_F``).

    python -m experiments.radius_convention          # ~10 min on 2 CPU cores (the zoo must be built: geosharp demo)
    python -m experiments.radius_convention --measures "mix calibrated"   # one measure again, the rest kept
    python -m experiments.radius_convention --spectra   # every zoo member's tau / lambda_min(P Q), in seconds
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

import torch

import hf_geosharp as gs
from hf_geosharp.data import DataSpec, load_batches, load_model, load_processor
from hf_geosharp.durable import write_json
from hf_geosharp.engine.space.perturbation_space import pair_weights
from hf_geosharp.symmetry.flat import flat_vector, parameters_in_order
from hf_geosharp.zoo import DIGITS_DIR, cache_root

OUT = Path(__file__).resolve().parents[1] / "docs" / "results" / "radius_convention.json"
MEMBERS = ("zoo-00", "zoo-01")
RHO = 0.1
#: (label, function, keyword arguments): the measures compared.
MEASURES = (
    ("adaptive", "adaptive", {}),
    ("inv calibrated", "geodesic", {"metric": "inv", "ball": "calibrated"}),
    ("inv paper", "geodesic", {"metric": "inv", "ball": "paper"}),
    ("mix calibrated", "geodesic", {"metric": "mix", "ball": "calibrated"}),
    ("mix paper", "geodesic", {"metric": "mix", "ball": "paper"}),
)


def _heads(model: torch.nn.Module) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], Any]:
    """Every attention pair's ``(G, H)`` (float64) and the symmetry map."""
    smap = gs.map_symmetries(model)
    flat = flat_vector(parameters_in_order(model, smap)).double()
    return [(flat[b.G_index[k]], flat[b.H_index[k]]) for b in smap.blocks for k in range(b.n_pairs)], smap


def scaling_ratios(model: torch.nn.Module) -> dict[str, Any]:
    """Per head, the norm of scaling its factors over the adaptive norm, per metric and ball (``t`` cancels; the
    relaxation is left out: it moves these by about ``epsilon``), and ``||G H^T||_F / sqrt(h)``."""
    out: dict[str, list[float]] = {"inv paper": [], "mix paper": [], "inv calibrated": [], "mix calibrated": [],
                                   "GH_over_sqrt_h": []}
    for G, H in _heads(model)[0]:
        (n, h), m = G.shape, H.shape[0]
        P, Q = G.mT @ G, H.mT @ H
        adaptive = math.sqrt((n + m) * h)
        inv = math.sqrt(float(torch.trace(torch.linalg.solve(P, P)) + torch.trace(torch.linalg.solve(Q, Q))))
        mix = math.sqrt(float(torch.trace(Q @ P) + torch.trace(P @ Q)))
        square = float(torch.linalg.matrix_norm(G @ H.mT) ** 2)
        out["inv paper"].append(inv / adaptive)
        out["mix paper"].append(mix / adaptive)
        out["inv calibrated"].append(math.sqrt((n + m) / 2) * inv / adaptive)
        w_mix = float(pair_weights(P[None], Q[None], "mix", n, m, epsilon=0.0)[0])
        out["mix calibrated"].append(math.sqrt(w_mix) * mix / adaptive)
        out["GH_over_sqrt_h"].append(math.sqrt(square / h))
    return out


def spectra(root: Path) -> dict[str, dict[str, float]]:
    """Every zoo member's ``tau / lambda_min(P Q)`` over its heads (median and max; the relaxed ``P``, ``Q`` at the
    default epsilon): how far the calibrated mix ball's scaling norm exceeds adaptive's, squared."""
    out = {}
    for path in sorted(root.glob("zoo-*")):
        ratios = []
        for G, H in _heads(load_model(str(path)))[0]:
            (n, h), m = G.shape, H.shape[0]
            GtG, HtH = (G.mT @ G)[None], (H.mT @ H)[None]
            tau = float((GtG * HtH).sum()) / h
            ratios.append(tau * float(pair_weights(GtG, HtH, "mix", n, m)[0]) / ((n + m) / 2))
        ratios.sort()
        out[path.name] = {"median": ratios[len(ratios) // 2], "max": ratios[-1]}
        print(f"  {path.name}: tau / lambda_min(P Q) median {ratios[len(ratios) // 2]:.3g} max {ratios[-1]:.3g}")
    return out


def _relative_changes(model: torch.nn.Module, perturbation: Any) -> dict[str, float]:
    """The attention weights' relative change (every entry of every pair's ``G`` and ``H``: the query, key, value and
    output projections and the q/k/v biases) and the products' rms relative change, at one worst point."""
    before, _ = _heads(model)
    moved = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in moved.named_parameters():
            if name in perturbation.delta:
                p.add_(perturbation.delta[name].to(p.dtype))
    after, _ = _heads(moved)
    assert len(after) == len(before)
    weights = math.sqrt(sum(float(G.square().sum() + H.square().sum()) for G, H in before))
    change = math.sqrt(sum(float((G2 - G).square().sum() + (H2 - H).square().sum())
                           for (G, H), (G2, H2) in zip(before, after)))
    products = [float(torch.linalg.matrix_norm(G2 @ H2.mT - G @ H.mT) / torch.linalg.matrix_norm(G @ H.mT))
                for (G, H), (G2, H2) in zip(before, after)]
    return {"attention_weights": change / weights,
            "products_rms": math.sqrt(sum(p * p for p in products) / len(products))}


def balls(model: torch.nn.Module, batches: list, labels: list[str]) -> dict[str, Any]:
    """The measures ``labels`` at rho 0.1, ``steps="auto"``, with their worst points' relative changes."""
    out = {}
    for label, family, kwargs in MEASURES:
        if label not in labels:
            continue
        fn = gs.geodesic_sharpness if family == "geodesic" else gs.adaptive_sharpness
        start = time.perf_counter()
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            res = fn(model, batches, rho=RHO, steps="auto", progress=False, return_perturbation=True, **kwargs)
        changes = [_relative_changes(model, p) for p in res.perturbations]
        out[label] = {
            "value": res.value, "clean_loss": res.clean_loss, "certified": bool(res.converged),
            "certificate": res.certificate, "steps_used": res.steps_used,
            "attention_weights_change": sum(c["attention_weights"] for c in changes) / len(changes),
            "products_change_rms": sum(c["products_rms"] for c in changes) / len(changes),
            "seconds": time.perf_counter() - start,
        }
        print(f"  {label:15s} value {res.value:.4g} (clean {res.clean_loss:.4g}) certified {res.converged} "
              f"steps {res.steps_used}; attention weights {out[label]['attention_weights_change']:.3%}, "
              f"G H^T rms {out[label]['products_change_rms']:.3%}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", nargs="+", default=list(MEMBERS))
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--measures", nargs="+", default=[label for label, _, _ in MEASURES],
                        choices=[label for label, _, _ in MEASURES],
                        help="measure these again; the others' stored numbers in --out are kept")
    parser.add_argument("--spectra", action="store_true",
                        help="only each zoo member's tau / lambda_min(P Q) (seconds), kept beside the stored balls")
    args = parser.parse_args()
    torch.set_num_threads(1)
    root = cache_root() / "zoo"
    data = DataSpec(dataset=str(root / DIGITS_DIR), split="train", n_examples=256, batch_size=64, seed=0)
    report: dict[str, Any] = {"rho": RHO, "steps": "auto", "data": vars(data) | {"dataset": "digits"}, "members": {}}
    previous = json.loads(args.out.read_text()) if args.out.exists() else {}
    if args.spectra:
        write_json(args.out, previous | {"spectra": spectra(root)})
        print(f"written: {args.out}")
        return
    stored = previous.get("members", {})
    report["spectra"] = previous.get("spectra")
    for name in args.members:
        source = str(root / name)
        model = load_model(source)
        batches = load_batches(model, load_processor(source, model), data)
        print(f"{name}:", flush=True)
        ratios = scaling_ratios(model)
        summary = {k: {"min": min(v), "median": sorted(v)[len(v) // 2], "max": max(v)} for k, v in ratios.items()}
        for k, v in summary.items():
            print(f"  scaling norm / adaptive, {k:15s}: min {v['min']:.4g} median {v['median']:.4g} max {v['max']:.4g}")
        measured = stored.get(name, {}).get("balls", {}) | balls(model, batches, args.measures)
        report["members"][name] = {"hidden": model.config.hidden_size, "heads": model.config.num_attention_heads,
                                   "layers": model.config.num_hidden_layers, "scaling": summary, "balls": measured}
    write_json(args.out, report)
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
