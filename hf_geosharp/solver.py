"""Solvers for worst-case and average-case sharpness over any perturbation space.

The worst case is Auto-PGD as used by Andriushchenko et al. 2023 (AS23) and by the paper's Algorithm 1 (spec §4):
step-size checkpoints, halving, momentum and best-point tracking. :func:`apgd` is the clean version of spec §4.2
(one forward and one backward per step: the loss of an iterate comes from the forward that gives its gradient).
:func:`apgd_as23` reproduces the reference code's quirks (spec §5.1) so that adaptive-sharpness numbers are comparable
with the literature. Both talk to a space only through ``zero``, ``norm``, ``riemannian_gradient``, ``project`` and
``random_tangent_vector``; the objective is a callable ``(xi, need_grad) -> (loss, euclidean_grad | None)``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Literal, Protocol

import torch
from torch import Tensor

Objective = Callable[[Tensor, bool], tuple[float, "Tensor | None"]]
StepNormalization = Literal["riemannian", "euclidean", "none"]


class Space(Protocol):
    def zero(self) -> Tensor: ...
    def norm(self, xi: Tensor) -> Tensor: ...
    def riemannian_gradient(self, egrad: Tensor) -> Tensor: ...
    def project(self, xi: Tensor, rho: float) -> Tensor: ...
    def random_tangent_vector(self, generator: torch.Generator) -> Tensor: ...


@dataclass
class SolveResult:
    """Outcome of one batch: the largest loss found, the clean loss, and the loss of every evaluated iterate."""

    max_loss: float
    clean_loss: float
    losses: list[float] = field(default_factory=list)
    best_norm: float = 0.0

    @property
    def sharpness(self) -> float:
        return self.max_loss - self.clean_loss


def as23_checkpoints(n_iters: int) -> list[int]:
    """AS23's step-size checkpoints (``[5, 9, 12, 15, 16, 18, 19, 20]`` for 20 iterations)."""
    p = [0.0, 0.22]
    w = [0, math.ceil(n_iters * 0.22)]
    while w[-1] < n_iters and w[-1] != w[-2]:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        w.append(math.ceil(p[-1] * n_iters))
    return w[1:]


class _StepSchedule:
    """Croce & Hein's halving rule at the checkpoints, with AS23's conditions (spec §4.2 d)."""

    def __init__(self, eta: float, steps: int, min_update_ratio: float, clean_loss: float) -> None:
        self.eta = eta
        self.checkpoints = set(as23_checkpoints(steps))
        self.min_update_ratio = min_update_ratio
        self.prev_eta, self.prev_best, self.prev_checkpoint, self.n_updates = eta, clean_loss, 0, 0

    def halve(self, k: int, best_loss: float) -> bool:
        """Record iteration ``k`` and say whether to halve the step and restart from the best point."""
        if k not in self.checkpoints:
            return False
        cond1 = self.n_updates < self.min_update_ratio * (k - self.prev_checkpoint)
        cond2 = self.prev_eta == self.eta and self.prev_best == best_loss
        self.prev_eta, self.prev_best, self.prev_checkpoint, self.n_updates = self.eta, best_loss, k, 0
        if cond1 or cond2:
            self.eta *= 0.5
            return True
        return False


def apgd(
    space: Space,
    objective: Objective,
    *,
    rho: float,
    steps: int = 20,
    momentum: float = 0.75,
    step_normalization: StepNormalization = "riemannian",
    min_update_ratio: float = 0.75,
    on_step: Callable[[int, float], None] | None = None,
) -> SolveResult:
    """Worst case ``max_{xi in S} L(Exp(w0; xi)) - L(w0)`` by Auto-PGD (spec §4.2), zero init, ``eta0 = 2 rho``.

    ``steps + 1`` forward passes and ``steps`` backward passes in all. With ``step_normalization="riemannian"``
    every quantity is g-invariant, so the iterates are equivariant under the model's symmetries."""
    xi = xi_prev = space.zero()
    clean_loss, egrad = objective(xi, True)
    best_loss, best_xi, best_egrad = clean_loss, xi, egrad
    schedule = _StepSchedule(2.0 * rho, steps, min_update_ratio, clean_loss)
    losses = [clean_loss]
    for k in range(steps):
        direction = space.riemannian_gradient(egrad)
        if step_normalization == "riemannian":
            direction = direction / (float(space.norm(direction)) + 1e-12)
        elif step_normalization == "euclidean":
            direction = direction / (float(egrad.double().norm()) + 1e-12)
        z = space.project(xi + schedule.eta * direction, rho)
        xi_new = z if k == 0 else space.project(xi + momentum * (z - xi) + (1 - momentum) * (xi - xi_prev), rho)
        xi_prev, xi = xi, xi_new
        loss, egrad = objective(xi, k < steps - 1)
        losses.append(loss)
        if loss > best_loss:
            best_loss, best_xi, best_egrad = loss, xi, egrad
            schedule.n_updates += 1
        if schedule.halve(k, best_loss):
            xi = xi_prev = best_xi
            egrad = best_egrad
        if on_step is not None:
            on_step(k, best_loss - clean_loss)
    return SolveResult(best_loss, clean_loss, losses, float(space.norm(best_xi)))


