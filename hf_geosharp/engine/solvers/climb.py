"""One start of Auto-PGD, step by step on the host: the reference the device climb (:mod:`.device_climb`) is
compared with, and the base both share (the record of losses, the starts, the kept gradient)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..checks import non_finite_loss
from .certificate import loss_resolution, relative_gap
from .interface import ObjectiveFn, Space, StepNormalization
from .pool import Pool
from .schedule import StepSchedule

#: Under ``steps="auto"`` a start stops when its best point's gap is this fraction of ``tol``. Where the loss rises
#: steeply outward, the gap is quadratic in the slope along the sphere, so a gap of ``tol`` can stop a start well below
#: the maximum of its own basin (a fine-tuned MiniLM at rho 0.2: 0.8743 at a gap of ``9.9e-4``, 0.8933 at ``7.6e-5``;
#: docs/method.md); the certificate itself stays at ``tol``.
START_STOP_FRACTION = 0.1
#: Under ``steps="auto"`` a start also stops only when ``rho`` times its slope along the sphere, relative to the value,
#: is at most ``START_STOP_FRACTION * tol / SLOPE_STOP_FRACTION``.
SLOPE_STOP_FRACTION = 0.03
#: How far from the best point found so far a third or later start begins, as a fraction of ``rho``.
NEAR_BEST = 0.5


@dataclass
class Best:
    """A start's best point: its pool row, loss, squared norm and relative Frank-Wolfe gap (NaN until known)."""

    row: Tensor
    loss: float
    sq: float
    gap: float = math.nan


@dataclass(frozen=True)
class Agreement:
    """The losses ``[low, high]`` at which a checking start (any start after the first, under ``steps="auto"``)
    agrees with the best value found so far: within ``tol`` of its sharpness (or the loss's resolution, if larger)
    of that value's loss, on either side. A checking start whose best point lies in the window stops as soon as it is
    stationary within ``tol``, the certificate's own test: two stationary starts then agree on the best value, one
    of them held to the stricter stop of a first start, and more steps would move the value by less than ``tol``.
    Outside the window a start runs to the stricter stop (a higher maximum, or a lower one, found)."""

    low: float
    high: float

    @classmethod
    def with_best(cls, best: Best, clean_loss: float, tol: float, dtype: str) -> Agreement:
        """The window around ``best`` (a start's best point) that the certificate counts as the same value."""
        margin = max(tol * abs(best.loss - clean_loss), loss_resolution(dtype, clean_loss, best.loss))
        return cls(best.loss - margin, best.loss + margin)

    def holds(self, loss: float) -> bool:
        """Whether ``loss`` lies in the window."""
        return self.low <= loss <= self.high


@dataclass
class _Iterates:
    """The climb's iterate ``xi`` and previous iterate (pool rows), ``||xi||^2``, ``||xi_prev||^2`` and
    ``<xi, xi_prev>`` (metric g), and the gradient at ``xi`` in the working row (None once consumed)."""

    xi: Tensor
    sq: float
    prev: Tensor
    sq_prev: float
    cross: float
    egrad: Tensor | None

    def restart(self, best: Best) -> None:
        """Continue from ``best`` (its gradient is then taken, or copied, when the next step needs it)."""
        if self.xi is not best.row:
            self.egrad = None
        self.xi = self.prev = best.row
        self.sq = self.sq_prev = self.cross = best.sq


@dataclass
class _Step:
    """A step's direction ``d`` (the working row), ``<d, d>``, ``<d, xi>``, ``<d, xi_prev>`` and step size ``c``."""

    d: Tensor
    sq_d: float
    d_xi: float
    d_prev: float
    c: float


