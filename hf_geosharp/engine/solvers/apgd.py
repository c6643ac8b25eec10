"""Auto-PGD, the worst-case solver over any perturbation space.

Auto-PGD as used by Andriushchenko et al. 2023 (AS23) and by the paper's Algorithm 1: step-size checkpoints,
halving, momentum and best-point tracking. :func:`apgd` is the clean version (one forward and one backward per step:
the loss of an iterate comes from the forward that gives its gradient);
:func:`hf_geosharp.engine.solvers.as23.apgd_as23` reproduces the reference code's quirks so that adaptive-sharpness
numbers are comparable with the literature. The solver talks to a space only through ``zero``, ``empty``,
``ascent_direction``, ``random_tangent_vector`` and ``norm`` (:class:`~.interface.Space`); the objective is a
callable ``(xi, need_grad, out=None) -> (loss, euclidean_grad | None)`` that writes the gradient into ``out`` when
given. Its parameter-sized vectors live in a fixed :class:`~.pool.Pool`; whether it also keeps its best point's
gradient is the caller's memory decision (:mod:`.memory`); what certifies its value is :mod:`.certificate`'s.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ..defaults import STEP_NORMALIZATION, STEPS
from .certificate import CONVERGENCE_TOL, SolveResult, loss_resolution, next_start_kind, relative_gap
from .interface import ObjectiveFn, Space, StepNormalization
from .memory import GradientRule, saved_activation_bytes
from .pool import Pool

#: Default step budget of ``steps="auto"`` (all starts together).
AUTO_MAX_STEPS = 640
#: The most starts ``steps="auto"`` makes: from zero, from the antipode of the best point, then near the best point.
#: Where maxima lie close together, starts near the best point climb a ladder before two agree (on a fine-tuned MiniLM
#: at rho 0.2: 0.0958 from zero, then 0.0961, 0.0962, 0.0962); four starts left 3 of 176 such numbers uncertified
#: (docs/method.md).
AUTO_MAX_STARTS = 8
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
#: Steps of a start's first block under ``steps="auto"`` (the step-size checkpoints follow its length).
AUTO_BLOCK = 20


def as23_checkpoints(n_iters: int) -> list[int]:
    """AS23's step-size checkpoints (``[5, 9, 12, 15, 16, 18, 19, 20]`` for 20 iterations)."""
    p = [0.0, 0.22]
    w = [0, math.ceil(n_iters * 0.22)]
    while w[-1] < n_iters and w[-1] != w[-2]:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        w.append(math.ceil(p[-1] * n_iters))
    return w[1:]


