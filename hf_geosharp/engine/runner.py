"""The runner: model and batches in, :class:`~hf_geosharp.engine.result.SharpnessResult` out.

It checks the inputs, builds the perturbation space and the objective once, runs the solver on each batch (batches
are spread over the processes of an ``accelerate.Accelerator``; the randomness of batch ``i`` depends on ``(seed,
i)`` only), and collects the per-batch values. Everything that determines the number is one frozen
:class:`RunSettings`.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import logging
import math
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn
from tqdm.auto import tqdm

from .. import __version__
from ..symmetry.base import PairBlock, SymmetryMap
from .checks import check_inputs
from .model_function.embedding_rows import UsedRows, scan_used_rows
from .model_function.objective import (
    LossFn,
    Objective,
    default_loss,
    measured_parameters,
    preserved_model_state,
    to_device,
)
from .placement.fsdp import build_sharded
from .placement.fsdp_layout import ShardedLayout, fsdp_state
from .result import SharpnessResult, average_stderr, batch_stderr, warn_not_converged
from .settings import RunSettings
from .solvers.apgd import AUTO_BLOCK, SolveResult, apgd, average_case
from .solvers.as23 import apgd_as23
from .space.coordinates import pair_parameters
from .space.perturbation_space import PerturbationSpace, SpaceOptions
from .space.workspace import Workspace

logger = logging.getLogger(__name__)

#: Weights smaller than this in magnitude cannot move (the elementwise metric divides by them).
ZERO_TOL = 1e-12


def solve(settings: RunSettings, space: PerturbationSpace, objective: Objective, generator: torch.Generator,
          on_step: Callable[[int, float], None]) -> SolveResult:
    """One batch: the average case, AS23's solver, or the clean Auto-PGD."""
    auto = settings.steps == "auto"
    first, budget = (min(AUTO_BLOCK, settings.max_steps), settings.max_steps) if auto else (settings.steps, None)
    if settings.mode == "average":
        return average_case(space, objective, rho=settings.rho, n_samples=settings.n_samples, generator=generator,
                            on_step=on_step)
    if settings.variant == "as23":
        return apgd_as23(space.elementwise.scale, objective, rho=settings.rho, steps=first, on_step=on_step,
                         max_steps=budget, tol=settings.tol)
    return apgd(space, objective, rho=settings.rho, steps=first, step_normalization=settings.step_normalization,
                on_step=on_step, max_steps=budget, tol=settings.tol, generator=generator)


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
) -> SharpnessResult:
    """Measure ``settings.measure`` of ``model`` on ``batches`` (see :func:`hf_geosharp.geodesic_sharpness`)."""
    batches = check_inputs(model, batches)
    layout = fsdp_state(model)
    if layout is not None:
        return _run_sharded(model, layout, batches, settings, loss_fn or default_loss, progress, symmetry_map)
    rank, world = (accelerator.process_index, accelerator.num_processes) if accelerator is not None else (0, 1)
    with preserved_model_state(model):
        mine = range(rank, len(batches), world)
        space, objective = _build(model, settings, symmetry_map, loss_fn or default_loss, {i: batches[i] for i in mine})
        release_freed_memory()
        logger.info("%s: %d GL pairs, %s parameters, %d batch%s", settings.measure, space.n_pairs,
                    f"{space.numel:,}", len(batches), "" if len(batches) == 1 else "es")
        results = _solve_batches(space, objective, settings, batches, mine, progress and rank == 0)
    if world > 1:
        from accelerate.utils import gather_object

        merged: dict[int, tuple] = {}
        for part in gather_object([results]):
            merged.update(part)
        results = merged
    return _result(settings, [results[i] for i in range(len(batches))], world)


def release_freed_memory() -> None:
    """Give the memory freed while building (the symmetry map's index maps, masks, the flat copy of the weights) back
    to the operating system before the solver's buffers and the activations arrive: glibc keeps freed small blocks
    in its heap, where they would count towards the run's peak. A no-op elsewhere."""
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _run_sharded(model: nn.Module, layout: ShardedLayout, batches: list[Any], settings: RunSettings,
                 loss_fn: LossFn, progress: bool, symmetry_map: SymmetryMap | None) -> SharpnessResult:
    """Every rank solves every batch together (see :mod:`hf_geosharp.engine.placement.fsdp`) and returns the full
    result."""
    with preserved_model_state(model):
        names, params = measured_parameters(model)
        blocks = _pair_blocks(model, names, settings, symmetry_map)
        forward = _scan_forward(model, settings, dict(enumerate(batches)), loss_fn, layout.device)
        space, objective = build_sharded(model, layout, settings, blocks, loss_fn, batches, forward)
        release_freed_memory()
        logger.info("%s: %d GL pairs, %s parameters on this rank of %d, %d batch%s", settings.measure,
                    space.n_pairs, f"{space.numel:,}", layout.world, len(batches), "" if len(batches) == 1 else "es")
        results = _solve_batches(space, objective, settings, batches, range(len(batches)),
                                 progress and layout.rank == 0)
    return _result(settings, [results[i] for i in range(len(batches))], layout.world)


