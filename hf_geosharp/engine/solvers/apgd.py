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

import torch
from torch import Tensor

from ..capture import capture_choice, compile_backend
from ..checks import non_finite_loss
from ..defaults import BLOCK_STEPS, STEP_NORMALIZATION
from .certificate import CONVERGENCE_TOL, SolveResult, next_start_kind
from .climb import Agreement, Best, Climb
from .device_climb import DeviceClimb
from .interface import ObjectiveFn, PendingFn, Space, StepNormalization
from .memory import GradientRule, saved_activation_bytes
from .pool import Pool

#: Default step budget of ``steps="auto"`` (all starts together).
AUTO_MAX_STEPS = 640
#: The most starts ``steps="auto"`` makes: from zero, from the antipode of the best point, then near the best point.
#: Where maxima lie close together, starts near the best point climb a ladder before two agree (on a fine-tuned MiniLM
#: at rho 0.2: 0.0958 from zero, then 0.0961, 0.0962, 0.0962); four starts left 3 of 176 such numbers uncertified
#: (docs/method.md).
AUTO_MAX_STARTS = 8
#: Steps of a start's first block under ``steps="auto"`` (the step-size checkpoints follow its length).
AUTO_BLOCK = BLOCK_STEPS


def apgd(
    space: Space,
    objective: ObjectiveFn,
    *,
    rho: float,
    steps: int = BLOCK_STEPS,
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
    host_steps: bool = False,
    compile: str = "off",
    keep_clean_gradient: bool | GradientRule = False,
    pending: PendingFn | None = None,
) -> SolveResult:
    """Worst case ``max_{xi in S} L(Exp(w0; xi)) - L(w0)`` by Auto-PGD, zero init, ``eta0 = 2 rho``.

    With a fixed ``steps`` (``max_steps=None``): one start, ``steps + 1`` forward passes and ``steps`` backward
    passes, plus one forward and backward at the end when the best point is the last iterate (its Frank-Wolfe gap
    needs its gradient; with ``pending``, the objective with its gradient left pending, the last iterate's forward
    keeps its graph and only its backward runs there), and, unless the best point's gradient is kept, one for each
    halving that restarts from a best point other than the current iterate. ``keep_best_gradient`` says whether it
    is: a bool, or the caller's memory rule (:func:`~.memory.gradient_rule`), asked once with the clean point's
    activation bytes; the number is the same bits either way. With ``max_steps`` (``steps="auto"``) a start stops as
    soon as its best point is stationary within ``START_STOP_FRACTION * tol`` (the gap is free at every step: it
    comes from the step's own direction), or within ``tol`` after a block that barely raised it
    (:meth:`.climb.Climb.stalled`), continuing in blocks of doubling length (each with AS23's checkpoints) while it
    is not; then further starts (the antipode of the best point, then points near the best point found so far, up to
    ``max_starts``) run the same way, each stopping as soon as it agrees with the best value found so far
    (:class:`~.climb.Agreement`), until two stationary starts agree on the best value within ``tol``, all within
    ``max_steps`` steps. With ``step_normalization="riemannian"`` every quantity is g-invariant, so the iterates are
    equivariant under the model's symmetries.

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
    ``steps="auto"`` only). It changes no number. With ``keep_clean_gradient`` (a bool, or the caller's memory rule,
    :func:`~.memory.clean_gradient_rule`) it carries a copy of the gradient at the clean point, which its first
    evaluation computes anyway (``SolveResult.clean_gradient``, one more vector during the solve). ``loss_dtype``
    names the floating type the loss is computed in (the model's lowest precision, :func:`~.certificate.loss_dtype`;
    default the vectors' dtype), which sets the certificate's resolution.

    The step's bookkeeping stays on the device (:class:`~.device_climb.DeviceClimb`): the host reads it once per
    check (a step-size checkpoint, a block's end), never inside a step. ``host_steps=True`` runs the reference
    instead (:class:`~.climb.Climb`, every quantity read as it is computed), which takes the same decisions on the
    same float64 numbers. The objective's loss may be a float or a 0-dim tensor the host does not read.
    ``compile`` (opt-in) captures the step with ``torch.compile(fullgraph=True)``: its scalar updates and, for a
    space that offers it (:meth:`~hf_geosharp.engine.space.perturbation_space.PerturbationSpace.captured`), the
    direction pass and the geodesic point with its pullback. ``"off"`` (default) runs eagerly, ``"default"``
    compiles with inductor, ``"reduce-overhead"`` adds CUDA graphs (CUDA only, refused elsewhere before any work),
    any other value names a ``torch.compile`` backend (``"aot_eager"``: the capture with the eager kernels, the
    same numbers). The model's forward and backward are not captured.
    """
    capture = _capture(space, compile)
    with capture:
        return _apgd(space, objective, rho, steps, momentum, step_normalization, min_update_ratio, on_step,
                     max_steps, tol, generator, max_starts, keep_best_gradient, keep_best_point, loss_dtype,
                     host_steps, compile, keep_clean_gradient, pending)