class StepSchedule:
    """Croce & Hein's halving rule at the checkpoints, with AS23's conditions."""

    def __init__(self, eta: float, steps: int, min_update_ratio: float, clean_loss: float) -> None:
        self.eta = eta
        self.checkpoints = set(as23_checkpoints(steps))
        self.min_update_ratio = min_update_ratio
        self.prev_eta, self.prev_best, self.prev_checkpoint, self.n_updates = eta, clean_loss, 0, 0

    def extend(self, start: int, block: int, eta: float | None = None) -> None:
        """Continue for ``block`` more iterations after ``start``, with AS23's checkpoints of a ``block``-step run
        (and the step size back at ``eta`` when given: a small step cannot climb away from a slow region)."""
        self.checkpoints |= {start + c for c in as23_checkpoints(block)}
        if eta is not None:
            self.eta = self.prev_eta = eta

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
    objective: ObjectiveFn,
    *,
    rho: float,
    steps: int = STEPS,
    momentum: float = 0.75,
    step_normalization: StepNormalization = STEP_NORMALIZATION,
    min_update_ratio: float = 0.75,
    on_step: Callable[[int, float], None] | None = None,
    max_steps: int | None = None,
    tol: float = CONVERGENCE_TOL,
    generator: torch.Generator | None = None,
    max_starts: int = AUTO_MAX_STARTS,
    keep_best_gradient: bool | GradientRule = False,
    keep_best_point: bool = False,
    loss_dtype: str | None = None,
) -> SolveResult:
    """Worst case ``max_{xi in S} L(Exp(w0; xi)) - L(w0)`` by Auto-PGD, zero init, ``eta0 = 2 rho``.

    With a fixed ``steps`` (``max_steps=None``): one start, ``steps + 1`` forward passes and ``steps`` backward
    passes, plus one forward and backward at the end when the best point is the last iterate (its Frank-Wolfe gap
    needs its gradient), and, unless the best point's gradient is kept, one for each halving that restarts from a
    best point other than the current iterate. ``keep_best_gradient`` says whether it is: a bool, or the caller's
    memory rule (:func:`~.memory.gradient_rule`), asked once with the clean point's activation bytes; the number is
    the same bits either way. With ``max_steps`` (``steps="auto"``) a start stops as soon as its best point is
    stationary within ``START_STOP_FRACTION * tol`` (the gap is free at every step: it comes from the step's own
    direction), continuing in blocks of doubling length (each with AS23's checkpoints) while it is not; then further
    starts (the antipode of the best point, then points near the best point found so far, up to ``max_starts``) run
    the same way until two stationary starts agree on the best value within ``tol``, all within ``max_steps`` steps.
    With ``step_normalization="riemannian"`` every quantity is g-invariant, so the iterates are equivariant under
    the model's symmetries.

    How a step stays cheap: the direction ``d`` (the projected Riemannian gradient) and the iterates ``xi``,
    ``xi_prev`` are horizontal, so ``z = P_S(xi + c d)`` and the momentum point ``P_S(a xi + b d + c xi_prev)`` are
    radial rescalings of combinations of the three. Their norms follow from the Gram matrix of ``(xi, d, xi_prev)``:
    the row of ``d`` comes with it from ``space.ascent_direction`` (one pass over the gradient) and the rest is carried
    over from the previous step. The new iterate is then written by one ``addmv``.

    Memory: four parameter-sized buffers: the iterates ``xi`` and ``xi_prev``, the best point, and one working
    buffer, which the objective fills with the perturbed weights and then with the gradient, in which the direction
    ``d`` is computed over that gradient, and from which the new iterate is combined; a fifth, outside the pool,
    when the best point's gradient is kept (copied by the direction pass that consumes it, copied back at a restart
    from it). Nothing parameter-sized is allocated per step (a further start draws one vector, and keeps the best
    point aside in bfloat16 for the next). ``best_norm`` comes
    from the same bookkeeping. The horizontal projection is exactly g-orthogonal (also with ``epsilon > 0``), so
    these identities hold exactly.

    With ``keep_best_point`` the result carries the best point (``SolveResult.best_point``): the pool row that holds
    it, or, when a later start reused that row, a copy made before that start (one more vector, under
    ``steps="auto"`` only). It changes no number. ``loss_dtype`` names the floating type the loss is computed in
    (the model's lowest precision, :func:`~.certificate.loss_dtype`; default the vectors' dtype), which sets the
    certificate's resolution.
    """
    auto = max_steps is not None
    pool = Pool(space.empty(), 4)
    xi = pool.free()
    work = pool.free(xi)
    xi.zero_()
    rule = keep_best_gradient if callable(keep_best_gradient) else None
    with saved_activation_bytes() if rule is not None else contextlib.nullcontext([0]) as activations:
        clean_loss, egrad = objective(xi, True, out=work)
    keep = rule(work, activations[0]) if rule is not None else bool(keep_best_gradient)
    dtype = loss_dtype or str(work.dtype).removeprefix("torch.")
    climb = _Climb(space, objective, pool, work, rho=rho, momentum=momentum, step_normalization=step_normalization,
                   min_update_ratio=min_update_ratio, on_step=on_step, tol=tol, clean_loss=clean_loss,
                   keep_best_gradient=keep, dtype=dtype)
    budget = max_steps if auto else steps
    best = climb.run(xi, 0.0, clean_loss, egrad, steps=min(steps, budget), budget=budget, auto=auto)
    starts = _Starts(climb, best, clean_loss, dtype)
    if auto:
        starts.more(budget, max_starts, generator, keep_best_point)
    overall = starts.overall
    point = None if not keep_best_point else overall.row if overall is starts.last else starts.kept_point
    return SolveResult(overall.loss, clean_loss, climb.losses, math.sqrt(overall.sq), overall.gap, starts.values,
                       starts.gaps, starts.kinds if auto else [], dtype, best_point=point)