def _build(
    model: nn.Module, settings: RunSettings, symmetry_map: SymmetryMap | None, loss_fn: LossFn,
    batches: Mapping[int, Any],
) -> tuple[PerturbationSpace, Objective]:
    """The space over the parameters that can move (all of them for a full-gradient solver; of an embedding that
    only lookups read, the rows ``batches`` use, for the clean worst case) and its objective."""
    names, params = measured_parameters(model)
    _warn_half_precision(params)
    blocks = _pair_blocks(model, names, settings, symmetry_map)
    sizes = [p.numel() for p in params]
    pair_params = pair_parameters(blocks, sizes)
    trainable = [settings.params == "all" or p.requires_grad for p in params]
    if settings.params not in ("all", "trainable"):
        raise ValueError(f"params must be 'all' or 'trainable', got {settings.params!r}.")
    if not any(trainable):
        raise ValueError("params='trainable' but no parameter has requires_grad=True; use params='all'.")
    if settings.full_gradient:
        covered = [True] * len(params)
        movable = None if all(trainable) else torch.cat(
            [torch.full((n,), t, dtype=torch.bool) for n, t in zip(sizes, trainable)]).to(params[0].device)
    else:
        covered = [t and (i in pair_params or bool((p.detach().abs() >= ZERO_TOL).any()))
                   for i, (p, t) in enumerate(zip(params, trainable))]
        movable = None
    ids = [i for i, c in enumerate(covered) if c] or [0]
    used = _used_rows(model, names, params, settings, pair_params | {i for i, c in enumerate(covered) if not c},
                      batches, loss_fn)
    kept_sizes = [0 if not c else used[i].rows.numel() * (n // params[i].shape[0]) if i in used else n
                  for i, (n, c) in enumerate(zip(sizes, covered))]
    blocks = _remap(blocks, sizes, kept_sizes)
    base = [params[i].detach().index_select(0, used[i].rows) if i in used else params[i] for i in ids]
    dtype = torch.promote_types(torch.float32, max((p.dtype for p in base), key=lambda d: torch.finfo(d).bits))
    space = PerturbationSpace(base, blocks, settings.options or SpaceOptions(metric=None), movable, settings.seed,
                              workspace=Workspace.sized_for(sum(kept_sizes), dtype, base[0].device), segment_ids=ids)
    rows = {position: used[i] for position, i in enumerate(ids) if i in used}
    return space, Objective(model, [names[i] for i in ids], [params[i] for i in ids], space, loss_fn, settings.rho,
                            used_rows=rows)


def _used_rows(model: nn.Module, names: list[str], params: list[Tensor], settings: RunSettings, skip: set[int],
               batches: Mapping[int, Any], loss_fn: LossFn) -> dict[int, UsedRows]:
    """The embedding rows the batches (by index) look up, for the solver that starts at zero and follows the
    gradient (the clean worst case; AS23 and the Euclidean step normalisation read the global gradient, the average
    case draws every coordinate)."""
    if settings.mode != "worst" or settings.full_gradient:
        return {}
    weights = {i: p for i, p in enumerate(params) if i not in skip and p.dim() == 2}
    used = scan_used_rows(weights, _scan_forward(model, settings, batches, loss_fn, params[0].device))
    if used:
        logger.info("embedding rows held (the rest are never looked up): %s", ", ".join(
            f"{names[i]} {u.rows.numel():,} of {params[i].shape[0]:,}" for i, u in used.items()))
    return used


def _scan_forward(model: nn.Module, settings: RunSettings, batches: Mapping[int, Any], loss_fn: LossFn,
                  device: torch.device) -> Callable[[], None]:
    """Runs the model on every batch (by index), for the scan of embedding rows."""

    def forward() -> None:
        for index, batch in batches.items():
            with _measuring(settings.measure, index, batch):
                loss_fn(model, to_device(batch, device))

    return forward


def _pair_blocks(model: nn.Module, names: list[str], settings: RunSettings,
                 symmetry_map: SymmetryMap | None) -> list[PairBlock]:
    if settings.options is None or settings.options.metric is None:
        return []
    if symmetry_map is None:
        from ..symmetry import map_symmetries

        symmetry_map = map_symmetries(model, params=settings.params)
    if symmetry_map.param_names != names:
        raise ValueError(
            "The symmetry map was built for another model (parameter names differ); rebuild it with "
            "gs.map_symmetries(model)."
        )
    return symmetry_map.blocks


def _remap(blocks: list[PairBlock], sizes: list[int], kept_sizes: list[int]) -> list[PairBlock]:
    """The blocks whose parameters are all wholly kept, re-indexed into the concatenation of what the vector holds
    of each parameter (``kept_sizes``: 0 for a parameter left out, fewer than its size for an embedding's used rows;
    the blocks themselves when everything is kept: index maps are 8 bytes per pair coordinate)."""
    if kept_sizes == sizes:
        return blocks
    ends = torch.tensor(sizes).cumsum(0)
    removed = torch.tensor([n - k for n, k in zip(sizes, kept_sizes)])
    skipped = removed.cumsum(0) - removed
    keep = removed == 0
    out = []
    for b in blocks:
        owners = [torch.bucketize(i.cpu(), ends, right=True) for i in (b.G_index, b.H_index)]
        if all(bool(keep[o].all()) for o in owners):
            G, H = (i - skipped[o].to(i.device) for i, o in zip((b.G_index, b.H_index), owners))
            out.append(dataclasses.replace(b, G_index=G, H_index=H))
    return out


def _warn_half_precision(params: list[Tensor]) -> None:
    half = sorted({p.dtype for p in params if p.dtype in (torch.float16, torch.bfloat16)}, key=str)
    if half:
        warnings.warn(
            f"The model computes in {', '.join(map(str, half))}. The perturbation is built in float32 (the h x h "
            "algebra in float64) but the weights are rounded to the model's dtype for each forward pass, so "
            f"perturbations below its resolution (relative {max(torch.finfo(d).eps for d in half):.0e} per weight) "
            "vanish and loss differences are quantised: small rho can give exactly 0. Cast the model to float32 "
            "(model.float()) to measure it.",
            UserWarning,
            stacklevel=5,
        )


def _solve_batches(space: PerturbationSpace, objective: Objective, settings: RunSettings, batches: list[Any],
                   mine: Iterable[int], progress: bool) -> dict[int, tuple]:
    """``{batch index: (sharpness, clean loss, average-case samples or None, stationarity gap, steps used, why it is
    not certified or None)}``."""
    n_steps = settings.n_samples if settings.mode == "average" else settings.steps
    results: dict[int, tuple] = {}
    bar = tqdm(list(mine), desc=settings.measure, unit="batch", disable=not progress)
    for index in bar:
        objective.batch = to_device(batches[index], space.device)
        generator = torch.Generator().manual_seed(batch_seed(settings.seed, index))
        torch.manual_seed(batch_seed(settings.seed, index))  # the forked global RNG: random models repeat

        def on_step(k: int, sharpness: float) -> None:  # solver progress inside the batch bar
            bar.set_postfix(step=f"{k + 1}/{n_steps}", sharpness=f"{sharpness:.4g}", refresh=False)
            bar.refresh()

        with _measuring(settings.measure, index, batches[index]):
            out = solve(settings, space, objective, generator, on_step)
        samples = [loss - out.clean_loss for loss in out.losses[1:]] if settings.mode == "average" else None
        note = out.certificate(settings.tol, settings.starts) if settings.mode == "worst" else None
        results[index] = (out.sharpness, out.clean_loss, samples, out.gap, out.steps_used, note)
        bar.set_postfix(sharpness=f"{out.sharpness:.4g}")
    return results


@contextlib.contextmanager
def _measuring(measure: str, index: int, batch: Any) -> Iterator[None]:
    """Say in any exception which batch (and which of its inputs) was being measured."""
    try:
        yield
    except Exception as err:
        keys = ", ".join(map(str, batch)) if isinstance(batch, Mapping) else "-"
        err.add_note(f"hf_geosharp: raised while measuring batch {index} (inputs: {keys}) for {measure}.")
        raise


def _result(settings: RunSettings, ordered: list[tuple], world: int) -> SharpnessResult:
    per_batch, per_clean = [r[0] for r in ordered], [r[1] for r in ordered]
    config = {**settings.config(), "n_batches": len(ordered), "n_processes": world,
              "library": f"hf_geosharp {__version__}"}
    if settings.mode == "average":
        stderr, gap, note, steps_used = average_stderr([r[2] for r in ordered]), math.nan, None, None
    else:
        stderr, gap, steps_used = batch_stderr(per_batch), max(r[3] for r in ordered), max(r[4] for r in ordered)
        notes = [(i, r[5]) for i, r in enumerate(ordered) if r[5] is not None]
        note = None if not notes else f"batch {notes[0][0]}: {notes[0][1]}" + (
            f" (and {len(notes) - 1} more batch{'es' if len(notes) > 2 else ''})" if len(notes) > 1 else "")
        if note is not None:
            warn_not_converged(settings.measure, config, note, steps_used)
    return SharpnessResult(
        value=sum(per_batch) / len(per_batch), per_batch=per_batch, clean_loss=sum(per_clean) / len(per_clean),
        per_batch_clean_loss=per_clean, measure=settings.measure, config=config, stderr=stderr,
        converged=note is None, stationarity_gap=gap, convergence_note=note, steps_used=steps_used,
    )
