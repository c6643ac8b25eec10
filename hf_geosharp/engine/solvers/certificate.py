"""What certifies (or not) that a worst case's largest loss is a maximum: the result of a solve, its Frank-Wolfe gap,
the agreement of its starts, and the loss's resolution in its floating type (docs/method.md, "Convergence")."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

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
    #: The loss's gradient at the clean point (``xi = 0``) when the solver was asked to keep it, else None.
    clean_gradient: Tensor | None = field(default=None, repr=False, compare=False)

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
        ``tol`` and reached again within ``tol`` by another stationary start (and no start from a random point found
        a higher maximum than two agreeing starts); ``starts < 2`` (a fixed budget, one start) is never certified:
        one stationary point is a local maximum, a lower bound of the largest; ``(AT_PRECISION, what)`` when that
        holds only with the tolerances widened to the loss's :attr:`resolution` (a Frank-Wolfe gap, or a
        disagreement of starts, below what the loss's floating type can resolve); ``(NOT_CERTIFIED, why)`` else.
        Either certified state says that two starts agree on a stationary point: a maximum, not the largest. A value
        below the resolution is never certified (the largest loss found cannot be told from the clean loss), unless
        the gap is exactly 0 (no gradient: the loss is flat there)."""
        floor = self.resolution
        if self.sharpness < floor and self.gap != 0:  # gap 0: the loss is flat there (no gradient), which is exact
            return NOT_CERTIFIED, (
                f"the value {self.sharpness:.3g} is below the resolution of the loss in {self.dtype} ({floor:.2g} = "
                f"{PRECISION_FACTOR} eps |loss|): the largest loss found cannot be told from the clean loss, so "
                "nothing about a maximum is certified")
        gap_abs = self.gap * self.sharpness if self.sharpness > 0 else (0.0 if self.gap == 0 else math.inf)
        if not (self.gap <= tol or gap_abs <= floor):
            return NOT_CERTIFIED, f"not stationary (Frank-Wolfe gap {self.gap:.2%} of the value, tolerance {tol:.2%})"
        exact = self.gap <= tol
        if starts < 2:  # one start: a stationary point that nothing checked against a higher one
            return NOT_CERTIFIED, (f"one start at a fixed budget reached a stationary point (Frank-Wolfe gap "
                                   f"{self.gap:.2%}), which no second start checked: a local maximum, a lower bound")
        agreed, exact_agreed, why = self._agreement(tol, floor)
        if why is not None:
            return NOT_CERTIFIED, why
        exact = exact and exact_agreed
        if exact:
            return CERTIFIED, None
        what = "two starts that agree and a Frank-Wolfe gap"
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


def loss_dtype(model: nn.Module | None, default: torch.dtype) -> str:
    """The floating type the loss is computed in: the lowest-precision floating parameter of ``model``, or
    ``default`` without a model (a closed-form objective).

    Args:
        model: the model the objective evaluates, or None.
        default: the dtype without a model (the solver's vectors').

    Returns:
        The dtype's name (e.g. ``"float32"``)."""
    dtypes = {p.dtype for p in model.parameters() if p.is_floating_point()} if model is not None else set()
    dtype = max(dtypes, key=lambda d: torch.finfo(d).eps) if dtypes else default
    return str(dtype).removeprefix("torch.")


#: Default relative tolerance of the convergence certificate: the Frank-Wolfe gap at the best point, and the
#: agreement of two starts (``steps="auto"``).
CONVERGENCE_TOL = 1e-3


def relative_gap(rho: float, sq_d: float, d_xi: float, sharpness: float) -> float:
    """``(rho ||d||_g - <d, xi>_g) / sharpness``, the Frank-Wolfe gap of ``max_{||xi||_g <= rho}`` at ``xi`` (``d``
    the projected Riemannian gradient there) relative to the value: ``max_s <d, s - xi>`` over the feasible set.
    Zero at a stationary point; infinite where it is not and the value is not positive."""
    gap = max(rho * math.sqrt(max(sq_d, 0.0)) - d_xi, 0.0)
    if gap == 0.0:
        return 0.0
    return gap / sharpness if sharpness > 0 else math.inf



def next_start_kind(result: SolveResult, tol: float) -> str | None:
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

