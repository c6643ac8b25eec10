"""Solvers for worst-case and average-case sharpness over any perturbation space.

The worst case is Auto-PGD as used by Andriushchenko et al. 2023 (AS23) and by the paper's Algorithm 1:
step-size checkpoints, halving, momentum and best-point tracking. :func:`apgd` is the clean version
(one forward and one backward per step: the loss of an iterate comes from the forward that gives its gradient).
:func:`hf_geosharp.engine.solvers.as23.apgd_as23` reproduces the reference code's quirks so that adaptive-sharpness
numbers are comparable with the literature. The solvers talk to a space only through ``zero``, ``empty``,
``ascent_direction``, ``random_tangent_vector`` and ``norm``; the objective is a callable
``(xi, need_grad, out=None) -> (loss, euclidean_grad | None)`` that writes the gradient into ``out`` when given.

Parameter-sized vectors (1e8 entries for BERT-base) are the cost that is not forward or backward, so the solvers keep
them in small fixed pools (:class:`Pool`) and update them in place: a step allocates nothing parameter-sized, which
on a CPU also spares the page faults of fresh large allocations. Whether :func:`apgd` also keeps its best point's
gradient (a fifth vector, which spares a forward and backward at every restart from that point) is decided by
:func:`keeps_best_gradient` from the solve's :class:`Footprint`; for that an objective that evaluates a model names it
in a ``model`` attribute, and the space reports ``held_bytes`` and sums over ranks with ``total``.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Literal, Protocol

import torch
from torch import Tensor, nn

from ..defaults import N_SAMPLES, STEP_NORMALIZATION, STEPS

logger = logging.getLogger(__name__)

#: What the solvers call: ``objective(xi, need_grad, out=None) -> (loss, gradient or None)`` (the engine's is
#: :class:`hf_geosharp.engine.model_function.objective.Objective`).
ObjectiveFn = Callable[..., tuple[float, "Tensor | None"]]
StepNormalization = Literal["riemannian", "euclidean", "none"]


class Space(Protocol):
    """What the solvers ask of a perturbation space (``held_bytes`` and ``total`` only for the memory rule, when the
    objective names a model; ``ascent_direction``'s ``save`` only when the best point's gradient is kept)."""

    held_bytes: int

    def zero(self) -> Tensor:
        """A zero tangent vector (the clean point)."""

    def empty(self) -> Tensor:
        """An uninitialised vector of the space's length and dtype (a solver buffer)."""

    def ascent_direction(self, egrad: Tensor, vectors: Tensor, out: Tensor,
                         save: Tensor | None = None) -> tuple[Tensor, float, list[float]]:
        """The step direction from a Euclidean gradient, into ``out``, with its squared norm and its products with
        ``vectors``' rows (and a copy of ``egrad`` in ``save``)."""

    def random_tangent_vector(self, generator: torch.Generator) -> Tensor:
        """A random feasible direction (further starts of ``steps="auto"``)."""

    def norm(self, xi: Tensor) -> Tensor:
        """The metric norm of a tangent vector."""

    def total(self, values: Tensor) -> Tensor:
        """``values`` summed over the ranks of a sharded run."""


#: What a worst case's certificate says (:meth:`SolveResult.verdict`, ``SharpnessResult.certificate``).
CERTIFIED, AT_PRECISION, NOT_CERTIFIED = "certified", "certified_at_precision", "not_certified"


