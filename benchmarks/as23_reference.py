"""The per-step work of the AS23 reference code (Andriushchenko et al. 2023, ``m_apgd_l2`` adaptive), re-implemented.

Written from docs/spec.md §5.1, not from the reference source, as the "peer" in the benchmarks: how fast is a
solver loop built the way the reference builds it, on the same model, batch and number of steps? Its habits are
reproduced on purpose, because they are what costs time:

* the model itself is perturbed in place and restored from ``copy.deepcopy(model.state_dict())`` snapshots, and a new
  deep copy is taken of the best state whenever the loss improves;
* the perturbation lives in a dict of per-parameter tensors and every operation is a Python loop over parameters;
* each step takes a forward+backward at the current point and then an extra no-grad forward for the new point's loss;
* the ellipsoid projection bisects on lambda, re-evaluating the weighted norm over all parameters at every try.

The arithmetic is that of docs/spec.md §5.1 (step ``eta / ||g|| * g * |w|``, ellipsoid projection, momentum
``0.75 P(z) + 0.25 delta_prev`` without re-projection, halving at the AS23 checkpoints with the model reloaded to the
best state). It is a benchmark fixture, not part of the library: :func:`hf_geosharp.adaptive_sharpness` with
``variant="as23"`` is the library's faithful and efficient version of the same algorithm.
"""

from __future__ import annotations

import copy
import math

import torch
from torch import nn

from hf_geosharp.engine.solvers.schedule import as23_checkpoints


def _weighted_norm(delta: dict[str, torch.Tensor], inv_w: dict[str, torch.Tensor]) -> float:
    """``|| delta / |w| ||`` over all parameters, a Python loop over them as in the reference."""
    return math.sqrt(sum(float((d * inv_w[name]).square().sum()) for name, d in delta.items()))


def _ellipsoid_projection(
    delta: dict[str, torch.Tensor], orig: dict[str, torch.Tensor], rho: float
) -> dict[str, torch.Tensor]:
    """Euclidean projection onto ``||delta / |w| || <= rho``: ``delta / (1 + 2 lambda / w^2)``, lambda by bisection.

    ``1/|w|`` is formed once per call (zero weights get 0 instead of the reference's division by zero), so the
    bisection itself costs what the reference's does: one pass over every parameter per try."""
    inv_w = {}
    for name in delta:
        w = orig[name].abs()
        inv_w[name] = torch.where(w > 0, 1.0 / torch.where(w > 0, w, torch.ones_like(w)), 0.0)
    norm = _weighted_norm(delta, inv_w)
    if norm <= rho:
        return delta
    lmbd, min_lmbd, max_lmbd, max_limit = 0.1, 0.0, 10.0, 10.0
    tmp = delta
    for _ in range(200):
        if abs(norm - rho) <= 1e-5:
            break
        tmp = {name: d / (1 + 2 * lmbd * inv_w[name].square()) for name, d in delta.items()}
        norm = _weighted_norm(tmp, inv_w)
        if norm > rho:
            lmbd, min_lmbd = (lmbd + max_lmbd) / 2, lmbd
        else:
            lmbd, max_lmbd = (min_lmbd + lmbd) / 2, lmbd
        if max_limit - max_lmbd < 1e-2:
            max_limit, max_lmbd = max_limit * 2, max_lmbd * 2
    return tmp


def as23_sharpness(
    model: nn.Module, batch: dict[str, torch.Tensor], *, rho: float, steps: int = 20, momentum: float = 0.75
) -> float:
    """AS23-style worst-case adaptive sharpness of one batch; the model is perturbed in place, restored at the end."""
    model.eval()
    named = [(n, p) for n, p in model.named_parameters()]
    orig = copy.deepcopy(model.state_dict())
    with torch.no_grad():
        init_loss = float(model(**batch).loss)
    delta = {n: torch.zeros_like(p) for n, p in named}
    prev_delta = copy.deepcopy(delta)
    best_loss, best_state = init_loss, copy.deepcopy(model.state_dict())
    eta, checkpoints = 2.0 * rho, set(as23_checkpoints(steps))
    n_updates, prev_checkpoint, prev_eta, prev_best = 0, 0, eta, init_loss
    try:
        for i in range(steps):
            model.zero_grad(set_to_none=True)
            model(**batch).loss.backward()
            grad_norm = math.sqrt(sum(float(p.grad.norm()) ** 2 for _, p in named if p.grad is not None))
            backup = copy.deepcopy(delta)
            for n, p in named:
                if p.grad is not None:
                    delta[n] = delta[n] + eta / (grad_norm + 1e-12) * p.grad * orig[n].abs()
            delta = _ellipsoid_projection(delta, orig, rho)
            delta = {n: momentum * delta[n] + (1 - momentum) * prev_delta[n] for n in delta}
            prev_delta = backup
            with torch.no_grad():
                for n, p in named:
                    p.copy_(orig[n] + delta[n])
                loss = float(model(**batch).loss)
            if loss > best_loss:
                best_loss, best_state = loss, copy.deepcopy(model.state_dict())
                n_updates += 1
            if i in checkpoints:
                cond1 = n_updates < 0.75 * (i - prev_checkpoint)
                cond2 = prev_eta == eta and prev_best == best_loss
                prev_eta, prev_best, prev_checkpoint, n_updates = eta, best_loss, i, 0
                if cond1 or cond2:
                    eta *= 0.5
                    model.load_state_dict(best_state)
    finally:
        model.load_state_dict(orig)
        model.zero_grad(set_to_none=True)
    return best_loss - init_loss
