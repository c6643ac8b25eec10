"""AS23's adaptive worst case (``m_apgd_l2`` of Andriushchenko et al. 2023), quirks included, for comparison with
published adaptive-sharpness numbers; :func:`hf_geosharp.engine.solvers.apgd.apgd` is the clean solver the defaults
use."""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
from torch import Tensor

from ..defaults import BLOCK_STEPS
from .certificate import CONVERGENCE_TOL, SolveResult, relative_gap
from .interface import ObjectiveFn
from .pool import Pool
from .schedule import StepSchedule

_BLOCK = 1 << 20  # coordinates per block of the bisection's sums: a few MiB, so a block stays in cache


def _ellipsoid_norm(delta: Tensor, inv_scale: Tensor, lmbd: float, scratch: tuple[Tensor, Tensor]) -> float:
    """``||(delta / |w|) / (1 + 2 lambda / w^2)||``, block by block (float64 across blocks): no parameter-sized
    temporary, two reads of the data per evaluation. At ``lambda = 0`` it is ``||delta * inv_scale||`` for any two
    vectors (:func:`_gap` uses it so), and ``work`` is not touched."""
    u, work = scratch
    total = torch.zeros((), dtype=torch.float64, device=delta.device)
    for start in range(0, delta.numel(), _BLOCK):
        d, inv = delta[start : start + _BLOCK], inv_scale[start : start + _BLOCK]
        ub, wb = torch.mul(d, inv, out=u[: d.numel()]), work[: d.numel()]
        if lmbd:
            torch.mul(inv, inv, out=wb).mul_(2 * lmbd).add_(1.0)  # 1 + 2 lambda / w^2
            ub.div_(wb)
        total += ub.square_().sum()
    return float(total.sqrt())


def _ellipsoid_projection(delta: Tensor, inv_scale: Tensor, rho: float) -> Tensor:
    """AS23's Euclidean projection onto ``||delta / |w| || <= rho`` by bisection on lambda, in place.

    The reference evaluates ``||delta / (1 + 2 lambda / w^2) / |w| ||`` from scratch at each bisection step; here each
    evaluation is one blocked pass over ``delta`` and ``1/|w|`` with block-sized scratch. The bisection, its bracket
    doubling and its stopping rule are the reference's; the sums accumulate in float64, accurate enough for the
    ``1e-5`` stopping tolerance at any model size. ``max_iter`` only guards against a tolerance that rounding makes
    unreachable; bisection reaches machine resolution long before."""
    scratch = (delta.new_empty(min(_BLOCK, delta.numel())), delta.new_empty(min(_BLOCK, delta.numel())))
    new_norm = _ellipsoid_norm(delta, inv_scale, 0.0, scratch)
    if new_norm <= rho:
        return delta
    lmbd, min_lmbd, max_lmbd, max_limit, used = 0.1, 0.0, 10.0, 10.0, None
    for _ in range(200):
        if abs(new_norm - rho) <= 1e-5:
            break
        used = lmbd
        new_norm = _ellipsoid_norm(delta, inv_scale, lmbd, scratch)
        if new_norm > rho:
            lmbd, min_lmbd = (lmbd + max_lmbd) / 2, lmbd
        else:
            lmbd, max_lmbd = (min_lmbd + lmbd) / 2, lmbd
        if max_limit - max_lmbd < 1e-2:
            max_limit, max_lmbd = max_limit * 2, max_lmbd * 2
    if used is None:
        return delta
    work = scratch[1]
    for start in range(0, delta.numel(), _BLOCK):
        d, inv = delta[start : start + _BLOCK], inv_scale[start : start + _BLOCK]
        d.div_(torch.mul(inv, inv, out=work[: d.numel()]).mul_(2 * used).add_(1.0))
    return delta