class Climb:
    """Auto-PGD from one start at a time over a shared :class:`Pool`, step by step on the host (see
    :func:`~.apgd.apgd`)."""

    def __init__(self, space: Space, objective: ObjectiveFn, pool: Pool, work: Tensor, *, rho: float, momentum: float,
                 step_normalization: StepNormalization, min_update_ratio: float,
                 on_step: Callable[[int, float], None] | None, tol: float, clean_loss: float,
                 keep_best_gradient: bool, dtype: str = "float64") -> None:
        self.space, self.objective, self.pool, self.work = space, objective, pool, work
        self.rho, self.momentum, self.step_normalization = rho, momentum, step_normalization
        self.min_update_ratio, self.on_step, self.tol, self.clean_loss = min_update_ratio, on_step, tol, clean_loss
        self.losses = [clean_loss]
        self.best_loss = clean_loss
        self.keep_best_gradient = keep_best_gradient
        self.kept: tuple[Best, Tensor] | None = None  # a best point and a copy of its gradient
        self.aside: Tensor | None = None  # the best point found so far, for starts that begin near it
        self.dtype = dtype
        self.start_stop, self.slope_stop = START_STOP_FRACTION, SLOPE_STOP_FRACTION  # (read at construction)

    @property
    def steps_used(self) -> int:
        """Evaluated points after the clean one."""
        return len(self.losses) - 1

    def record(self, loss: float) -> None:
        """Record an evaluated point's loss (and report the best so far)."""
        self.losses.append(loss)
        self.best_loss = max(self.best_loss, loss)
        if self.on_step is not None:
            self.on_step(self.steps_used - 1, self.best_loss - self.clean_loss)

    def host_loss(self, value: Tensor | float) -> float:
        """A perturbed point's loss as a float (read from the device), refused where it is not finite."""
        loss = float(value)
        if not math.isfinite(loss):
            raise non_finite_loss(loss, self.rho)
        return loss

    def first(self, start: Tensor) -> tuple[float, Tensor]:
        """The loss and gradient at a start's first point (recorded; the gradient in the working row)."""
        value, egrad = self.objective(start, True, out=self.work)
        loss = self.host_loss(value)
        self.record(loss)
        return loss, egrad

    def gap(self, best: Best, sq_d: float, d_best: float) -> float:
        """The relative Frank-Wolfe gap at ``best`` from its direction's Gram entries."""
        return relative_gap(self.rho, sq_d, d_best, best.loss - self.clean_loss)

    def slope(self, best: Best, sq_d: float, d_best: float) -> float:
        """``rho`` times the slope along the sphere at ``best`` (the direction's component orthogonal to ``best``),
        relative to its value: first order in the distance to a maximum on the sphere, where the Frank-Wolfe gap is
        second order."""
        sharpness = best.loss - self.clean_loss
        tangential = sq_d - d_best * d_best / best.sq if best.sq > 0 else sq_d
        return self.rho * math.sqrt(max(tangential, 0.0)) / sharpness if sharpness > 0 else math.inf

    def stationary_enough(self, best: Best, slope: float, stalled: bool = False,
                          agreement: Agreement | None = None) -> bool:
        """Whether an auto start stops at ``best``: its gap and its ``slope`` are at most ``START_STOP_FRACTION`` of
        ``tol``, or, in loss units, that fraction of the loss's resolution. With ``stalled`` (the block before
        stalled, :meth:`stalled`), or where ``best`` lies in a checking start's ``agreement`` window, a gap within
        ``tol``, or within the resolution, is enough."""
        if agreement is not None and agreement.holds(best.loss):
            stalled = True
        start_stop, slope_stop = self.stop_fractions(stalled)
        measure = max(best.gap, slope * slope_stop)
        if measure <= self.tol * start_stop:
            return True
        sharpness = best.loss - self.clean_loss
        floor = loss_resolution(self.dtype, self.clean_loss, best.loss)
        return sharpness > 0 and measure * sharpness <= start_stop * floor

    def stop_fractions(self, stalled: bool) -> tuple[float, float]:
        """``(start_stop, slope_stop)`` of the stopping test: the certificate's own (gap within ``tol``, no slope
        bound) at the first step after a block that stalled, else the stricter ones."""
        return (1.0, 0.0) if stalled else (self.start_stop, self.slope_stop)

    def stalled(self, best_loss: float, block_start: float) -> bool:
        """Whether a block raised the start's best loss (``block_start`` before it) by at most
        ``START_STOP_FRACTION * tol`` of the value, or by the loss's resolution. Blocks double, so a block is as long
        as all of the start's steps before it: a climb that one cannot raise sits at its basin's maximum as far as it
        resolves it, and there the start stops on the certificate's own gap (:meth:`stationary_enough`) instead of
        spending the budget that a second start needs to check it."""
        sharpness = best_loss - self.clean_loss
        floor = loss_resolution(self.dtype, self.clean_loss, best_loss)
        return sharpness > 0 and best_loss - block_start <= max(self.start_stop * self.tol * sharpness, floor)

    def saving(self, best: Best) -> Tensor | None:
        """Where the step that consumes the gradient at ``best`` copies it, if gradients are kept and this one is
        not yet (None otherwise)."""
        if not self.keep_best_gradient or (self.kept is not None and self.kept[0] is best):
            return None
        self.kept = (best, self.kept[1] if self.kept is not None else self.space.empty())
        return self.kept[1]

    def gradient_at_best(self, best: Best) -> Tensor:
        """The gradient at ``best`` in the working row: the kept copy, or one more forward and backward."""
        if self.kept is not None and self.kept[0] is best:
            return self.work.copy_(self.kept[1])
        return self.objective(best.row, True, out=self.work)[1]

    def run(self, xi: Tensor, sq_xi: float, loss: float, egrad: Tensor | None, *, steps: int, budget: int,
            auto: bool, agreement: Agreement | None = None) -> Best:
        """Climb from ``xi`` (a feasible pool row of squared norm ``sq_xi`` and loss ``loss``; ``egrad`` its
        gradient in the working row, or None) for ``steps`` steps, or under ``auto`` until its best point is
        stationary or ``budget`` steps are spent (a checking start: or stationary within ``tol`` in its
        ``agreement`` window); the best point found, with its gap."""
        it = _Iterates(xi, sq_xi, xi, sq_xi, sq_xi, egrad)
        best = Best(xi, loss, sq_xi)
        schedule = StepSchedule(2.0 * self.rho, steps, self.min_update_ratio, loss)
        total, k, block_start, stalled = steps, 0, loss, False
        while k < total:
            step = self.direction(it, best, schedule.eta)
            if auto and it.xi is best.row and self.stationary_enough(best, self.slope(best, step.sq_d, step.d_xi),
                                                                     stalled, agreement):
                return best
            stalled = False
            self.advance(it, step, best, k)
            value, it.egrad = self.objective(it.xi, auto or k < total - 1, out=self.work)
            loss = self.host_loss(value)
            self.record(loss)
            if loss > best.loss:
                best = Best(it.xi, loss, it.sq)
                schedule.n_updates += 1
            if schedule.halve(k, best.loss):
                it.restart(best)
            if auto and k == total - 1 and total < budget:  # one more block, from the best point
                stalled, block_start = self.stalled(best.loss, block_start), best.loss
                block = min(total, budget - total)
                schedule.extend(total, block, eta=2.0 * self.rho)
                total += block
                it.restart(best)
            k += 1
        if math.isnan(best.gap):  # the best point is the last iterate: one more gradient, there
            self.final_gap(it, best)
        return best

    def direction(self, it: _Iterates, best: Best, eta: float) -> _Step:
        """The step direction at ``it.xi`` into the working row (consuming the gradient there), its Gram entries,
        the step size ``c`` and, when ``it.xi`` is the best point, that point's gap."""
        if it.egrad is None:  # after a restart from an earlier best point
            it.egrad = self.gradient_at_best(best)
        c = eta
        if self.step_normalization == "euclidean":  # read before ascent_direction consumes the gradient
            c = eta / (math.sqrt(max(float(torch.dot(it.egrad, it.egrad)), 0.0)) + 1e-12)
        known = [row for row, sq in ((it.xi, it.sq), (it.prev, it.sq_prev)) if sq > 0]  # zero rows: zero products
        save = self.saving(best) if it.xi is best.row else None
        # the gradient at the best point is copied in the same pass (a space that keeps gradients can)
        extra = {} if save is None else {"save": save}
        d, sq_d, products = self.space.ascent_direction(it.egrad, self.pool.stacked(known), out=self.work, **extra)
        it.egrad = None
        product = dict(zip(sorted({self.pool.position(row) for row in known}), products))  # stacked() order
        d_xi = product.get(self.pool.position(it.xi), 0.0) if it.sq > 0 else 0.0
        d_prev = product.get(self.pool.position(it.prev), 0.0) if it.sq_prev > 0 else 0.0
        if it.xi is best.row:
            best.gap = self.gap(best, sq_d, d_xi)
        if self.step_normalization == "riemannian":
            c = eta / (math.sqrt(sq_d) + 1e-12)
        return _Step(d, sq_d, d_xi, d_prev, c)

    def advance(self, it: _Iterates, step: _Step, best: Best, k: int) -> None:
        """Write the next iterate ``P_S(xi + c d)`` (with momentum after step 0) into a free row, in one pass."""
        a, b, g, sq_new = _momentum_step(k, step.c, self.rho, self.momentum, it.sq, step.sq_d, it.sq_prev, step.d_xi,
                                         step.d_prev, it.cross)
        new_cross = a * it.sq + b * step.d_xi + g * it.cross  # <xi_new, xi>
        terms = [(a if it.sq > 0 else 0.0, it.xi), (b, step.d)]
        if it.prev is not it.xi and it.prev is not best.row:  # xi_prev is not needed again: combine over it
            new, scale = it.prev, g if it.sq_prev > 0 else 0.0
        else:
            new, scale = self.pool.free(it.xi, it.prev, best.row, self.work), 0.0
            terms.append((g if it.sq_prev > 0 else 0.0, it.prev))
        self.pool.combine_into(new, scale, terms)
        it.prev, it.xi = it.xi, new
        it.sq_prev, it.sq, it.cross = it.sq, sq_new, new_cross

    def final_gap(self, it: _Iterates, best: Best) -> None:
        """The gap of ``best`` from one more gradient there (the last iterate's, when it is the best point)."""
        egrad = it.egrad if it.egrad is not None and it.xi is best.row else self.gradient_at_best(best)
        _, sq_d, products = self.space.ascent_direction(egrad, self.pool.stacked([best.row] if best.sq > 0 else []),
                                                        out=self.work)
        best.gap = self.gap(best, sq_d, products[0] if best.sq > 0 else 0.0)

    def next_start(self, last: Best, overall: Best, kind: str, index: int,
                   generator: torch.Generator | None) -> tuple[Tensor, float]:
        """The first point of start ``index``, of ``kind`` (:data:`START_KINDS`), and its squared norm. The
        ``"antipode"`` (start 1) is that of the first start's best point (in its row), where a second maximum
        opposite the first is found. ``"near"`` starts begin near the best point found so far, displaced by
        ``NEAR_BEST * rho`` in a random direction and brought back into the ball: a start that reaches the best value
        again from elsewhere certifies it, where random points of the sphere climb to the nearer, lower maximum
        (docs/method.md, "Convergence"). ``"random"`` starts begin at a random point of the sphere (metric-isotropic).
        The best point waits in ``self.aside`` in bfloat16 (2 bytes per coordinate): a start's first point needs no
        more precision."""
        if kind == "antipode" and last.sq > 0:
            self.aside = last.row.to(torch.bfloat16)
            return last.row.neg_(), last.sq
        if kind == "random":
            z = self.space.random_tangent_vector(generator or torch.Generator().manual_seed(index))
            norm = float(self.space.norm(z))
            row = self.pool.free(self.work)
            row.copy_(z).mul_(self.rho / norm if norm > 0 else 0.0)
            return row, (self.rho if norm > 0 else 0.0) ** 2
        if overall is last and last.sq > 0:
            if self.aside is None:
                self.aside = last.row.to(torch.bfloat16)
            else:
                self.aside.copy_(last.row)
        z = self.space.random_tangent_vector(generator or torch.Generator().manual_seed(index))
        norm = float(self.space.norm(z))
        row = self.pool.free(self.work)
        row.copy_(z).mul_(NEAR_BEST * self.rho / norm if norm > 0 else 0.0)
        if overall.sq > 0 and self.aside is not None:
            row.add_(self.aside)
        sq = float(self.space.norm(row)) ** 2
        if sq > self.rho * self.rho:
            row.mul_(self.rho / math.sqrt(sq))
            sq = self.rho * self.rho
        return row, sq