@dataclass
class SolveResult:
    """Outcome of one batch: the largest loss found, the clean loss, the loss of every evaluated point, and what
    certifies (or not) that the largest loss is a maximum (worst case; docs/method.md, "Convergence").

    ``gap`` is the relative Frank-Wolfe gap at the best point, ``(rho ||grad||_g - <grad, xi>_g) / sharpness``: zero
    exactly at the first-order stationary points of the ball's maximisation, and, where the loss is concave on the
    ball, an upper bound on ``(maximum - value) / value``. ``start_values`` and ``start_gaps`` are each start's best
    sharpness and its gap (``steps="auto"`` starts again from other points to check that no higher maximum is
    near), and ``start_kinds`` where each began (:data:`START_KINDS`). ``dtype`` is the floating type the loss is
    computed in (the model's lowest precision), which sets :attr:`resolution`."""

    max_loss: float
    clean_loss: float
    losses: list[float] = field(default_factory=list)
    best_norm: float = 0.0
    gap: float = math.nan
    start_values: list[float] = field(default_factory=list)
    start_gaps: list[float] = field(default_factory=list)
    start_kinds: list[str] = field(default_factory=list)
    dtype: str = "float64"
    #: The best point itself (a tangent vector of the space) when the solver was asked to keep it, else None.
    best_point: Tensor | None = field(default=None, repr=False, compare=False)

    @property
    def sharpness(self) -> float:
        """The largest loss found minus the clean loss."""
        return self.max_loss - self.clean_loss

    @property
    def steps_used(self) -> int:
        """Evaluated points after the clean one: solver steps, and the first point of each further start."""
        return len(self.losses) - 1

    @property
    def resolution(self) -> float:
        """The resolution of the loss in :attr:`dtype`: ``PRECISION_FACTOR * eps(dtype) * max(|clean|, |max|)``, in
        loss units. Two losses closer than this cannot be told apart (:func:`loss_resolution`)."""
        return loss_resolution(self.dtype, self.clean_loss, self.max_loss)

    def certificate(self, tol: float, starts: int) -> str | None:
        """``None`` when the best value is certified, at ``tol`` or at the loss's resolution (:meth:`verdict`), else
        why not, in words."""
        state, note = self.verdict(tol, starts)
        return None if state != NOT_CERTIFIED else note

    def verdict(self, tol: float, starts: int) -> tuple[str, str | None]:
        """What the best value is certified as, and a note: ``(CERTIFIED, None)`` when it is stationary within
        ``tol`` and, with ``starts >= 2``, reached again within ``tol`` by another stationary start (and no start
        from a random point found a higher maximum than two agreeing starts); ``(AT_PRECISION, what)`` when that
        holds only with the tolerances widened to the loss's :attr:`resolution` (a Frank-Wolfe gap, or a
        disagreement of starts, below what the loss's floating type can resolve); ``(NOT_CERTIFIED, why)`` else.
        Either certified state says that two starts agree on a stationary point: a maximum, not the largest."""
        floor = self.resolution
        gap_abs = self.gap * self.sharpness if self.sharpness > 0 else (0.0 if self.gap == 0 else math.inf)
        if not (self.gap <= tol or gap_abs <= floor):
            return NOT_CERTIFIED, f"not stationary (Frank-Wolfe gap {self.gap:.2%} of the value, tolerance {tol:.2%})"
        exact = self.gap <= tol
        if starts >= 2:
            agreed, exact_agreed, why = self._agreement(tol, floor)
            if why is not None:
                return NOT_CERTIFIED, why
            exact = exact and exact_agreed
        if exact:
            return CERTIFIED, None
        what = "two starts that agree and a Frank-Wolfe gap" if starts >= 2 else "a Frank-Wolfe gap"
        share = f", {floor / self.sharpness:.2%} of the value {self.sharpness:.4g}" if self.sharpness > 0 else ""
        return AT_PRECISION, (f"certified at the resolution of the loss in {self.dtype}: {what} within {floor:.2g} "
                              f"(= {PRECISION_FACTOR} eps |loss|{share}), not within tol {tol:.2%}")

    def _agreement(self, tol: float, floor: float) -> tuple[bool, bool, str | None]:
        """Whether two stationary starts agree on the best value (with the floor; within ``tol`` alone), or why
        not."""
        values, gaps = self.start_values, self.start_gaps
        kinds = self.start_kinds or ["climb"] * len(values)

        def stationary(v: float, g: float, widened: bool) -> bool:
            return g <= tol or (widened and g * max(v, 0.0) <= floor)

        climbs = [(v, g) for v, g, k in zip(values, gaps, kinds) if k != "random"]
        probes = [v for v, k in zip(values, kinds) if k == "random"]
        if probes and climbs:
            agreed = _agreed_value([v for v, _ in climbs], [g for _, g in climbs], tol, floor)
            if agreed is not None and max(probes) > agreed + max(tol * abs(agreed), floor):
                return False, False, (
                    f"two starts agreed on {agreed:.4g}, but a start from a random point of the sphere reached "
                    f"{max(probes):.4g}: this landscape has maxima that few starts reach, so the value is the "
                    "largest found, a lower bound")
        best = max(values) if values else -math.inf
        near = [v >= best - max(tol * abs(best), floor) and stationary(v, g, True) for v, g in zip(values, gaps)]
        if sum(near) < 2:
            if len(values) < 2:
                return False, False, "the step budget ran out before a second start could check the maximum"
            if sum(stationary(v, g, True) for v, g in zip(values, gaps)) < 2:
                return False, False, "the step budget ran out before a second start was stationary"
            found = ", ".join(f"{v:.4g}" for v in values)
            return False, False, f"{len(values)} starts reached different maxima ({found})"
        exact = sum(v >= best - tol * abs(best) and stationary(v, g, False) for v, g in zip(values, gaps)) >= 2
        finished = sum(k == "random" and stationary(v, g, True) for v, g, k in zip(values, gaps, kinds))
        if _multimodal(values, gaps, tol, floor) and finished < RANDOM_PROBES:
            return False, False, ("the starts found several maxima, and the step budget or max_starts ran out "
                                  "before two starts from random points could look for a higher one")
        return True, exact, None


