"""The runner: model and batches in, :class:`~hf_geosharp.engine.result.SharpnessResult` out.

It checks the inputs, picks the placement (this rank of an FSDP2 model when the model has FSDP2 modules; else the
whole model in this process, with batches spread over the processes of an ``accelerate.Accelerator``), builds the
perturbation space and the objective once (:func:`~hf_geosharp.engine.builder.build`), runs the solver on each
batch (the randomness of batch ``i`` depends on ``(seed, i)`` only), and collects the per-batch values. Everything
that determines the number is one frozen :class:`~hf_geosharp.engine.settings.RunSettings`.
"""

from __future__ import annotations

import ctypes
import logging
import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from .._version import __version__
from ..symmetry.base import SymmetryMap
from .builder import build, measuring
from .capture import capture_choice
from .checks import check_inputs
from .model_function.objective import LossFn, Objective, default_loss, preserved_model_state, to_device
from .placement.base import Placement
from .placement.fsdp import FsdpPlacement
from .placement.single import SingleProcess
from .progress import Ticker, bar_disabled
from .result import NOT_ITERATIVE, Profile, SharpnessResult, average_stderr, batch_stderr, warn_not_converged
from .settings import RunSettings
from .solvers.apgd import AUTO_BLOCK, apgd
from .solvers.as23 import apgd_as23
from .solvers.average import average_case
from .solvers.certificate import AT_PRECISION, CERTIFIED, NOT_CERTIFIED, SolveResult, loss_dtype
from .solvers.memory import clean_gradient_rule, gradient_rule
from .space.perturbation_space import PerturbationSpace
from .worst_direction import WorstDirection
from .worst_direction import profile_points as profile_points_of

logger = logging.getLogger(__name__)


def solve(settings: RunSettings, space: PerturbationSpace, objective: Objective, generator: torch.Generator,
          on_step: Callable[[int, float], None], keep_best_point: bool = False) -> SolveResult:
    """One batch: the average case, AS23's solver, or the clean Auto-PGD (``keep_best_point``: the result carries
    the best point, AS23's always does, and, where the memory rule allows, the gradient at the clean point, which
    the breakdown reads). The memory decisions (whether Auto-PGD keeps its best point's gradient, and the clean
    point's) and the loss's floating type come from the model the objective evaluates."""
    auto = settings.steps == "auto"
    first, budget = (min(AUTO_BLOCK, settings.max_steps), settings.max_steps) if auto else (settings.steps, None)
    if settings.mode == "average":
        return average_case(space, objective, rho=settings.rho, n_samples=settings.n_samples, generator=generator,
                            on_step=on_step)
    if settings.variant == "as23":
        return apgd_as23(space.elementwise.scale, objective, rho=settings.rho, steps=first, on_step=on_step,
                         max_steps=budget, tol=settings.tol)
    return apgd(space, objective.on_device, rho=settings.rho, steps=first,
                step_normalization=settings.step_normalization, on_step=on_step, max_steps=budget, tol=settings.tol,
                generator=generator, keep_best_gradient=gradient_rule(space, objective.model),
                keep_best_point=keep_best_point, loss_dtype=loss_dtype(objective.model, space.dtype),
                compile=settings.compile,
                keep_clean_gradient=clean_gradient_rule(space, objective.model) if keep_best_point else False,
                pending=objective.pending)


def batch_seed(seed: int, index: int) -> int:
    """A per-batch seed that does not depend on which process solves the batch."""
    return (seed * 1_000_003 + 7919 * (index + 1)) % (2**63 - 1)