def _momentum_step(
    k: int, c: float, rho: float, momentum: float, sq_xi: float, sq_d: float, sq_prev: float, d_xi: float,
    d_prev: float, cross: float,
) -> tuple[float, float, float, float]:
    """Coefficients ``(a, b, g)`` of the next iterate ``a xi + b d + g xi_prev`` and its squared norm, from the Gram
    matrix of ``(xi, d, xi_prev)``: ``z = P_S(xi + c d) = s1 (xi + c d)``, then (after the first step) the momentum
    point ``P_S(xi + m (z - xi) + (1 - m)(xi - xi_prev))``, a radial rescaling by ``s2``."""
    sq_z = max(sq_xi + 2 * c * d_xi + c * c * sq_d, 0.0)
    s1 = rho / math.sqrt(sq_z) if sq_z > rho * rho else 1.0
    if k == 0:
        return s1, s1 * c, 0.0, s1 * s1 * sq_z
    a, b, g = 2 * (1 - momentum) + momentum * s1, momentum * s1 * c, -(1 - momentum)
    sq_y = max(
        a * a * sq_xi + b * b * sq_d + g * g * sq_prev + 2 * (a * b * d_xi + a * g * cross + b * g * d_prev),
        0.0,
    )
    s2 = rho / math.sqrt(sq_y) if sq_y > rho * rho else 1.0
    return s2 * a, s2 * b, s2 * g, s2 * s2 * sq_y