def _agreed_value(values: list[float], gaps: list[float], tol: float, floor: float) -> float | None:
    """The largest value that two stationary starts among ``values`` agree on, or None."""
    ok = sorted((v for v, g in zip(values, gaps) if g <= tol or g * max(v, 0.0) <= floor), reverse=True)
    for a, b in zip(ok, ok[1:]):
        if b >= a - max(tol * abs(a), floor):
            return a
    return None


def _multimodal(values: list[float], gaps: list[float], tol: float, floor: float) -> bool:
    """Whether the starts found more than one maximum: a stationary start below the best by more than ``tol``."""
    best = max(values) if values else -math.inf
    return any((g <= tol or g * max(v, 0.0) <= floor) and v < best - max(tol * abs(best), floor)
               for v, g in zip(values, gaps))


#: Where a start of ``steps="auto"`` begins: at zero, at the antipode of the first start's best point, near the best
#: point found so far, or at a random point of the sphere (a probe, :data:`RANDOM_PROBES`).
START_KINDS = ("zero", "antipode", "near", "random")
#: The resolution of the loss, in units of ``eps(dtype) * |loss|``: two losses closer than this many units cannot be
#: told apart, and a Frank-Wolfe gap (a first-order gain) below it cannot be climbed. The float32 loss of a random
#: BERT (hidden 32, 2 layers, 4 batches of 16 x 24 tokens) at 40 perturbed points differed from its float64 loss by at
#: most 1.5 units (median 0.4), so a difference of two losses by at most 3: the factor leaves a margin of 2.7
#: (docs/method.md, "Precision").
PRECISION_FACTOR = 8
#: Starts from random points of the sphere that ``steps="auto"`` adds once two starts agree where the starts found
#: more than one maximum: a higher maximum that a random start reaches makes the value uncertified.
RANDOM_PROBES = 2


def loss_resolution(dtype: str, *losses: float) -> float:
    """``PRECISION_FACTOR * eps(dtype) * max |losses|``: the smallest difference of two losses, computed in the
    floating type named ``dtype`` (e.g. ``"float32"``), that the certificate treats as real.

    Args:
        dtype: a torch floating dtype's name.
        losses: the losses the difference is between.

    Returns:
        The resolution in loss units (0 for no losses)."""
    eps = torch.finfo(getattr(torch, dtype)).eps
    return PRECISION_FACTOR * eps * max((abs(x) for x in losses if math.isfinite(x)), default=0.0)