def _capture(space: Space, compile: str) -> contextlib.AbstractContextManager[None]:
    """The space's capture context for ``compile`` (checked before any work), or nothing to enter."""
    if hasattr(space, "captured"):
        return space.captured(compile)
    capture_choice(compile, space.empty().device if compile == "reduce-overhead" else torch.device("cpu"))
    return contextlib.nullcontext()


def _apgd(space: Space, objective: ObjectiveFn, rho: float, steps: int, momentum: float,
          step_normalization: StepNormalization, min_update_ratio: float, on_step: Callable[[int, float], None] | None,
          max_steps: int | None, tol: float, generator: torch.Generator | None, max_starts: int,
          keep_best_gradient: bool | GradientRule, keep_best_point: bool, loss_dtype: str | None, host_steps: bool,
          compile: str, keep_clean_gradient: bool | GradientRule = False,
          pending: PendingFn | None = None) -> SolveResult:
    """:func:`apgd` within its capture context."""
    auto = max_steps is not None
    pool = Pool(space.empty(), 4)
    if compile == "reduce-overhead":  # CUDA graphs write the pool's rows in place: their address must not change
        torch._dynamo.mark_static_address(pool.matrix)
    xi = pool.free()
    work = pool.free(xi)
    xi.zero_()
    rule = keep_best_gradient if callable(keep_best_gradient) else None
    clean_rule = keep_clean_gradient if callable(keep_clean_gradient) else None
    measure = rule is not None or clean_rule is not None
    with saved_activation_bytes() if measure else contextlib.nullcontext([0]) as activations:
        clean, egrad = objective(xi, True, out=work)
    clean_loss = float(clean)  # (read once, before any step)
    if not math.isfinite(clean_loss):
        raise non_finite_loss(clean_loss, None)
    keep = rule(work, activations[0]) if rule is not None else bool(keep_best_gradient)
    keep_clean = clean_rule(work, activations[0]) if clean_rule is not None else bool(keep_clean_gradient)
    clean_gradient = space.empty().copy_(egrad) if keep_clean else None  # (the first step consumes egrad)
    dtype = loss_dtype or str(work.dtype).removeprefix("torch.")
    options = dict(rho=rho, momentum=momentum, step_normalization=step_normalization,
                   min_update_ratio=min_update_ratio, on_step=on_step, tol=tol, clean_loss=clean_loss,
                   keep_best_gradient=keep, dtype=dtype)
    climb = (Climb(space, objective, pool, work, **options) if host_steps
             else DeviceClimb(space, objective, pool, work, compile_backend=compile_backend(compile), pending=pending,
                              **options))
    budget = max_steps if auto else steps
    best = climb.run(xi, 0.0, clean_loss, egrad, steps=min(steps, budget), budget=budget, auto=auto)
    starts = _Starts(climb, best, clean_loss, dtype)
    if auto:
        starts.more(budget, max_starts, generator, keep_best_point)
    overall = starts.overall
    point = None if not keep_best_point else overall.row if overall is starts.last else starts.kept_point
    return SolveResult(overall.loss, clean_loss, climb.losses, math.sqrt(overall.sq), overall.gap, starts.values,
                       starts.gaps, starts.kinds if auto else [], dtype, best_point=point,
                       clean_gradient=clean_gradient)


class _Starts:
    """The starts of one solve: each one's best value, gap and kind, the best over all, and (``keep_best_point``)
    a copy of it where a later start reuses its row."""

    def __init__(self, climb: Climb, first: Best, clean_loss: float, dtype: str) -> None:
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
            agreement = Agreement.with_best(self.overall, self.clean_loss, climb.tol, self.dtype)
            start, sq = climb.next_start(self.last, self.overall, kind, len(self.values), generator)
            loss, egrad = climb.first(start)
            best = climb.run(start, sq, loss, egrad, steps=min(AUTO_BLOCK, budget - climb.steps_used),
                             budget=budget - climb.steps_used, auto=True, agreement=agreement)
            self.values.append(best.loss - self.clean_loss)
            self.gaps.append(best.gap)
            self.kinds.append(kind)
            self.last = best
            if best.loss > self.overall.loss:
                self.overall = best