def run(
    model: nn.Module,
    batches: Iterable[Any],
    settings: RunSettings,
    *,
    loss_fn: LossFn | None = None,
    accelerator: Any = None,
    progress: bool = True,
    symmetry_map: SymmetryMap | None = None,
    return_perturbation: bool = False,
    profile_points: int = 0,
) -> SharpnessResult:
    """Measure ``settings.measure`` of ``model`` on ``batches`` (see :func:`hf_geosharp.geodesic_sharpness`).

    A worst case in one process also reads where its best points sit (``SharpnessResult.breakdown``), and with
    ``return_perturbation`` / ``profile_points`` returns them and the loss along them
    (:mod:`hf_geosharp.engine.worst_direction`)."""
    if profile_points:
        profile_points_of(profile_points)  # refused before any work
    batches = check_inputs(model, batches)
    if settings.compile == "reduce-overhead":  # CUDA graphs: refused off CUDA before any work
        capture_choice(settings.compile, next(model.parameters()).device)
    placement: Placement = FsdpPlacement.of(model) or SingleProcess(model, accelerator)
    if settings.compile != "off" and not isinstance(placement, SingleProcess):
        raise ValueError(f"compile={settings.compile!r} captures the step of a model in one process; an FSDP-sharded "
                         "model's step sums over the ranks between its operations and runs eagerly. Pass "
                         "compile='off'.")
    mine = placement.batches(len(batches))
    direction = settings.mode == "worst" and isinstance(placement, SingleProcess)
    if (return_perturbation or profile_points) and not direction:
        raise ValueError("return_perturbation and profile_points need a worst case (mode='worst') in one process "
                         "(not an FSDP-sharded model).")
    if direction and symmetry_map is None and settings.options is not None and settings.options.metric is not None:
        from ..symmetry import map_symmetries

        symmetry_map = map_symmetries(model, params=settings.params)  # shared by the builder and the breakdown
    with preserved_model_state(model):
        space, objective = build(model, settings, placement, loss_fn or default_loss, {i: batches[i] for i in mine},
                                 symmetry_map)
        logger.info("%s: %d GL pairs, %s parameters%s, %d batch%s", settings.measure, space.n_pairs,
                    f"{space.numel:,}", placement.where, len(batches), "" if len(batches) == 1 else "es")
        reader = None
        if direction:
            holding = placement.holding
            reader = WorstDirection(space, objective, holding.names, holding.rows, symmetry_map, settings.measure,
                                    profile_points, return_perturbation)
        symmetry_map = None  # read by the space and the reader; a map made for this run is freed here
        release_freed_memory()
        results = _solve_batches(space, objective, settings, batches, mine, progress and placement.rank == 0, reader)
    results = placement.collect(results)
    result = _result(settings, [results[i] for i in range(len(batches))], placement.world)
    if reader is not None:
        readings = [results[i][8] for i in range(len(batches))]
        result.breakdown = reader.breakdown(readings)
        if profile_points:
            result.profile = Profile(reader.t, [r["geodesic"] for r in readings], [r["segment"] for r in readings])
        if return_perturbation:
            result.perturbations = [r["perturbation"] for r in readings]
    return result