def loss_dtype(objective: ObjectiveFn, vector: Tensor) -> str:
    """The floating type the loss is computed in: the lowest-precision floating parameter of the objective's
    ``model``, or ``vector``'s dtype where it names none (a closed-form objective)."""
    model = getattr(objective, "model", None)
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} if isinstance(model, nn.Module) else set()
    dtype = max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else vector.dtype
    return str(dtype).removeprefix("torch.")


#: Default relative tolerance of the convergence certificate: the Frank-Wolfe gap at the best point, and the
#: agreement of two starts (``steps="auto"``).
CONVERGENCE_TOL = 1e-3
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


#: Memory goal of a solve, everywhere: what it holds beyond a plain forward+backward of the model, in bytes per
#: parameter of the model.
BYTES_PER_PARAMETER_GOAL = 16
#: Memory goal of a solve where the model's activations leave room for it: its peak, relative to a plain
#: forward+backward's.
PEAK_RATIO_GOAL = 1.5
#: The share of the bytes goal the rule leaves for what a solve holds besides its vectors and the space (the
#: allocator's rounding, a pass's temporaries): the memory suite measured 16.04 bytes per parameter where five
#: vectors and the space came to 15.94 (BERT-base, clean adaptive).
BYTES_MARGIN = 0.02


@dataclass(frozen=True)
class Footprint:
    """What a solve holds, in bytes, as known before its first step (summed over the ranks of a sharded run): the
    inputs of :func:`keeps_best_gradient`.

    Attributes:
        vector: one solver vector.
        space: what the space holds besides the vectors (the pairs' ``h x h`` caches, index maps, its workspace).
        parameters: the model's parameter count.
        weights: the model's parameters.
        activations: what the clean point's forward saved for its backward, weights excluded.
    """

    vector: int
    space: int
    parameters: int
    weights: int
    activations: int


def keeps_best_gradient(footprint: Footprint) -> bool:
    """Whether :func:`apgd` keeps its best point's gradient (a fifth vector) instead of recomputing it with one more
    forward and backward at each restart from that point. The stored gradient is the one a recomputation would give,
    bit for bit, so the choice changes time and memory, never the number.

    The rule: keep it when the solve, with it, stays within the memory goals it meets without it.

    * :data:`BYTES_PER_PARAMETER_GOAL` holds everywhere: the five vectors and the space's own memory must fit in it,
      with :data:`BYTES_MARGIN` to spare.
    * :data:`PEAK_RATIO_GOAL` is met only where the activations are large enough. A plain forward+backward's peak is
      estimated between ``weights + activations`` (its least) and ``2 weights + activations`` (its most, every
      gradient written); the fifth vector is kept if the solve's extra memory with it is within the goal's headroom
      of the least, or if it already exceeds the headroom of the most without it (the goal is then out of reach
      whatever the solver stores, and the bytes goal bounds the cost). In between it is not kept: near the goal,
      the estimate cannot tell on which side the solve falls.

    Small batches (a MiniLM at 1024 tokens) keep it, large ones (64 x 128 tokens) too, and a MiniLM at 16 x 128
    tokens, whose four vectors fit the peak goal and five would not, recomputes."""
    four = 4 * footprint.vector + footprint.space
    five = four + footprint.vector
    if five > (1.0 - BYTES_MARGIN) * BYTES_PER_PARAMETER_GOAL * footprint.parameters:
        return False
    headroom = PEAK_RATIO_GOAL - 1.0
    least = footprint.weights + footprint.activations
    most = 2 * footprint.weights + footprint.activations
    return five <= headroom * least or four > headroom * most


@contextlib.contextmanager
def saved_activation_bytes() -> Iterator[list[int]]:
    """Count the bytes the autograd graphs built inside the block save for backward (a one-element list, filled on
    exit): every saved storage once, except weights (leaves that require gradients, or parameters, and their
    views), which a plain forward+backward holds anyway."""
    storages: dict[int, int] = {}

    def pack(t: Tensor) -> Tensor:
        root = t if t._base is None else t._base
        if not (isinstance(root, nn.Parameter) or (root.is_leaf and root.requires_grad)):
            try:
                storage = t.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
            except (RuntimeError, NotImplementedError):  # a tensor subclass without a storage of its own
                storages[id(t)] = t.numel() * t.element_size()
        return t

    counted = [0]
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        yield counted
    counted[0] = sum(storages.values())


