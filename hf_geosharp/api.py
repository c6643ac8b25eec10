"""Public entry points: :func:`geodesic_sharpness` and :func:`adaptive_sharpness`.

Each freezes its settings into a :class:`~hf_geosharp.engine.settings.RunSettings` (which checks them) and hands the
model to the runner (:mod:`hf_geosharp.engine.runner`); the model is used as a function of the perturbation and
restored exactly afterwards (:mod:`hf_geosharp.engine.model_function.objective`). Results are
:class:`~hf_geosharp.engine.result.SharpnessResult`. The defaults are :mod:`hf_geosharp.engine.defaults`.

A model with nothing to quotient (no attention head pair mapped: an MLP, a ResNet, DiffLlama) gets one note per call,
:func:`no_symmetry_note`'s words, from every entry point: here a :class:`NoSymmetryWarning`; faces that run several
measures say it once themselves and run the measures inside :func:`symmetry_note_given`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from contextvars import ContextVar
from typing import Any

from torch import nn

from .engine.checks import check_inputs
from .engine.defaults import (
    ADAPTIVE_VARIANT,
    BALL,
    COMPILE,
    ELEMENTWISE_CURVATURE,
    EPSILON,
    METRIC,
    MODE,
    N_SAMPLES,
    PARAMS,
    RHO,
    SEED,
    STEP_NORMALIZATION,
    STEPS,
)
from .engine.geometry.elementwise import Curvature
from .engine.geometry.gl_quotient import Metric
from .engine.model_function.objective import LossFn
from .engine.result import NotConvergedWarning, SharpnessResult, collected_convergence_notes, warn_at_caller
from .engine.runner import run
from .engine.settings import Mode, Params, RunSettings, Steps, Variant
from .engine.solvers.apgd import AUTO_MAX_STEPS
from .engine.solvers.certificate import CONVERGENCE_TOL
from .engine.solvers.interface import StepNormalization
from .engine.space.perturbation_space import Ball, SpaceOptions
from .symmetry.base import SymmetryMap

__all__ = ["NoSymmetryWarning", "NotConvergedWarning", "SharpnessResult", "adaptive_sharpness",
           "collected_convergence_notes", "geodesic_sharpness", "no_symmetry_note", "symmetry_note_given"]


class NoSymmetryWarning(UserWarning):
    """Geodesic sharpness of a model without a mapped attention head pair: nothing to quotient, so the value is
    adaptive sharpness's (``no_symmetry_note`` says why)."""


def no_symmetry_note(symmetry_map: SymmetryMap | None, what: str = "the model") -> str | None:
    """The note for a model without mapped attention head pairs (an MLP, a ResNet, attention the mapper cannot map),
    or ``None``: with no GL(h) symmetry there is nothing to quotient, and geodesic sharpness is adaptive sharpness by
    construction (the same ball, the same solver), so equal numbers are expected, not a fault. Every entry point
    uses these words."""
    if symmetry_map is None or symmetry_map.blocks:
        return None
    unmapped = symmetry_map.fallbacks
    pairs = "no attention head pairs" if not unmapped else (
        f"no attention head pairs that could be mapped ({len(unmapped)} attention module"
        f"{'s' if len(unmapped) > 1 else ''} treated elementwise; {unmapped[0].module}: {unmapped[0].reason})")
    return (f"{what} has {pairs} (no GL(h) symmetry to quotient), so geodesic sharpness equals adaptive sharpness "
            "by construction.")


_noted: ContextVar[bool] = ContextVar("hf_geosharp_symmetry_noted", default=False)


def symmetry_noted() -> bool:
    """Whether the caller has already given :func:`no_symmetry_note` (inside :func:`symmetry_note_given`)."""
    return _noted.get()


@contextlib.contextmanager
def symmetry_note_given() -> Iterator[None]:
    """Inside the block :func:`geodesic_sharpness` does not repeat the note of a model with nothing to quotient: the
    face around it (several measures, a leaderboard, a training run) has said it once."""
    token = _noted.set(True)
    try:
        yield
    finally:
        _noted.reset(token)