class _Starts:
    """The starts of one solve: each one's best value, gap and kind, the best over all, and (``keep_best_point``)
    a copy of it where a later start reuses its row."""

    def __init__(self, climb: _Climb, first: _Best, clean_loss: float, dtype: str) -> None:
        self.climb, self.clean_loss, self.dtype = climb, clean_loss, dtype
        self.values, self.gaps, self.kinds = [first.loss - clean_loss], [first.gap], ["zero"]
        self.overall = self.last = first
        self.kept_point: Tensor | None = None

    def more(self, budget: int, max_starts: int, generator: torch.Generator | None, keep_best_point: bool) -> None:
        """Further starts of ``steps="auto"``, until the certificate needs none or ``budget`` or ``max_starts`` runs
        out."""
        climb = self.climb
        while len(self.values) < max_starts and climb.steps_used < budget:
            kind = next_start_kind(SolveResult(self.overall.loss, self.clean_loss, climb.losses, 0.0, self.overall.gap,
                                               self.values, self.gaps, self.kinds, self.dtype), climb.tol)
            if kind is None:
                break  # certified, refuted by a random start, or the best start is not stationary (out of budget)
            if keep_best_point and self.overall is self.last:  # the next start reuses this row
                self.kept_point = climb.space.empty() if self.kept_point is None else self.kept_point
                self.kept_point.copy_(self.overall.row)
            start, sq = climb.next_start(self.last, self.overall, kind, len(self.values), generator)
            loss, egrad = climb.objective(start, True, out=climb.work)
            climb.record(loss)
            best = climb.run(start, sq, loss, egrad, steps=min(AUTO_BLOCK, budget - climb.steps_used),
                             budget=budget - climb.steps_used, auto=True)
            self.values.append(best.loss - self.clean_loss)
            self.gaps.append(best.gap)
            self.kinds.append(kind)
            self.last = best
            if best.loss > self.overall.loss:
                self.overall = best




@dataclass
class _Best:
    """A start's best point: its pool row, loss, squared norm and relative Frank-Wolfe gap (NaN until known)."""

    row: Tensor
    loss: float
    sq: float
    gap: float = math.nan


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

    def restart(self, best: _Best) -> None:
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