def measured_footprint(space: Space, objective: ObjectiveFn, vector: Tensor, activations: int) -> Footprint | None:
    """The :class:`Footprint` of a solve whose vectors are like ``vector``, with ``activations`` from
    :func:`saved_activation_bytes`; None when the objective names no ``model`` (nothing to weigh the vectors
    against). Every rank of a sharded run gets the same sums, so all take the same decision."""
    model = getattr(objective, "model", None)
    if not isinstance(model, nn.Module):
        return None
    local = [p.to_local() if hasattr(p, "to_local") else p for p in model.parameters()]
    facts = torch.tensor(
        [vector.numel() * vector.element_size(), space.held_bytes, sum(p.numel() for p in local),
         sum(p.numel() * p.element_size() for p in local), activations],
        dtype=torch.float64, device=vector.device,
    )
    return Footprint(*(int(v) for v in space.total(facts).tolist()))


def relative_gap(rho: float, sq_d: float, d_xi: float, sharpness: float) -> float:
    """``(rho ||d||_g - <d, xi>_g) / sharpness``, the Frank-Wolfe gap of ``max_{||xi||_g <= rho}`` at ``xi`` (``d``
    the projected Riemannian gradient there) relative to the value: ``max_s <d, s - xi>`` over the feasible set.
    Zero at a stationary point; infinite where it is not and the value is not positive."""
    gap = max(rho * math.sqrt(max(sq_d, 0.0)) - d_xi, 0.0)
    if gap == 0.0:
        return 0.0
    return gap / sharpness if sharpness > 0 else math.inf


