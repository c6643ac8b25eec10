"""Solvers for worst-case and average-case sharpness over any perturbation space.

The worst case is Auto-PGD as used by Andriushchenko et al. 2023 (AS23) and by the paper's Algorithm 1:
step-size checkpoints, halving, momentum and best-point tracking. :func:`apgd` is the clean version
(one forward and one backward per step: the loss of an iterate comes from the forward that gives its gradient).
:func:`hf_geosharp.as23.apgd_as23` reproduces the reference code's quirks so that adaptive-sharpness numbers are
comparable with the literature. The solvers talk to a space only through ``zero``, ``empty``, ``ascent_direction``
and ``random_tangent_vector``; the objective is a callable
``(xi, need_grad, out=None) -> (loss, euclidean_grad | None)`` that writes the gradient into ``out`` when given.

Parameter-sized vectors (1e8 entries for BERT-base) are the cost that is not forward or backward, so the solvers keep
them in small fixed pools (:class:`Pool`) and update them in place: a step allocates nothing parameter-sized, which
on a CPU also spares the page faults of fresh large allocations.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor

Objective = Callable[..., tuple[float, "Tensor | None"]]
StepNormalization = Literal["riemannian", "euclidean", "none"]


class Space(Protocol):
    def zero(self) -> Tensor: ...
    def empty(self) -> Tensor: ...
    def ascent_direction(self, egrad: Tensor, vectors: Tensor, out: Tensor) -> tuple[Tensor, float, list[float]]: ...
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

    @property
    def steps_used(self) -> int:
        return len(self.losses) - 1

    @property
    def convergence_gain(self) -> float:
        """Relative gain of the best value over the last quarter of the steps (worst case); 0 when nothing moved."""
        return convergence_gain(self.losses)


def convergence_gain(losses: list[float]) -> float:
    """``(best(T) - best(T - ceil(T/4))) / |best(T) - clean|`` for the losses ``[clean, step 1, ..., step T]``."""
    steps = len(losses) - 1
    if steps < 1:
        return 0.0
    clean, best, running = losses[0], [], losses[0]
    for loss in losses:
        running = max(running, loss)
        best.append(running - clean)
    final, earlier = best[-1], best[steps - math.ceil(steps / 4)]
    return (final - earlier) / abs(final) if final != 0 else 0.0


#: Default relative tolerance of the convergence check (and of ``steps="auto"``).
CONVERGENCE_TOL = 1e-3
#: Default step budget of ``steps="auto"``.
AUTO_MAX_STEPS = 640


class Pool:
    """``size`` parameter-sized buffers, the rows of one matrix, handed out by identity so that no live vector is
    overwritten.

    One matrix rather than separate tensors, so that the inner products of a gradient with several buffers are one
    matrix-vector product and a combination of buffers is one ``addmv``: each reads every row once. Rows are never
    initialised (a row is written before it is read), so untouched ones cost no memory."""

    def __init__(self, like: Tensor, size: int) -> None:
        self.matrix = like.new_empty((size, like.numel()))
        self.rows = list(self.matrix.unbind(0))

    def free(self, *live: Tensor | None) -> Tensor:
        for row in self.rows:
            if all(row is not x for x in live):
                return row
        raise RuntimeError(f"all {len(self.rows)} solver buffers are live; this is a bug in the solver")

    def position(self, row: Tensor) -> int:
        return next(i for i, r in enumerate(self.rows) if r is row)

    def stacked(self, rows: list[Tensor]) -> Tensor:
        """Up to two distinct rows, in pool order, as one ``[r, N]`` matrix: a strided view of the pool, no copy."""
        positions = sorted({self.position(row) for row in rows})
        if not positions:
            return self.matrix[:0]
        if len(positions) > 2:
            raise ValueError("stacked() takes at most two distinct rows")
        step = positions[1] - positions[0] if len(positions) == 2 else 1
        return self.matrix[positions[0]::step][: len(positions)]

    def combine_into(self, out: Tensor, scale: float, terms: list[tuple[float, Tensor]]) -> None:
        """``out <- scale * out + sum coef * row`` in place, in one pass (``addmv``); ``out`` must not be a term."""
        merged: dict[int, float] = {}
        for coef, row in terms:
            i = self.position(row)
            merged[i] = merged.get(i, 0.0) + coef
        merged = {i: c for i, c in merged.items() if c != 0.0}
        if not merged:
            out.zero_() if scale == 0 else out.mul_(scale)  # (0 * an uninitialised row could be NaN)
            return
        order = sorted(merged)  # the order of stacked()'s rows
        first, rest = order[:2], order[2:]  # stacked() views at most two rows; a third is added in another pass
        rows = self.stacked([self.rows[i] for i in first])
        coefs = torch.tensor([merged[i] for i in first], dtype=out.dtype, device=out.device)
        out.addmv_(rows.t(), coefs, beta=scale)
        for i in rest:
            out.add_(self.rows[i], alpha=merged[i])


def next_block(total: int, max_steps: int | None, tol: float, losses: list[float]) -> int:
    """How many steps to add after ``total`` under ``steps="auto"`` (0: stop): as many again as so far (doubling),
    while the best value still gains more than ``tol`` over the last quarter and the budget allows."""
    if max_steps is None or total >= max_steps or convergence_gain(losses) <= tol:
        return 0
    return min(total, max_steps - total)


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

    def extend(self, start: int, block: int) -> None:
        """Continue for ``block`` more iterations after ``start``, with AS23's checkpoints of a ``block``-step run."""
        self.checkpoints |= {start + c for c in as23_checkpoints(block)}

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
    max_steps: int | None = None,
    tol: float = CONVERGENCE_TOL,
) -> SolveResult:
    """Worst case ``max_{xi in S} L(Exp(w0; xi)) - L(w0)`` by Auto-PGD, zero init, ``eta0 = 2 rho``.

    ``steps + 1`` forward passes and ``steps`` backward passes, plus one forward and backward for each halving that
    restarts from a best point other than the current iterate (the best point's gradient is recomputed rather than
    kept). With ``max_steps`` (``steps="auto"``), after the ``steps``-step block the run continues from where it is,
    in blocks as long as everything so far (each with AS23's checkpoints), while the best value gains more than
    ``tol`` over the last quarter of the steps, up to ``max_steps``. With ``step_normalization="riemannian"`` every
    quantity is g-invariant, so the iterates are equivariant under the model's symmetries.

    How a step stays cheap: the direction ``d`` (the projected Riemannian gradient) and the iterates ``xi``,
    ``xi_prev`` are horizontal, so ``z = P_S(xi + c d)`` and the momentum point ``P_S(a xi + b d + c xi_prev)`` are
    radial rescalings of combinations of the three. Their norms follow from the Gram matrix of ``(xi, d, xi_prev)``:
    the row of ``d`` comes with it from ``space.ascent_direction`` (one pass over the gradient) and the rest is carried
    over from the previous step. The new iterate is then written by one ``addmv``.

    Memory: four parameter-sized buffers in all: the iterates ``xi`` and ``xi_prev``, the best point, and one
    working buffer, which the objective fills with the perturbed weights and then with the gradient, in which the
    direction ``d`` is computed over that gradient, and from which the new iterate is combined. Nothing
    parameter-sized is allocated per step. ``best_norm`` comes from the same bookkeeping. The horizontal projection is
    exactly g-orthogonal (also with ``epsilon > 0``), so these identities hold exactly.
    """
    pool = Pool(space.empty(), 4)
    xi = xi_prev = best_xi = pool.free()
    work = pool.free(xi)
    xi.zero_()
    sq_xi = sq_prev = cross = best_sq = 0.0  # ||xi||^2, ||xi_prev||^2, <xi, xi_prev>, ||best_xi||^2 (metric g)
    clean_loss, egrad = objective(xi, True, out=work)
    best_loss = clean_loss
    schedule = StepSchedule(2.0 * rho, steps, min_update_ratio, clean_loss)
    losses = [clean_loss]
    total, k = steps, -1
    while k + 1 < total:
        k += 1
        if egrad is None:  # after a restart from an earlier best point, or a block's last (gradient-free) step
            _, egrad = objective(xi, True, out=work)
        if step_normalization == "euclidean":  # read before ascent_direction consumes the gradient
            c = schedule.eta / (math.sqrt(max(float(torch.dot(egrad, egrad)), 0.0)) + 1e-12)
        known = [row for row, sq in ((xi, sq_xi), (xi_prev, sq_prev)) if sq > 0]  # zero rows have zero products
        d, sq_d, products = space.ascent_direction(egrad, pool.stacked(known), out=work)
        egrad = None
        product = dict(zip(sorted({pool.position(row) for row in known}), products))  # stacked() order
        d_xi = product.get(pool.position(xi), 0.0) if sq_xi > 0 else 0.0
        d_prev = product.get(pool.position(xi_prev), 0.0) if sq_prev > 0 else 0.0
        if step_normalization == "riemannian":
            c = schedule.eta / (math.sqrt(sq_d) + 1e-12)
        elif step_normalization == "none":
            c = schedule.eta
        a, b, g, sq_new = _momentum_step(k, c, rho, momentum, sq_xi, sq_d, sq_prev, d_xi, d_prev, cross)
        new_cross = a * sq_xi + b * d_xi + g * cross  # <xi_new, xi>
        terms = [(a if sq_xi > 0 else 0.0, xi), (b, d)]
        if xi_prev is not xi and xi_prev is not best_xi:  # xi_prev is not needed again: combine over it
            new, scale = xi_prev, g if sq_prev > 0 else 0.0
        else:
            new, scale = pool.free(xi, xi_prev, best_xi, work), 0.0
            terms.append((g if sq_prev > 0 else 0.0, xi_prev))
        pool.combine_into(new, scale, terms)
        xi_prev, xi = xi, new
        sq_prev, sq_xi, cross = sq_xi, sq_new, new_cross
        need_grad = k < total - 1
        loss, egrad = objective(xi, need_grad, out=work)
        losses.append(loss)
        if loss > best_loss:
            best_loss, best_xi, best_sq = loss, xi, sq_xi
            schedule.n_updates += 1
        if schedule.halve(k, best_loss):
            if xi is not best_xi:
                egrad = None  # recomputed at the best point when the next step needs it
            xi = xi_prev = best_xi
            sq_xi = sq_prev = cross = best_sq
        if on_step is not None:
            on_step(k, best_loss - clean_loss)
        if k == total - 1 and (block := next_block(total, max_steps, tol, losses)):
            schedule.extend(total, block)
            total += block
    return SolveResult(best_loss, clean_loss, losses, math.sqrt(best_sq))


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


def average_case(
    space: Space,
    objective: Objective,
    *,
    rho: float,
    n_samples: int = 20,
    generator: torch.Generator,
    on_step: Callable[[int, float], None] | None = None,
) -> SolveResult:
    """Average case ``E_xi L(Exp(w0; xi)) - L(w0)`` with ``xi = rho * horizontal(z)``, ``z`` metric-isotropic
    (docs/spec.md §3.2)."""
    clean_loss, _ = objective(space.zero(), False)
    losses = []
    for s in range(n_samples):
        xi = rho * space.random_tangent_vector(generator)
        losses.append(objective(xi, False)[0])
        if on_step is not None:
            on_step(s, sum(losses) / len(losses) - clean_loss)
    return SolveResult(sum(losses) / n_samples, clean_loss, [clean_loss] + losses)
