"""The one builder: the perturbation space and the objective of a model, for any placement.

:func:`build` decides, once, what the engine's vector holds of each parameter (a
:class:`~hf_geosharp.engine.placement.base.Holding`): the parameters that can move (all of them for a solver that
reads the global gradient), and of an embedding that only lookups read, the rows the batches use (the clean worst
case only: :mod:`hf_geosharp.engine.model_function.embedding_rows`). The placement it is given (one process, or this
rank of an FSDP2 model) realises that decision; the space and the objective are then the same for every placement.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch import Tensor, nn

from ..symmetry.base import PairBlock, SymmetryMap
from .model_function.embedding_rows import UsedRows, scan_used_rows
from .model_function.objective import LossFn, Objective, measured_parameters, to_device
from .placement.base import Holding, Placement
from .result import has_option, setting, warn_at_caller
from .settings import RunSettings
from .space.coordinates import pair_parameters
from .space.perturbation_space import PerturbationSpace, SpaceOptions

logger = logging.getLogger(__name__)


def build(
    model: nn.Module, settings: RunSettings, placement: Placement, loss_fn: LossFn, batches: Mapping[int, Any],
    symmetry_map: SymmetryMap | None = None,
) -> tuple[PerturbationSpace, Objective]:
    """The space over what the vector holds (see the module docstring) and its objective; ``batches`` (by index) are
    the ones this process solves, which the scan of embedding rows runs the model on. Call it inside
    :func:`~hf_geosharp.engine.model_function.objective.preserved_model_state`."""
    names, params = measured_parameters(model)
    blocks = _pair_blocks(model, names, settings, symmetry_map)
    sizes = [p.numel() for p in params]  # of a sharded parameter, the global size
    pair_params = pair_parameters(blocks, sizes)
    trainable = [settings.params == "all" or p.requires_grad for p in params]
    if not any(trainable):
        raise ValueError("params='trainable' but no parameter has requires_grad=True; use params='all'.")
    placement.prepare(settings, params, list(batches.values()))
    covered = list(range(len(params))) if settings.full_gradient else placement.covered(params, trainable, pair_params)
    covered = covered or [0]
    moving = {i for i in covered if trainable[i]}
    if pair_params - moving:  # pairs on weights that stay still are measured elementwise (as 0)
        blocks = [b for b in blocks if pair_parameters([b], sizes) <= moving]
    candidates = [i for i in covered if i not in pair_params and params[i].dim() == 2]
    rows = _used_rows(model, names, params, settings, placement, candidates, batches, loss_fn)
    base, blocks = placement.hold(Holding(names, params, covered, rows), blocks)
    _warn_half_precision(params, settings.rho, sum(
        rows[i].rows.numel() * params[i].shape[1] if i in rows else sizes[i] for i in moving))
    movable = None if all(trainable[i] for i in covered) else torch.cat(
        [torch.full((b.numel(),), trainable[i], dtype=torch.bool) for i, b in zip(covered, base)]).to(base[0].device)
    dtype = torch.promote_types(torch.float32, max((b.dtype for b in base), key=lambda d: torch.finfo(d).bits))
    space = PerturbationSpace(base, blocks, settings.options or SpaceOptions(metric=None), movable, settings.seed,
                              workspace=placement.workspace(sum(b.numel() for b in base), dtype),
                              shard=placement.shard, segment_ids=covered)
    return space, Objective(model, space, placement, loss_fn, settings.rho)


def _used_rows(model: nn.Module, names: list[str], params: list[Tensor], settings: RunSettings, placement: Placement,
               candidates: list[int], batches: Mapping[int, Any], loss_fn: LossFn) -> dict[int, UsedRows]:
    """The embedding rows the batches (by index; of every process that shares the vectors) look up in the weights at
    ``candidates``, for the solver that starts at zero and follows the gradient (the clean worst case; AS23 and the
    Euclidean step normalisation read the global gradient, the average case draws every coordinate)."""
    if settings.mode != "worst" or settings.full_gradient:
        return {}
    forward = _scan_forward(model, settings, batches, loss_fn, placement.device)
    with placement.looked_up(candidates) as weights:
        used = scan_used_rows(weights, forward, reduce=placement.all_reduce)
    if used:
        logger.info("embedding rows held (the rest are never looked up): %s", ", ".join(
            f"{names[i]} {u.rows.numel():,} of {params[i].shape[0]:,}" for i, u in used.items()))
    return used


def _scan_forward(model: nn.Module, settings: RunSettings, batches: Mapping[int, Any], loss_fn: LossFn,
                  device: torch.device) -> Callable[[], None]:
    """Runs the model on every batch (by index), for the scan of embedding rows."""

    def forward() -> None:
        for index, batch in batches.items():
            with measuring(settings.measure, index, batch):
                loss_fn(model, to_device(batch, device))

    return forward


def _pair_blocks(model: nn.Module, names: list[str], settings: RunSettings,
                 symmetry_map: SymmetryMap | None) -> list[PairBlock]:
    """The symmetry map's pair blocks for a geodesic metric (the map built here when none was given), else none."""
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


def _warn_half_precision(params: list[Tensor], rho: float, moving: int) -> None:
    """Warn where a half-precision model's rounding swallows the perturbation: the solver's vectors are float32 and
    the model computes at its weights plus the perturbation rounded to its dtype, where a relative change below
    ``eps / 4`` always rounds back (half a unit in the last place is between ``eps / 4`` and ``eps / 2`` of a weight).
    A point of the ball moves a weight by ``rho`` of itself at most (the whole radius on one coordinate) and a typical
    one by ``rho / sqrt(n)`` (``n`` the ``moving`` weights); below ``eps / 4`` most of the perturbation vanishes."""
    half = [d for d in (torch.bfloat16, torch.float16) if any(p.dtype == d for p in params)]
    if not half or moving == 0:
        return
    dtype = max(half, key=lambda d: torch.finfo(d).eps)
    name, cut = str(dtype).removeprefix("torch."), torch.finfo(dtype).eps / 4
    typical = rho / math.sqrt(moving)
    if typical >= cut:
        return
    fix = "pass --dtype float32" if has_option("--dtype") else "cast the model to float32 (model.float())"
    rho_word = setting("rho")
    if rho < cut:
        what = (f"every weight moves by at most rho = {rho:.2g} of itself, below {name}'s rounding (a relative change "
                f"under {cut:.2g} rounds back to the weight): the whole ball rounds back to the model's weights, and "
                "the value is 0 or rounding")
    else:
        what = (f"a point of the ball moves a typical one of its {moving:,} perturbed weights by rho / sqrt(n) = "
                f"{typical:.2g} of itself, below {name}'s rounding (a relative change under {cut:.2g} rounds back "
                "to the weight): most of the perturbation vanishes in the model's forward, and the value measures "
                "the weights that move")
    warn_at_caller(
        f"The model computes in {dtype} and {what}. To measure the whole perturbation, {fix}, or pass a larger "
        f"{rho_word} (at least {cut * math.sqrt(moving):.2g} here). The solver's vectors and certificate are float32 "
        f"either way, and the certificate judges loss differences against {name}'s resolution.",
        UserWarning,
    )


@contextlib.contextmanager
def measuring(measure: str, index: int, batch: Any) -> Iterator[None]:
    """Say in any exception which batch (and which of its inputs) was being measured."""
    try:
        yield
    except Exception as err:
        keys = ", ".join(map(str, batch)) if isinstance(batch, Mapping) else "-"
        err.add_note(f"hf_geosharp: raised while measuring batch {index} (inputs: {keys}) for {measure}.")
        raise