class Pool:
    """``size`` parameter-sized buffers, the rows of one matrix, handed out by identity so that no live vector is
    overwritten.

    One matrix rather than separate tensors, so that the inner products of a gradient with several buffers are one
    matrix-vector product and a combination of buffers is one ``addmv``: each reads every row once. Rows are never
    initialised (a row is written before it is read), so untouched ones cost no memory."""

    def __init__(self, like: Tensor, size: int) -> None:
        self.matrix = like.new_empty((size, like.numel()))
        self.rows = list(self.matrix.unbind(0))
        self._coefs = like.new_empty(2)  # combine_into's coefficients, filled on the device (no upload, no wait)

    def free(self, *live: Tensor | None) -> Tensor:
        """The first row that is none of ``live`` (a row in use must be named, or it may be handed out)."""
        for row in self.rows:
            if all(row is not x for x in live):
                return row
        raise RuntimeError(f"all {len(self.rows)} solver buffers are live; this is a bug in the solver")

    def position(self, row: Tensor) -> int:
        """Where ``row`` sits in the pool's matrix (combinations and stacked views run in this order)."""
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
        coefs = self._coefs[: len(first)]
        for j, i in enumerate(first):
            coefs[j].fill_(merged[i])
        out.addmv_(rows.t(), coefs, beta=scale)
        for i in rest:
            out.add_(self.rows[i], alpha=merged[i])


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
    keep_best_gradient: bool | None = None,
    keep_best_point: bool = False,
) -> SolveResult:
    """Worst case ``max_{xi in S} L(Exp(w0; xi)) - L(w0)`` by Auto-PGD, zero init, ``eta0 = 2 rho``.

    With a fixed ``steps`` (``max_steps=None``): one start, ``steps + 1`` forward passes and ``steps`` backward
    passes, plus one forward and backward at the end when the best point is the last iterate (its Frank-Wolfe gap
    needs its gradient), and, unless the best point's gradient is kept, one for each halving that restarts from a
    best point other than the current iterate. ``keep_best_gradient`` says whether it is (None: as
    :func:`keeps_best_gradient` decides from the :class:`Footprint` measured at the clean point); the number is the
    same bits either way. With ``max_steps`` (``steps="auto"``) a start stops as soon as its best point is
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
    ``steps="auto"`` only). It changes no number.
    """
    auto = max_steps is not None
    pool = Pool(space.empty(), 4)
    xi = pool.free()
    work = pool.free(xi)
    xi.zero_()
    with saved_activation_bytes() if keep_best_gradient is None else contextlib.nullcontext([0]) as activations:
        clean_loss, egrad = objective(xi, True, out=work)
    if keep_best_gradient is None:
        footprint = measured_footprint(space, objective, work, activations[0])
        keep_best_gradient = footprint is not None and keeps_best_gradient(footprint)
        logger.debug("best point's gradient %s (%s)", "kept" if keep_best_gradient else "recomputed", footprint)
    dtype = loss_dtype(objective, work)
    climb = _Climb(space, objective, pool, work, rho=rho, momentum=momentum, step_normalization=step_normalization,
                   min_update_ratio=min_update_ratio, on_step=on_step, tol=tol, clean_loss=clean_loss,
                   keep_best_gradient=keep_best_gradient, dtype=dtype)
    budget = max_steps if auto else steps
    best = climb.run(xi, 0.0, clean_loss, egrad, steps=min(steps, budget), budget=budget, auto=auto)
    values, gaps, kinds, overall = [best.loss - clean_loss], [best.gap], ["zero"], best
    kept_point: Tensor | None = None
    while auto and len(values) < max_starts and climb.steps_used < budget:
        kind = _next_kind(SolveResult(overall.loss, clean_loss, climb.losses, 0.0, overall.gap, values, gaps, kinds,
                                      dtype), tol)
        if kind is None:
            break  # certified, refuted by a random start, or the best start is not stationary (out of budget)
        if keep_best_point and overall is best:  # the next start reuses this row
            kept_point = space.empty() if kept_point is None else kept_point
            kept_point.copy_(overall.row)
        start, sq = climb.next_start(best, overall, kind, len(values), generator)
        loss, egrad = objective(start, True, out=work)
        climb.record(loss)
        best = climb.run(start, sq, loss, egrad, steps=min(AUTO_BLOCK, budget - climb.steps_used),
                         budget=budget - climb.steps_used, auto=True)
        values.append(best.loss - clean_loss)
        gaps.append(best.gap)
        kinds.append(kind)
        if best.loss > overall.loss:
            overall = best
    point = None if not keep_best_point else overall.row if overall is best else kept_point
    return SolveResult(overall.loss, clean_loss, climb.losses, math.sqrt(overall.sq), overall.gap, values, gaps,
                       kinds if auto else [], dtype, best_point=point)


def _next_kind(result: SolveResult, tol: float) -> str | None:
    """Where the next start of ``steps="auto"`` begins (:data:`START_KINDS`), or None to stop: the best start is not
    stationary (its budget ran out), the value is certified, or a random start refuted two agreeing ones."""
    values, gaps, kinds, floor = result.start_values, result.start_gaps, result.start_kinds, result.resolution
    if not (result.gap <= tol or result.gap * max(result.sharpness, 0.0) <= floor):
        return None
    probes = kinds.count("random")
    if probes:  # random starts run only after two starts agreed on the best value
        climbs = [i for i, k in enumerate(kinds) if k != "random"]
        agreed = _agreed_value([values[i] for i in climbs], [gaps[i] for i in climbs], tol, floor)
        if agreed is not None and max(values) > agreed + max(tol * abs(agreed), floor):
            return None
    best = max(values)
    agree = sum(v >= best - max(tol * abs(best), floor) and (g <= tol or g * max(v, 0.0) <= floor)
                for v, g in zip(values, gaps)) >= 2
    if agree:
        return "random" if _multimodal(values, gaps, tol, floor) and probes < RANDOM_PROBES else None
    return "antipode" if len(values) == 1 else "near"


