"""The symmetry report: what was mapped, the dimensions it implies, and how well-conditioned each head is.

The conditioning part checks the paper's Assumption 5.1 (G and H of full column rank): the metrics invert
``G^T G + eps I`` and ``H^T H + eps I``, so a head whose smallest singular value is tiny next to its largest makes
the geometry lean on ``eps``; the report names such heads and suggests an ``eps`` that tames them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..engine.defaults import EPSILON
from .flat import flat_vector, parameters_in_order

if TYPE_CHECKING:  # SymmetryMap.summary() calls into this module: no runtime import back into base
    from .base import SymmetryMap

NEAR_SINGULAR_RTOL = 1e-3  # smallest / largest singular value below this: cond(G^T G) above 1e6


def symmetry_report(smap: SymmetryMap, model: nn.Module | None = None, *, rtol: float = NEAR_SINGULAR_RTOL) -> dict:
    """The report as a JSON-ready dict; with ``model``, per-head conditioning of G and H is added.

    Keys: ``n_params`` (the flat vector), ``n_params_in_scope`` (minus ``smap.frozen``), ``n_pairs_qk``,
    ``n_pairs_vo``, ``n_pairs_lora``, ``n_pairs_linear``, ``head_dims``, ``lora_ranks``, ``n_paired_params``,
    ``n_elementwise_params``, ``orbit_dim`` (sum of the groups' dimensions), ``quotient_dim`` (in-scope
    parameters minus orbit), ``blocks``, ``fallbacks``, ``notes``, and with a model ``conditioning``.

    Args:
        smap: the model's symmetry map.
        model: the model, for the per-head conditioning (``None``: left out).
        rtol: a factor whose smallest singular value is below ``rtol`` times its largest is flagged.

    Returns:
        The report.
    """
    sizes = dict(zip(smap.param_names, (int(torch.Size(s).numel()) for s in smap.param_shapes)))
    n_in_scope = smap.n_params - sum(sizes[name] for name in smap.frozen)
    n_pairs = {kind: sum(b.n_pairs for b in smap.blocks if b.kind == kind) for kind in ("qk", "vo", "lora", "linear")}
    orbit_dim = sum(b.n_pairs * b.group_dim for b in smap.blocks)
    n_paired = sum(b.G_index.numel() + b.H_index.numel() for b in smap.blocks)
    report = {
        "n_params": smap.n_params,
        "n_params_in_scope": n_in_scope,
        "scope": smap.scope,
        **{f"n_pairs_{kind}": n for kind, n in n_pairs.items()},
        "head_dims": sorted({b.head_dim for b in smap.blocks if b.kind in ("qk", "vo")}),
        "lora_ranks": sorted({b.head_dim for b in smap.blocks if b.kind == "lora"}),
        "n_paired_params": n_paired,
        "n_elementwise_params": n_in_scope - n_paired,
        "orbit_dim": orbit_dim,
        "quotient_dim": n_in_scope - orbit_dim,
        "blocks": [
            {"kind": b.kind, "module": b.module, "n_pairs": b.n_pairs, "G_rows": b.G_index.shape[1],
             "H_rows": b.H_index.shape[1], "head_dim": b.head_dim, "group_dim": b.group_dim,
             "group": f"GL({b.head_dim})" if b.lie_basis is None
             else f"subgroup of GL({b.head_dim}), dim {b.group_dim}",
             "note": b.note}
            for b in smap.blocks
        ],
        "fallbacks": [{"module": f.module, "reason": f.reason} for f in smap.fallbacks],
        "notes": list(smap.notes),
    }
    if model is not None:
        report["conditioning"] = _conditioning(smap, model, rtol)
    return report


def _conditioning(smap: SymmetryMap, model: nn.Module, rtol: float) -> dict:
    """Per pair the extreme singular values of G and H, warnings for near-singular factors, and a suggested eps."""
    flat = flat_vector(parameters_in_order(model, smap))
    pairs, warnings, worst_scale = [], [], 0.0
    for block in smap.blocks:
        sv = {f: torch.linalg.svdvals(flat[idx.to(flat.device)]).cpu()
              for f, idx in (("G", block.G_index), ("H", block.H_index))}
        for i in range(block.n_pairs):
            label = block.labels[i] if i < len(block.labels) else f"{block.module} pair {i}"
            row = {"label": label, "kind": block.kind}
            for factor, values in sv.items():
                s_min, s_max = float(values[i, -1]), float(values[i, 0])
                row[f"{factor}_smin"], row[f"{factor}_smax"] = s_min, s_max
                if s_max == 0.0:
                    warnings.append(f"{label} ({block.kind}): {factor} is zero (e.g. a freshly initialised LoRA B); "
                                    "its metric is defined by eps alone")
                elif s_min < rtol * s_max:
                    warnings.append(f"{label} ({block.kind}): {factor} is near-singular (smallest/largest singular "
                                    f"value {s_min:.3g}/{s_max:.3g})")
                    worst_scale = max(worst_scale, s_max)
            pairs.append(row)
    # eps = (rtol * s_max)^2 caps cond(G^T G + eps I) at about 1/rtol^2 for the worst flagged factor
    suggested = (rtol * worst_scale) ** 2 if worst_scale > 0 else None
    return {"rtol": rtol, "pairs": pairs, "warnings": warnings, "suggested_epsilon": suggested}


def format_report(report: dict) -> str:
    """A plain-text table of a :func:`symmetry_report` dict, for the terminal.

    Args:
        report: a :func:`symmetry_report` dict.

    Returns:
        The table.
    """
    lines = [
        f"Symmetry map: {report['n_params']:,} parameters ({report['n_params_in_scope']:,} in scope "
        f"'{report['scope']}')",
        f"  pairs: {report['n_pairs_qk']} QK, {report['n_pairs_vo']} VO, {report['n_pairs_lora']} LoRA"
        f"   head dims: {report['head_dims'] or '-'}" + (f"   LoRA ranks: {report['lora_ranks']}"
                                                         if report["lora_ranks"] else ""),
        f"  orbit dim {report['orbit_dim']:,}   quotient dim {report['quotient_dim']:,}   "
        f"paired params {report['n_paired_params']:,}   elementwise params {report['n_elementwise_params']:,}",
    ]
    if report["blocks"]:
        width = max(len(b["module"]) for b in report["blocks"])
        lines += ["", f"  {'kind':5} {'module':{width}} {'pairs':>5} {'G':>10} {'H':>10}  group"]
        for b in report["blocks"]:
            lines.append(f"  {b['kind']:5} {b['module']:{width}} {b['n_pairs']:>5} "
                         f"{str(b['G_rows']) + 'x' + str(b['head_dim']):>10} "
                         f"{str(b['H_rows']) + 'x' + str(b['head_dim']):>10}  {b['group']}")
    cond = report.get("conditioning")
    if cond and cond["pairs"]:
        lines += ["", "  conditioning (worst pair per kind: smallest / largest singular value)"]
        for kind in dict.fromkeys(p["kind"] for p in cond["pairs"]):
            rows = [p for p in cond["pairs"] if p["kind"] == kind]
            for factor in ("G", "H"):
                worst = min(rows, key=lambda p: p[f"{factor}_smin"] / max(p[f"{factor}_smax"], 1e-300))
                lines.append(f"  {kind:5} {factor}: {worst[f'{factor}_smin']:.3g} / {worst[f'{factor}_smax']:.3g}"
                             f"  ({worst['label']})")
    for title, items in (("fallbacks (treated elementwise)", [f"{f['module']}: {f['reason']}"
                                                             for f in report["fallbacks"]]),
                         ("notes", report["notes"]),
                         ("warnings", cond["warnings"] if cond else [])):
        if items:
            lines += ["", f"  {title}:"] + [f"    - {item}" for item in items]
    if cond and cond["suggested_epsilon"] is not None:
        lines.append(f"    suggested epsilon: {cond['suggested_epsilon']:.3g} (default {EPSILON:g})")
    return "\n".join(lines)