def _ellipsoid_projection(delta: Tensor, inv_scale: Tensor, rho: float) -> Tensor:
    """AS23's Euclidean projection onto ``||delta / |w| || <= rho`` by its own bisection on lambda (spec §5.1)."""

    def weighted_norm(d: Tensor) -> float:
        return float((d * inv_scale).double().norm())

    if weighted_norm(delta) <= rho:
        return delta
    lmbd, min_lmbd, max_lmbd, max_limit = 0.1, 0.0, 10.0, 10.0
    tmp, new_norm = delta, weighted_norm(delta)
    c_sq = inv_scale.square()
    while abs(new_norm - rho) > 1e-5:
        tmp = delta / (1 + 2 * lmbd * c_sq)
        new_norm = weighted_norm(tmp)
        if new_norm > rho:
            lmbd, min_lmbd = (lmbd + max_lmbd) / 2, lmbd
        else:
            lmbd, max_lmbd = (min_lmbd + lmbd) / 2, lmbd
        if max_limit - max_lmbd < 1e-2:
            max_limit, max_lmbd = max_limit * 2, max_lmbd * 2
    return tmp


def apgd_as23(
    scale: Tensor,
    objective: Objective,
    *,
    rho: float,
    steps: int = 20,
    momentum: float = 0.75,
    min_update_ratio: float = 0.75,
    on_step: Callable[[int, float], None] | None = None,
) -> SolveResult:
    """AS23's ``m_apgd_l2`` adaptive worst case, quirks included (spec §5.1).

    ``scale`` is ``|w|`` (zero on frozen coordinates). Faithful to the reference: the step is ``grad * |w|`` over the
    global Euclidean gradient norm, Euclidean projection onto the ellipsoid by bisection, momentum
    ``0.75 P(z) + 0.25 delta_prev`` without re-projection, an extra no-grad forward per step for the loss, and on halving
    only the evaluation point (the "model") is reset to the best point, not ``delta``."""
    inv_scale = torch.where(scale > 0, 1.0 / torch.where(scale > 0, scale, torch.ones_like(scale)), 0.0)
    delta = prev_delta = torch.zeros_like(scale)
    point = delta  # where the next gradient is taken (AS23's model state)
    clean_loss, _ = objective(delta, False)
    best_loss, best_point = clean_loss, delta
    schedule = _StepSchedule(2.0 * rho, steps, min_update_ratio, clean_loss)
    losses = [clean_loss]
    for k in range(steps):
        _, egrad = objective(point, True)
        backup = delta
        step = schedule.eta / (float(egrad.double().norm()) + 1e-12) * egrad * scale
        delta = _ellipsoid_projection(delta + step, inv_scale, rho)
        delta = momentum * delta + (1 - momentum) * prev_delta
        prev_delta = backup
        point = delta
        loss, _ = objective(point, False)
        losses.append(loss)
        if loss > best_loss:
            best_loss, best_point = loss, point
            schedule.n_updates += 1
        if schedule.halve(k, best_loss):
            point = best_point
        if on_step is not None:
            on_step(k, best_loss - clean_loss)
    return SolveResult(best_loss, clean_loss, losses, float((best_point * inv_scale).double().norm()))


def average_case(
    space: Space,
    objective: Objective,
    *,
    rho: float,
    n_samples: int = 20,
    generator: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
) -> SolveResult:
    """Average case ``E_xi L(Exp(w0; xi)) - L(w0)`` with ``xi = rho * horizontal(z)``, ``z`` metric-isotropic (§3.2)."""
    clean_loss, _ = objective(space.zero(), False)
    losses = []
    for s in range(n_samples):
        xi = rho * space.random_tangent_vector(generator)
        losses.append(objective(xi, False)[0])
        if on_step is not None:
            on_step(s, sum(losses) / len(losses) - clean_loss)
    return SolveResult(sum(losses) / n_samples, clean_loss, [clean_loss] + losses)