def geodesic_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = RHO,
    metric: Metric = METRIC,
    ball: Ball = BALL,
    mode: Mode = MODE,
    steps: Steps = STEPS,
    seed: int = SEED,
    epsilon: float = EPSILON,
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    symmetry_map: SymmetryMap | None = None,
    params: Params = PARAMS,
    n_samples: int = N_SAMPLES,
    second_order: bool = True,
    riemannian_norm: bool = True,
    horizontal_projection: bool = True,
    elementwise_curvature: Curvature = ELEMENTWISE_CURVATURE,
    step_normalization: StepNormalization = STEP_NORMALIZATION,
    tol: float = CONVERGENCE_TOL,
    max_steps: int = AUTO_MAX_STEPS,
    return_perturbation: bool = False,
    profile_points: int = 0,
    compile: str = COMPILE,
) -> SharpnessResult:
    """Geodesic sharpness (da Silva, Dangel & Oore, ICML 2025): sharpness on the quotient by the attention symmetries.

    Perturbations are horizontal (orthogonal to the GL(h) orbits of every QK and VO head pair), bounded in the
    Riemannian norm ``||xi||_g <= rho`` and applied along second-order geodesics; all other parameters are perturbed
    as in adaptive sharpness. The number is invariant under ``gs.reparametrize(model)``, also with the default
    ``epsilon`` (the relaxation is built to transform with the group; docs/method.md).

    Args:
        model: any ``nn.Module``; restored exactly afterwards (weights, ``requires_grad``, ``.grad``, train/eval mode).
            It runs in eval mode; activation checkpointing that stays on there must be the non-reentrant kind.
        batches: iterable of dicts accepted by ``model(**batch)`` with labels (loss = ``outputs.loss``), or anything
            ``loss_fn`` accepts. Each batch is solved separately and the values are averaged.
        rho: radius of the geodesic ball.
        metric: ``"inv"`` (paper Eq. 9) or ``"mix"`` (Eq. 10).
        ball: the radius convention: ``"calibrated"`` (default) weighs each attention pair's metric so that
            scaling the pair's weights by ``1 + t`` has the norm adaptive sharpness gives it, which makes equal
            ``rho`` comparable across inv, mix and adaptive; ``"paper"``: the paper's unweighted metrics (the
            numbers of 0.6.0). docs/method.md, "Radius convention".
        mode: ``"worst"`` (Auto-PGD, ``steps`` iterations) or ``"average"`` (``n_samples`` Gaussian directions).
        steps: solver iterations per batch (worst case), exactly that many from one start as in AS23;
            ``converged`` then certifies that the best point is stationary (Frank-Wolfe gap at most ``tol``). Or
            ``"auto"``: continue until the best point is stationary, then start again from the antipode (and, if
            they disagree, from points near the best one; where they found several maxima, also from two random
            points) until two starts agree within ``tol``, within ``max_steps`` steps (docs/method.md,
            "Convergence"). There ``converged`` certifies a stationary point that two starts agree on: a local
            maximum, not necessarily the global one. ``res.certificate`` says whether within ``tol`` or only within
            the loss's floating-point resolution (``"certified_at_precision"``).
        seed: seeds the average-case samples (per batch, independent of the process that solves it).
        epsilon: relative, group-covariant rank relaxation of ``G^T G`` and ``H^T H`` (about ``epsilon`` relative
            to each head's own spectrum); 0 for the exact metric (then rank-deficient heads are refused).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` when the model's own loss is not the one wanted.
        accelerator: an ``accelerate.Accelerator``: batches are sharded over its processes and gathered, so every
            process returns the full result. Move the model to ``accelerator.device`` first; do not DDP-wrap it.
        progress: show a progress bar.
        symmetry_map: where the pairs are; default ``gs.map_symmetries(model)``.
        params: ``"all"`` (default, as in AS23) or ``"trainable"`` (e.g. only LoRA adapters).
        n_samples: directions per batch (average case).
        second_order: ablation switch (paper App. G): the geodesic's second-order term (``False``: a straight step).
        riemannian_norm: ablation switch (paper App. G): the ball in the Riemannian norm (``False``: Euclidean).
        horizontal_projection: ablation switch (paper App. G): project onto the horizontal space (``False``: do not).
        elementwise_curvature: geodesic for non-attention parameters (``"none"``: first order, as the paper).
        step_normalization: ``"riemannian"`` (invariant, default), ``"euclidean"`` or ``"none"``.
        tol: relative tolerance of the convergence certificate: the Frank-Wolfe gap at the best point, and the
            agreement of two starts under ``steps="auto"``; a ``NotConvergedWarning`` says when it does not hold
            (``res.converged``, ``res.stationarity_gap``, ``res.convergence_note``).
        max_steps: step budget of ``steps="auto"``.
        return_perturbation: also return each batch's worst-case perturbation (``res.perturbations``: a
            state-dict-shaped delta and ``with p.applied(model):``); a parameter-sized copy per batch. Worst case
            only. Every worst case carries its breakdown by layer and head (``res.breakdown``; docs/where.md).
        profile_points: with an odd ``n >= 3``, the loss along each batch's worst direction at ``n`` points of
            ``[0, 2 rho]`` (``res.profile``); two forwards per point. Worst case only.
        compile: how the worst case's solver step runs: ``"off"`` (eager, default), ``"default"`` (captured by
            ``torch.compile`` with inductor: the direction, the geodesic point and its pullback, the step's scalar
            updates; not the model's forward and backward), ``"reduce-overhead"`` (the same as CUDA graphs; CUDA
            only) or a ``torch.compile`` backend's name. The number is the eager one up to rounding
            (docs/benchmarks.md, "Captured step").

    Returns:
        The :class:`SharpnessResult`: the mean over batches with its standard error, the per-batch values, the clean
        loss and the convergence certificate (``converged``, ``stationarity_gap``, ``convergence_note``,
        ``steps_used``). A model with no attention head pair mapped gets a :class:`NoSymmetryWarning`: the value is
        adaptive sharpness's.
    """
    options = SpaceOptions(metric, epsilon, second_order, riemannian_norm, horizontal_projection, elementwise_curvature,
                           ball)
    settings = RunSettings(rho, mode, steps, seed, params, n_samples, tol, max_steps, options, step_normalization,
                           compile=compile)
    if symmetry_map is None:  # mapped here (as the builder would map it) after the inputs are checked
        from .symmetry import map_symmetries

        batches = check_inputs(model, batches)
        symmetry_map = map_symmetries(model, params=settings.params)
    note = no_symmetry_note(symmetry_map)
    # The run holds the only reference to a map made here, and drops it (its index maps, 8 bytes per paired
    # coordinate) once the space and the breakdown have read it, before the solver's vectors exist.
    handed, symmetry_map = [symmetry_map], None
    result = run(model, batches, settings, loss_fn=loss_fn, accelerator=accelerator, progress=progress,
                 symmetry_map=handed.pop(), return_perturbation=return_perturbation, profile_points=profile_points)
    if note and not symmetry_noted():  # after the run has checked the map
        warn_at_caller(note, NoSymmetryWarning)
    return result


