r"""``hide``: move a model along its symmetry group to make a non-invariant sharpness measure look flat or sharp.

The paper's title in code. Attention's GL(h) symmetries (``G -> G A^{-1}``, ``H -> H A^T`` for every head pair)
leave the function unchanged, so any honest generalisation measure must not change either; adaptive sharpness does.
``hide`` asks the engine's group search (:func:`hf_geosharp.engine.symmetry_search.search_group_element`, which
optimises a first-order proxy of adaptive sharpness over the Lie algebra) for the element that moves adaptive
sharpness the most, applies it in place, checks that the outputs did not change, and reports the measure before and
after (and geodesic sharpness, which stays put). See docs/hide_and_seek.md.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..engine.model_function.objective import LossFn, default_loss, preserved_model_state
from ..engine.result import setting
from ..engine.symmetry_search import Target, search_group_element
from ..measures import Settings, run_measure
from ..symmetry import map_symmetries
from ..symmetry.base import SymmetryMap, renamed_map
from ..symmetry.group_action import apply_group_elements, random_group_elements

logger = logging.getLogger(__name__)

#: The largest condition number of an applied group element unless told otherwise (random or searched).
DEFAULT_CONDITION = 100.0
#: The non-invariant measures ``hide`` can target, with the bundle key it evaluates before and after.
TARGETABLE = {"adaptive": "adaptive_sharpness"}


class FunctionChangedError(RuntimeError):
    """The transformed model's outputs differ from the original's by more than the tolerance (it was rolled back)."""


@dataclass
class HideResult:
    """What :func:`hide` applied and what it changed.

    Attributes:
        target: ``"flat"`` or ``"sharp"``.
        measure: the targeted measure (``"adaptive"``).
        elements: one float64 ``[k, h, h]`` tensor per symmetry block: the ``A`` applied to each pair.
        max_condition: the largest condition number among the applied ``A``.
        proxy_before, proxy_after: the first-order proxy ``rho * ||grad L (.) |w| ||`` (mean over batches).
        value_before, value_after: the real measure (bundle defaults unless ``settings`` were given); NaN when not
            evaluated.
        geodesic_before, geodesic_after: geodesic sharpness (inv) when asked for, else NaN.
        max_output_deviation: the probe: max |outputs after - before| / max |outputs before| over the batches.
        seed: the seed of the search.
    """

    target: str
    measure: str
    elements: list[Tensor] = field(repr=False)
    max_condition: float
    proxy_before: float
    proxy_after: float
    value_before: float = math.nan
    value_after: float = math.nan
    geodesic_before: float = math.nan
    geodesic_after: float = math.nan
    max_output_deviation: float = math.nan
    seed: int = 0

    @property
    def factor(self) -> float:
        """``value_after / value_before`` (the proxy's ratio when the real measure was not evaluated)."""
        if math.isnan(self.value_before):
            return self.proxy_after / self.proxy_before
        return self.value_after / self.value_before

    def to_dict(self) -> dict[str, Any]:
        """The result as plain data.

        Returns:
            Everything but the group elements' tensors, with ``factor``, JSON-ready.
        """
        return {k: v for k, v in self.__dict__.items() if k != "elements"} | {"factor": self.factor}


def _outputs(model: nn.Module, batches: list, loss_fn: LossFn | None) -> list[Tensor]:
    """What the probe compares: the logits (or first output) and the loss of every batch, in float64."""
    out = []
    with torch.no_grad():
        for batch in batches:
            if loss_fn is not None:
                out.append(loss_fn(model, batch).detach().double().reshape(-1))
                continue
            result = model(**batch)
            logits = getattr(result, "logits", None)
            parts = [result[0] if logits is None else logits, getattr(result, "loss", None)]
            out.append(torch.cat([t.detach().double().reshape(-1) for t in parts if t is not None]))
    return out


def _deviation(before: list[Tensor], after: list[Tensor]) -> float:
    """The probe's number: the largest change of any output, relative to the largest output before."""
    scale = max(float(b.abs().max()) for b in before) or 1.0
    return max(float((a - b).abs().max()) for a, b in zip(after, before)) / scale


def _checked_apply(model: nn.Module, batches: list, smap: SymmetryMap, elements: list[Tensor],
                   tolerance: float | None, loss_fn: LossFn | None) -> tuple[float, Callable[[], None]]:
    """Apply ``elements`` all-or-nothing and run the probe; rolls back and raises if the outputs moved."""
    dtype = next(model.parameters()).dtype
    tolerance = math.sqrt(torch.finfo(dtype).eps) if tolerance is None else tolerance
    with preserved_model_state(model):
        reference = _outputs(model, batches, loss_fn)
        undo = apply_group_elements(model, smap, elements)
        try:
            deviation = _deviation(reference, _outputs(model, batches, loss_fn))
            if not deviation <= tolerance:
                raise FunctionChangedError(
                    f"the transformed model's outputs moved by {deviation:.3g} (relative) > tolerance {tolerance:.3g}; "
                    f"the model was restored. Lower {setting('condition')}, or check the symmetry map with "
                    "`geosharp symmetry MODEL --audit`.")
        except BaseException:
            undo()
            raise
    return deviation, undo


def reparametrize_checked(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    seed: int = 0,
    condition: float = DEFAULT_CONDITION,
    tolerance: float | None = None,
    loss_fn: LossFn | None = None,
    symmetry_map: SymmetryMap | None = None,
    smap: SymmetryMap | None = None,
) -> tuple[list[Tensor], float]:
    """:func:`hf_geosharp.reparametrize` (a random group element, in place) with the probe of :func:`hide`: returns
    the applied elements and the relative output deviation; rolls back and raises :class:`FunctionChangedError`
    when the outputs moved by more than ``tolerance`` (default ``sqrt(eps)`` of the weights' dtype); ``smap=`` is
    the deprecated name of ``symmetry_map=``.

    Args:
        model: the model, moved in place.
        batches: the inputs the function check compares the outputs on.
        seed: seeds the random group element.
        condition: the element's condition number.
        tolerance: the largest relative output deviation accepted (``None``: ``sqrt(eps)`` of the weights' dtype).
        loss_fn: ``loss_fn(model, batch)`` instead of the model's own loss.
        symmetry_map: the model's symmetry map (default: mapped here).
        smap: deprecated name of ``symmetry_map``.

    Returns:
        The applied group elements and the relative output deviation.
    """
    smap = renamed_map(symmetry_map, smap, "reparametrize_checked")
    smap = map_symmetries(model) if smap is None else smap
    elements = random_group_elements(smap, seed=seed, condition=condition)
    deviation, _ = _checked_apply(model, list(batches), smap, elements, tolerance, loss_fn)
    return elements, deviation


def hide(
    model: nn.Module,
    batches: Iterable[Any],
    target: Target = "sharp",
    measure: str = "adaptive",
    *,
    condition: float = DEFAULT_CONDITION,
    search_steps: int = 100,
    restarts: int = 1,
    seed: int = 0,
    lr: float | None = None,
    settings: Settings | None = None,
    evaluate: bool = True,
    geodesic: bool = False,
    tolerance: float | None = None,
    loss_fn: LossFn | None = None,
    symmetry_map: SymmetryMap | None = None,
    smap: SymmetryMap | None = None,
) -> HideResult:
    """Apply, in place, the symmetry element that makes ``measure`` as small (``"flat"``) or large (``"sharp"``) as
    the search finds, without changing the model's function.

    Args:
        model: the model (its weights change in place, all-or-nothing; modes, ``requires_grad`` and ``.grad`` are
            kept).
        batches: dicts the model accepts as ``model(**batch)`` with labels (or anything, with ``loss_fn``): the
            proxy's gradients, the probe and the measurements use them.
        target: ``"flat"`` or ``"sharp"``.
        measure: the measure to move; ``"adaptive"`` (either variant: both have the same first-order worst case).
        condition: the largest condition number allowed for each pair's ``A``.
        search_steps: Adam steps per restart (each costs a few matrix exponentials, no forward pass).
        restarts: seeded random starts; the best proxy wins.
        seed: seeds the starts.
        lr: Adam's step (default ``log(condition) / 40``).
        settings: the measurement settings (rho included) for the proxy and for ``value_before/after``.
        evaluate: measure the real ``measure`` before and after (costs two measurements).
        geodesic: also measure geodesic sharpness (inv) before and after.
        tolerance: the probe's bound on the relative output deviation (default ``sqrt(eps)`` of the weights' dtype:
            ~1.5e-8 in float64, ~3.5e-4 in float32); above it the model is rolled back and
            :class:`FunctionChangedError` raised.
        loss_fn: ``loss_fn(model, batch) -> scalar`` instead of ``model(**batch).loss``.
        symmetry_map: the symmetry map (default ``map_symmetries(model)``).
        smap: deprecated name of ``symmetry_map``.

    Returns:
        A :class:`HideResult`. On any exception or Ctrl-C the model is exactly as before.
    """
    if measure not in TARGETABLE:
        raise ValueError(f"hide can move {sorted(TARGETABLE)}, not {measure!r}; geodesic sharpness is invariant "
                         "(that is the point), so there is nothing to hide from it.")
    batches = list(batches)
    settings = Settings() if settings is None else settings
    smap = renamed_map(symmetry_map, smap, "hide")
    smap = map_symmetries(model) if smap is None else smap
    found = search_group_element(model, batches, smap, target, rho=settings.rho, condition=condition,
                                 search_steps=search_steps, restarts=restarts, seed=seed, lr=lr,
                                 loss_fn=default_loss if loss_fn is None else loss_fn)

    options = {"progress": False} if loss_fn is None else {"progress": False, "loss_fn": loss_fn}
    before: dict[str, float] = {}
    if evaluate:
        before["value"] = run_measure(TARGETABLE[measure], model, batches, settings, **options).value
    if geodesic:
        before["geodesic"] = run_measure("geodesic_sharpness_inv", model, batches, settings, symmetry_map=smap,
                                         **options).value
    deviation, undo = _checked_apply(model, batches, smap, found.elements, tolerance, loss_fn)
    result = HideResult(target, measure, found.elements, found.max_condition, found.proxy_before, found.proxy_after,
                        max_output_deviation=deviation, seed=seed, **{f"{k}_before": v for k, v in before.items()})
    try:
        if evaluate:
            result.value_after = run_measure(TARGETABLE[measure], model, batches, settings, **options).value
        if geodesic:
            result.geodesic_after = run_measure("geodesic_sharpness_inv", model, batches, settings,
                                                symmetry_map=smap, **options).value
    except BaseException:
        undo()
        raise
    return result