class _Climb:
    """Auto-PGD from one start at a time over a shared :class:`Pool` (see :func:`apgd`)."""

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
        self.kept: tuple[_Best, Tensor] | None = None  # a best point and a copy of its gradient
        self.aside: Tensor | None = None  # the best point found so far, for starts that begin near it
        self.dtype = dtype

    @property
    def steps_used(self) -> int:
        return len(self.losses) - 1

    def record(self, loss: float) -> None:
        self.losses.append(loss)
        self.best_loss = max(self.best_loss, loss)
        if self.on_step is not None:
            self.on_step(self.steps_used - 1, self.best_loss - self.clean_loss)

    def gap(self, best: _Best, sq_d: float, d_best: float) -> float:
        return relative_gap(self.rho, sq_d, d_best, best.loss - self.clean_loss)

    def slope(self, best: _Best, sq_d: float, d_best: float) -> float:
        """``rho`` times the slope along the sphere at ``best`` (the direction's component orthogonal to ``best``),
        relative to its value: first order in the distance to a maximum on the sphere, where the Frank-Wolfe gap is
        second order."""
        sharpness = best.loss - self.clean_loss
        tangential = sq_d - d_best * d_best / best.sq if best.sq > 0 else sq_d
        return self.rho * math.sqrt(max(tangential, 0.0)) / sharpness if sharpness > 0 else math.inf

    def stationary_enough(self, best: _Best, slope: float) -> bool:
        """Whether an auto start stops at ``best``: its gap and its ``slope`` are at most ``START_STOP_FRACTION`` of
        ``tol``, or, in loss units, that fraction of the loss's resolution."""
        measure = max(best.gap, slope * SLOPE_STOP_FRACTION)
        if measure <= self.tol * START_STOP_FRACTION:
            return True
        sharpness = best.loss - self.clean_loss
        floor = loss_resolution(self.dtype, self.clean_loss, best.loss)
        return sharpness > 0 and measure * sharpness <= START_STOP_FRACTION * floor

    def saving(self, best: _Best) -> Tensor | None:
        """Where the step that consumes the gradient at ``best`` copies it, if gradients are kept and this one is
        not yet (None otherwise)."""
        if not self.keep_best_gradient or (self.kept is not None and self.kept[0] is best):
            return None
        self.kept = (best, self.kept[1] if self.kept is not None else self.space.empty())
        return self.kept[1]

    def gradient_at_best(self, best: _Best) -> Tensor:
        """The gradient at ``best`` in the working row: the kept copy, or one more forward and backward."""
        if self.kept is not None and self.kept[0] is best:
            return self.work.copy_(self.kept[1])
        return self.objective(best.row, True, out=self.work)[1]

    def run(self, xi: Tensor, sq_xi: float, loss: float, egrad: Tensor | None, *, steps: int, budget: int,
            auto: bool) -> _Best:
        """Climb from ``xi`` (a feasible pool row of squared norm ``sq_xi`` and loss ``loss``; ``egrad`` its
        gradient in the working row, or None) for ``steps`` steps, or under ``auto`` until its best point is
        stationary or ``budget`` steps are spent; the best point found, with its gap."""
        it = _Iterates(xi, sq_xi, xi, sq_xi, sq_xi, egrad)
        best = _Best(xi, loss, sq_xi)
        schedule = StepSchedule(2.0 * self.rho, steps, self.min_update_ratio, loss)
        total, k = steps, 0
        while k < total:
            step = self.direction(it, best, schedule.eta)
            if auto and it.xi is best.row and self.stationary_enough(best, self.slope(best, step.sq_d, step.d_xi)):
                return best
            self.advance(it, step, best, k)
            loss, it.egrad = self.objective(it.xi, auto or k < total - 1, out=self.work)
            self.record(loss)
            if loss > best.loss:
                best = _Best(it.xi, loss, it.sq)
                schedule.n_updates += 1
            if schedule.halve(k, best.loss):
                it.restart(best)
            if auto and k == total - 1 and total < budget:  # one more block, from the best point
                block = min(total, budget - total)
                schedule.extend(total, block, eta=2.0 * self.rho)
                total += block
                it.restart(best)
            k += 1
        if math.isnan(best.gap):  # the best point is the last iterate: one more gradient, there
            self.final_gap(it, best)
        return best

    def direction(self, it: _Iterates, best: _Best, eta: float) -> _Step:
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

    def advance(self, it: _Iterates, step: _Step, best: _Best, k: int) -> None:
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

    def final_gap(self, it: _Iterates, best: _Best) -> None:
        """The gap of ``best`` from one more gradient there (the last iterate's, when it is the best point)."""
        egrad = it.egrad if it.egrad is not None and it.xi is best.row else self.gradient_at_best(best)
        _, sq_d, products = self.space.ascent_direction(egrad, self.pool.stacked([best.row] if best.sq > 0 else []),
                                                        out=self.work)
        best.gap = self.gap(best, sq_d, products[0] if best.sq > 0 else 0.0)

    def next_start(self, last: _Best, overall: _Best, kind: str, index: int,
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