def adaptive_sharpness(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    rho: float = RHO,
    mode: Mode = MODE,
    steps: Steps = STEPS,
    seed: int = SEED,
    variant: Variant = ADAPTIVE_VARIANT,
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    params: Params = PARAMS,
    n_samples: int = N_SAMPLES,
    tol: float = CONVERGENCE_TOL,
    max_steps: int = AUTO_MAX_STEPS,
    return_perturbation: bool = False,
    profile_points: int = 0,
    compile: str = COMPILE,
) -> SharpnessResult:
    """Adaptive sharpness (Kwon et al. 2021; Andriushchenko et al. 2023):
    ``max_{||delta / |w| || <= rho} L(w + delta) - L(w)``.

    ``variant="clean"`` (default) runs the same solver as :func:`geodesic_sharpness` on the elementwise metric (one
    forward per step) and reaches the maximum of the definition. ``"as23"`` reproduces the reference code
    (``m_apgd_l2``, adaptive) quirks included, for comparison with published numbers; its fixed points are not the
    maximiser's, so it can stall several percent below the maximum (docs/method.md).

    Args:
        model: any ``nn.Module``; restored exactly afterwards, as in :func:`geodesic_sharpness`.
        batches: iterable of dicts accepted by ``model(**batch)`` with labels, or anything ``loss_fn`` accepts.
        rho: radius of the ball ``||delta / |w| || <= rho``.
        mode: ``"worst"`` or ``"average"`` (``n_samples`` Gaussian directions).
        steps: solver iterations per batch (worst case), or ``"auto"``: until certified, within ``max_steps``.
        seed: seeds the average-case samples.
        variant: ``"clean"`` (default) or ``"as23"`` (the reference code's solver).
        loss_fn: ``loss_fn(model, batch) -> scalar tensor`` when the model's own loss is not the one wanted.
        accelerator: an ``accelerate.Accelerator``: batches are sharded over its processes and gathered.
        progress: show a progress bar.
        params: ``"all"`` (default, as in AS23) or ``"trainable"`` (e.g. only LoRA adapters).
        n_samples: directions per batch (average case).
        tol: relative tolerance of the convergence certificate, as in :func:`geodesic_sharpness`.
        max_steps: step budget of ``steps="auto"``.
        return_perturbation: also return each batch's worst-case perturbation, as in :func:`geodesic_sharpness`.
        profile_points: the loss along each batch's worst direction, as in :func:`geodesic_sharpness`.
        compile: how the clean solver's step runs, as in :func:`geodesic_sharpness` (``"as23"`` runs eagerly).

    Returns:
        The mean over batches with its standard error, the per-batch values, the clean loss and the convergence
        certificate, as :func:`geodesic_sharpness` returns them.
    """
    settings = RunSettings(rho, mode, steps, seed, params, n_samples, tol, max_steps, variant=variant,
                           compile=compile)
    return run(model, batches, settings, loss_fn=loss_fn, accelerator=accelerator, progress=progress,
               return_perturbation=return_perturbation, profile_points=profile_points)