@dataclass
class _Best:
    """A start's best point: its pool row, loss, squared norm and relative Frank-Wolfe gap (NaN until known)."""

    row: Tensor
    loss: float
    sq: float
    gap: float = math.nan


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
        pool, work, space, rho = self.pool, self.work, self.space, self.rho
        xi_prev = xi
        sq_prev = cross = sq_xi  # ||xi_prev||^2, <xi, xi_prev> (metric g)
        best = _Best(xi, loss, sq_xi)
        schedule = StepSchedule(2.0 * rho, steps, self.min_update_ratio, loss)
        total, k = steps, -1
        while k + 1 < total:
            k += 1
            if egrad is None:  # after a restart from an earlier best point
                egrad = self.gradient_at_best(best)
            if self.step_normalization == "euclidean":  # read before ascent_direction consumes the gradient
                c = schedule.eta / (math.sqrt(max(float(torch.dot(egrad, egrad)), 0.0)) + 1e-12)
            known = [row for row, sq in ((xi, sq_xi), (xi_prev, sq_prev)) if sq > 0]  # zero rows have zero products
            save = self.saving(best) if xi is best.row else None
            if save is None:
                d, sq_d, products = space.ascent_direction(egrad, pool.stacked(known), out=work)
            else:  # the gradient at the best point, copied in the same pass (a space that keeps gradients can)
                d, sq_d, products = space.ascent_direction(egrad, pool.stacked(known), out=work, save=save)
            egrad = None
            product = dict(zip(sorted({pool.position(row) for row in known}), products))  # stacked() order
            d_xi = product.get(pool.position(xi), 0.0) if sq_xi > 0 else 0.0
            d_prev = product.get(pool.position(xi_prev), 0.0) if sq_prev > 0 else 0.0
            if xi is best.row:
                best.gap = self.gap(best, sq_d, d_xi)
                if auto and self.stationary_enough(best, self.slope(best, sq_d, d_xi)):
                    return best
            if self.step_normalization == "riemannian":
                c = schedule.eta / (math.sqrt(sq_d) + 1e-12)
            elif self.step_normalization == "none":
                c = schedule.eta
            a, b, g, sq_new = _momentum_step(k, c, rho, self.momentum, sq_xi, sq_d, sq_prev, d_xi, d_prev, cross)
            new_cross = a * sq_xi + b * d_xi + g * cross  # <xi_new, xi>
            terms = [(a if sq_xi > 0 else 0.0, xi), (b, d)]
            if xi_prev is not xi and xi_prev is not best.row:  # xi_prev is not needed again: combine over it
                new, scale = xi_prev, g if sq_prev > 0 else 0.0
            else:
                new, scale = pool.free(xi, xi_prev, best.row, work), 0.0
                terms.append((g if sq_prev > 0 else 0.0, xi_prev))
            pool.combine_into(new, scale, terms)
            xi_prev, xi = xi, new
            sq_prev, sq_xi, cross = sq_xi, sq_new, new_cross
            loss, egrad = self.objective(xi, auto or k < total - 1, out=work)
            self.record(loss)
            if loss > best.loss:
                best = _Best(xi, loss, sq_xi)
                schedule.n_updates += 1
            if schedule.halve(k, best.loss):
                if xi is not best.row:
                    egrad = None  # taken at the best point (kept or recomputed) when the next step needs it
                xi = xi_prev = best.row
                sq_xi = sq_prev = cross = best.sq
            if auto and k == total - 1 and total < budget:
                block = min(total, budget - total)
                schedule.extend(total, block, eta=2.0 * rho)
                total += block
                if xi is not best.row:  # the new block starts from the best point
                    egrad = None
                xi = xi_prev = best.row
                sq_xi = sq_prev = cross = best.sq
        if math.isnan(best.gap):  # the best point is the last iterate: one more gradient, there
            if egrad is None or xi is not best.row:
                egrad = self.gradient_at_best(best)
            _, sq_d, products = space.ascent_direction(egrad, pool.stacked([best.row] if best.sq > 0 else []),
                                                       out=work)
            best.gap = self.gap(best, sq_d, products[0] if best.sq > 0 else 0.0)
        return best

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


def average_case(
    space: Space,
    objective: ObjectiveFn,
    *,
    rho: float,
    n_samples: int = N_SAMPLES,
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
