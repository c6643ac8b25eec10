r"""``hide``: move a model along its symmetry group to make a non-invariant sharpness measure look flat or sharp.

The paper's title in code. Attention's GL(h) symmetries (``G -> G A^{-1}``, ``H -> H A^T`` for every head pair)
leave the function unchanged, so any honest generalisation measure must not change either; adaptive sharpness does.
``hide`` searches the group for the element that moves adaptive sharpness the most, applies it in place, checks that
the outputs did not change, and reports the measure before and after (and geodesic sharpness, which stays put).

The search optimises a proxy that needs no forward pass per step. To first order, adaptive sharpness's worst case in
the ball ``||delta / |w| ||_2 <= rho`` is ``rho * ||grad L (.) |w| ||_2``. Under the action the gradient moves
covariantly, ``grad_G -> grad_G A^T`` and ``grad_H -> grad_H A^{-1}``, and every other coordinate keeps its weight
and its gradient, so the proxy at any transformed point follows from one gradient per batch at the original point.
Each ``A = exp(X)`` comes from the Lie algebra (``X`` in the block's subalgebra when it has one), with
``||X||_2 <= log(condition) / 2`` so that ``A``'s condition number stays below ``condition``. Adam optimises
``log`` of the batch-mean proxy over all ``X`` at once (maximised for ``"sharp"``, minimised for ``"flat"``). See
docs/hide_and_seek.md for why this moves the real measure, and by how much.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..engine.geometry.lie import random_group_element
from ..engine.model_function.objective import default_loss, preserved_model_state
from ..measures import Settings, run_measure
from ..symmetry import map_symmetries
from ..symmetry._flat import flat_vector, parameters_in_order
from ..symmetry.base import SymmetryMap
from ..symmetry.reparametrize import apply_group_elements

logger = logging.getLogger(__name__)

Target = Literal["flat", "sharp"]
LossFn = Callable[[nn.Module, Any], Tensor]
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
        """Everything but the tensors, for JSON."""
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
    scale = max(float(b.abs().max()) for b in before) or 1.0
    return max(float((a - b).abs().max()) for a, b in zip(after, before)) / scale


class _Proxy:
    """The first-order adaptive worst case at ``w(X)`` for every batch, from one gradient per batch at ``w``."""

    def __init__(self, model: nn.Module, batches: list, smap: SymmetryMap, rho: float, loss_fn: LossFn) -> None:
        params = parameters_in_order(model, smap)
        w = flat_vector(params)
        in_block = torch.zeros(len(w), dtype=torch.bool, device=w.device)
        for block in smap.blocks:
            in_block[block.G_index.reshape(-1).to(w.device)] = True
            in_block[block.H_index.reshape(-1).to(w.device)] = True
        self.rho = rho
        self.G = [w[b.G_index.to(w.device)] for b in smap.blocks]
        self.H = [w[b.H_index.to(w.device)] for b in smap.blocks]
        self.rest, self.gG, self.gH = [], [], []
        with preserved_model_state(model):
            for p in params:
                p.requires_grad_(True)
            for batch in batches:
                grads = torch.autograd.grad(loss_fn(model, batch), params, allow_unused=True)
                g = torch.cat([(torch.zeros_like(p) if gi is None else gi).detach().reshape(-1).double()
                               for p, gi in zip(params, grads)])
                self.rest.append(((g * w.abs())[~in_block] ** 2).sum())
                self.gG.append([g[b.G_index.to(w.device)] for b in smap.blocks])
                self.gH.append([g[b.H_index.to(w.device)] for b in smap.blocks])

    def __call__(self, xs: list[Tensor]) -> Tensor:
        """Mean over batches of ``rho * ||grad (.) |w| ||`` at the point moved by ``A = exp(X)`` per pair."""
        a = [torch.linalg.matrix_exp(x) for x in xs]
        a_inv = [torch.linalg.inv(ak) for ak in a]  # cheaper to differentiate than exp(-X); cond(A) is bounded
        G = [g @ ai for g, ai in zip(self.G, a_inv)]  # G A^{-1}
        H = [h @ ak.mT for h, ak in zip(self.H, a)]  # H A^T
        values = []
        for rest, gG, gH in zip(self.rest, self.gG, self.gH):
            total = rest
            for k in range(len(xs)):
                total = total + ((gG[k] @ a[k].mT) * G[k].abs()).square().sum()  # grad_G A^T
                total = total + ((gH[k] @ a_inv[k]) * H[k].abs()).square().sum()  # grad_H A^{-1}
            values.append(self.rho * total.sqrt())
        return torch.stack(values).mean()


def _search(proxy: _Proxy, smap: SymmetryMap, target: Target, bound: float, steps: int, lr: float,
            generator: torch.Generator) -> tuple[list[Tensor], float]:
    """Adam on the Lie-algebra coordinates from a seeded random start, each pair's ``X`` projected back to
    ``||X||_2 <= bound`` after every step (so ``cond(exp(X)) <= exp(2 bound)``); returns the best ``X`` seen and its
    proxy."""
    coeffs, bases = [], []
    for block in smap.blocks:
        h = block.head_dim
        basis = (torch.eye(h * h, dtype=torch.float64).view(h * h, h, h) if block.lie_basis is None
                 else block.lie_basis.to(torch.float64))
        c = torch.randn(block.n_pairs, basis.shape[0], generator=generator, dtype=torch.float64)
        c *= 0.1 * bound / torch.linalg.matrix_norm(torch.einsum("kb,bij->kij", c, basis), ord=2)[:, None]
        coeffs.append(c.requires_grad_(True))
        bases.append(basis)

    def xs() -> list[Tensor]:
        return [torch.einsum("kb,bij->kij", c, b) for c, b in zip(coeffs, bases)]

    def project() -> None:
        with torch.no_grad():
            for c, b in zip(coeffs, bases):
                norms = torch.linalg.matrix_norm(torch.einsum("kb,bij->kij", c, b), ord=2).clamp_min(1e-300)
                c.mul_((bound / norms).clamp(max=1.0)[:, None])

    sign = -1.0 if target == "sharp" else 1.0
    optimizer = torch.optim.Adam(coeffs, lr=lr)
    best: list[Tensor] = []
    best_value = math.nan
    for step in range(steps + 1):
        current = xs()
        value = proxy(current)
        v = float(value.detach())
        if not best or ((v > best_value) if target == "sharp" else (v < best_value)):
            best, best_value = [x.detach().clone() for x in current], v
        if step == steps:
            break
        optimizer.zero_grad()
        (sign * value.log()).backward()
        optimizer.step()
        project()
    return best, best_value


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
                    "the model was restored. Lower `condition`, or check the symmetry map with `geosharp symmetry "
                    "MODEL --audit`.")
        except BaseException:
            undo()
            raise
    return deviation, undo


def reparametrize_checked(
    model: nn.Module,
    batches: Iterable[Any],
    *,
    seed: int = 0,
    condition: float = 100.0,
    tolerance: float | None = None,
    loss_fn: LossFn | None = None,
    smap: SymmetryMap | None = None,
) -> tuple[list[Tensor], float]:
    """:func:`hf_geosharp.reparametrize` (a random group element, in place) with the probe of :func:`hide`: returns
    the applied elements and the relative output deviation; rolls back and raises :class:`FunctionChangedError`
    when the outputs moved by more than ``tolerance`` (default ``sqrt(eps)`` of the weights' dtype)."""
    smap = map_symmetries(model) if smap is None else smap
    generator = torch.Generator().manual_seed(seed)
    elements = [random_group_element(b.n_pairs, b.head_dim, lie_basis=b.lie_basis, condition=condition,
                                     generator=generator) for b in smap.blocks]
    deviation, _ = _checked_apply(model, list(batches), smap, elements, tolerance, loss_fn)
    return elements, deviation


def hide(
    model: nn.Module,
    batches: Iterable[Any],
    target: Target = "sharp",
    measure: str = "adaptive",
    *,
    condition: float = 100.0,
    search_steps: int = 100,
    restarts: int = 1,
    seed: int = 0,
    lr: float | None = None,
    settings: Settings | None = None,
    evaluate: bool = True,
    geodesic: bool = False,
    tolerance: float | None = None,
    loss_fn: LossFn | None = None,
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
        smap: the symmetry map (default ``map_symmetries(model)``).

    Returns:
        A :class:`HideResult`. On any exception or Ctrl-C the model is exactly as before.
    """
    if target not in ("flat", "sharp"):
        raise ValueError(f"target must be 'flat' or 'sharp', got {target!r}.")
    if measure not in TARGETABLE:
        raise ValueError(f"hide can move {sorted(TARGETABLE)}, not {measure!r}; geodesic sharpness is invariant "
                         "(that is the point), so there is nothing to hide from it.")
    if condition < 1.0 or not math.isfinite(condition):
        raise ValueError(f"condition must be a finite number >= 1, got {condition}.")
    if search_steps < 0 or restarts < 1:
        raise ValueError(f"search_steps must be >= 0 and restarts >= 1, got {search_steps} and {restarts}.")
    batches = list(batches)
    if not batches:
        raise ValueError("hide needs at least one batch.")
    settings = Settings() if settings is None else settings
    smap = map_symmetries(model) if smap is None else smap
    if not smap.blocks:
        raise ValueError("the model has no mapped attention symmetries: there is no group to move it along "
                         "(see `geosharp symmetry MODEL`).")
    loss = default_loss if loss_fn is None else loss_fn
    bound = math.log(condition) / 2

    proxy = _Proxy(model, batches, smap, settings.rho, loss)
    identity = [torch.zeros(b.n_pairs, b.head_dim, b.head_dim, dtype=torch.float64) for b in smap.blocks]
    with torch.no_grad():
        proxy_before = float(proxy(identity))
    generator = torch.Generator().manual_seed(seed)
    best, best_value = identity, proxy_before
    for _ in range(restarts):
        xs, value = _search(proxy, smap, target, bound, search_steps, lr or math.log(condition) / 40, generator)
        if (value > best_value) if target == "sharp" else (value < best_value):
            best, best_value = xs, value
    elements = [torch.linalg.matrix_exp(x) for x in best]
    max_condition = max(float(torch.linalg.cond(a).max()) for a in elements)
    logger.info("hide(%s): proxy %.4g -> %.4g (max condition %.3g)", target, proxy_before, best_value, max_condition)

    options = {"progress": False} if loss_fn is None else {"progress": False, "loss_fn": loss_fn}
    before: dict[str, float] = {}
    if evaluate:
        before["value"] = run_measure(TARGETABLE[measure], model, batches, settings, **options).value
    if geodesic:
        before["geodesic"] = run_measure("geodesic_sharpness_inv", model, batches, settings, symmetry_map=smap,
                                         **options).value
    deviation, undo = _checked_apply(model, batches, smap, elements, tolerance, loss_fn)
    result = HideResult(target, measure, elements, max_condition, proxy_before, best_value,
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