def apgd_as23(
    scale: Tensor,
    objective: ObjectiveFn,
    *,
    rho: float,
    steps: int = BLOCK_STEPS,
    momentum: float = 0.75,
    min_update_ratio: float = 0.75,
    on_step: Callable[[int, float], None] | None = None,
    max_steps: int | None = None,
    tol: float = CONVERGENCE_TOL,
) -> SolveResult:
    """AS23's ``m_apgd_l2`` adaptive worst case, quirks included.

    ``scale`` is ``|w|`` (zero on frozen coordinates). Faithful to the reference: the step is ``grad * |w|`` over the
    global Euclidean gradient norm, Euclidean projection onto the ellipsoid by bisection, momentum
    ``0.75 P(z) + 0.25 delta_prev`` without re-projection, an extra no-grad forward per step for the loss, and on
    halving only the evaluation point (the "model") is reset to the best point, not ``delta``. With ``max_steps``
    the run continues in blocks of doubling length until its best point is stationary within ``tol`` (the
    Frank-Wolfe gap of the adaptive ball, as in :func:`apgd`), which its stalls do not reach; one start only.

    Its fixed points are not the maximiser's (docs/method.md): it can stall a few percent below the maximum of its
    own objective at any number of steps, which is why the default adaptive baseline is the clean solver."""
    inv_scale = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), 0.0)
    tangents = Pool(scale, 4)
    gradient = torch.empty_like(scale)
    delta = prev_delta = tangents.free()
    delta.zero_()
    point = delta  # where the next gradient is taken (AS23's model state)
    clean_loss, _ = objective(delta, False)
    best_loss, best_point = clean_loss, delta
    schedule = StepSchedule(2.0 * rho, steps, min_update_ratio, clean_loss)
    losses = [clean_loss]
    gap = math.nan  # relative Frank-Wolfe gap at the best point, once its gradient is known
    total, k = steps, -1
    while k + 1 < total:
        k += 1
        _, egrad = objective(point, True, out=gradient)
        if point is best_point:
            gap = _gap(egrad, scale, best_point, rho, best_loss - clean_loss)
            if max_steps is not None and gap <= tol:
                break
        backup = delta
        grad_norm = math.sqrt(max(float(torch.dot(egrad, egrad)), 0.0))
        new = tangents.free(delta, prev_delta, best_point, point)
        torch.mul(egrad, scale, out=new).mul_(schedule.eta / (grad_norm + 1e-12)).add_(delta)
        new = _ellipsoid_projection(new, inv_scale, rho)
        new.mul_(momentum).add_(prev_delta, alpha=1 - momentum)
        prev_delta, delta = backup, new
        point = delta
        loss, _ = objective(point, False)
        losses.append(loss)
        if loss > best_loss:
            best_loss, best_point, gap = loss, point, math.nan
            schedule.n_updates += 1
        if schedule.halve(k, best_loss):
            point = best_point
        if on_step is not None:
            on_step(k, best_loss - clean_loss)
        if max_steps is not None and k == total - 1 and total < max_steps:
            block = min(total, max_steps - total)
            schedule.extend(total, block)
            total += block
    if math.isnan(gap):  # one more gradient, at the best point
        _, egrad = objective(best_point, True, out=gradient)
        gap = _gap(egrad, scale, best_point, rho, best_loss - clean_loss)
    return SolveResult(best_loss, clean_loss, losses, float((best_point * inv_scale).square().sum().sqrt()), gap,
                       [best_loss - clean_loss], [gap], best_point=best_point)


def _gap(egrad: Tensor, scale: Tensor, delta: Tensor, rho: float, sharpness: float) -> float:
    """The relative Frank-Wolfe gap of the adaptive ball at ``delta`` (elementwise metric ``1/w^2``: the Riemannian
    gradient's norm is ``||egrad |w| ||``, its product with ``delta`` is ``<egrad, delta>``)."""
    scratch = egrad.new_empty(min(_BLOCK, egrad.numel()))
    sq_d = _ellipsoid_norm(egrad, scale, 0.0, (scratch, scratch)) ** 2  # blocked: no parameter-sized temporary
    return relative_gap(rho, sq_d, float(torch.dot(egrad, delta)), sharpness)