def release_freed_memory() -> None:
    """Give the memory freed while building (the symmetry map's index maps, masks, the flat copy of the weights) back
    to the operating system before the solver's buffers and the activations arrive: glibc keeps freed small blocks
    in its heap, where they would count towards the run's peak. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _solve_batches(space: PerturbationSpace, objective: Objective, settings: RunSettings, batches: list[Any],
                   mine: Iterable[int], progress: bool, reader: WorstDirection | None = None) -> dict[int, tuple]:
    """``{batch index: (sharpness, clean loss, average-case samples or None, stationarity gap, steps used, why it is
    not certified or None, the certificate's state, its note when certified at precision or None, the reader's
    reading of the best point or None, the worst case's solve: its steps, certificate and starts, or None)}``."""
    n_steps = settings.n_samples if settings.mode == "average" else settings.steps
    results: dict[int, tuple] = {}
    bar = tqdm(list(mine), desc=settings.measure, unit="batch", disable=bar_disabled(progress))
    ticker = Ticker(settings.measure, len(bar), n_steps, progress)  # lines where the bar does not show
    for position, index in enumerate(bar, start=1):
        objective.batch = to_device(batches[index], space.device)
        generator = torch.Generator().manual_seed(batch_seed(settings.seed, index))
        torch.manual_seed(batch_seed(settings.seed, index))  # the forked global RNG: random models repeat

        def on_step(k: int, sharpness: float) -> None:  # solver progress inside the batch bar
            bar.set_postfix(step=f"{k + 1}/{n_steps}", sharpness=f"{sharpness:.4g}", refresh=False)
            bar.refresh()
            ticker.step(position, k + 1, sharpness)  # noqa: B023 - called while this batch is solved

        with measuring(settings.measure, index, batches[index]):
            out = solve(settings, space, objective, generator, on_step, keep_best_point=reader is not None)
            reading = None
            if reader is not None:  # the best point alone, the solver's other vectors freed: the reading's
                best, out.best_point = out.best_point.clone(), None  # own vectors then fit in their place
                gradient, out.clean_gradient = out.clean_gradient, None
                reading = reader.read(best, index, out.clean_loss, out.max_loss, gradient)
                del best, gradient
        samples = [loss - out.clean_loss for loss in out.losses[1:]] if settings.mode == "average" else None
        state, note = out.verdict(settings.tol, settings.starts) if settings.mode == "worst" else (None, None)
        precision = note if state == AT_PRECISION else None
        note = note if state == NOT_CERTIFIED else None
        solve_record = None if settings.mode == "average" else {
            "steps": out.steps_used, "certificate": state,
            "starts": [{"kind": kind, "value": value, "gap": gap} for kind, value, gap in
                       zip(out.start_kinds or ["zero"], out.start_values or [out.sharpness],
                           out.start_gaps or [out.gap])]}
        results[index] = (out.sharpness, out.clean_loss, samples, out.gap, out.steps_used, note, state, precision,
                          reading, solve_record)
        bar.set_postfix(sharpness=f"{out.sharpness:.4g}")
        ticker.batch_end(position, out.steps_used if out.steps_used is not None else n_steps, out.sharpness)
        del out  # the solver's vectors, before the next batch's
    return results


def _result(settings: RunSettings, ordered: list[tuple], world: int) -> SharpnessResult:
    per_batch, per_clean = [r[0] for r in ordered], [r[1] for r in ordered]
    config = {**settings.config(), "n_batches": len(ordered), "n_processes": world,
              "library": f"hf_geosharp {__version__}"}
    certificate = NOT_ITERATIVE
    if settings.mode == "average":
        stderr, gap, note, steps_used = average_stderr([r[2] for r in ordered]), math.nan, None, None
    else:
        stderr, gap, steps_used = batch_stderr(per_batch), max(r[3] for r in ordered), max(r[4] for r in ordered)
        notes = [(i, r[5]) for i, r in enumerate(ordered) if r[5] is not None]
        note = None if not notes else f"batch {notes[0][0]}: {notes[0][1]}" + (
            f" (and {len(notes) - 1} more batch{'es' if len(notes) > 2 else ''})" if len(notes) > 1 else "")
        if note is not None:
            warn_not_converged(settings.measure, config, note, steps_used)
            certificate = NOT_CERTIFIED
        else:
            precise = [(i, r[7]) for i, r in enumerate(ordered) if r[6] == AT_PRECISION]
            certificate = AT_PRECISION if precise else CERTIFIED
            note = None if not precise else f"batch {precise[0][0]}: {precise[0][1]}" + (
                f" (and {len(precise) - 1} more)" if len(precise) > 1 else "")
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch, clean_loss=sum(per_clean) / len(per_clean),
        per_batch_clean_loss=per_clean, measure=settings.measure, config=config, stderr=stderr,
        converged=certificate != NOT_CERTIFIED, stationarity_gap=gap, convergence_note=note, steps_used=steps_used,
        certificate=certificate, per_batch_solve=None if settings.mode == "average" else [r[9] for r in ordered],
    )
