r"""Search the symmetry group for the element that makes adaptive sharpness as large or as small as possible.

The mathematics behind :func:`hf_geosharp.hide`, which applies the element found here with a function check. Attention's
GL(h) symmetries (``G -> G A^{-1}``, ``H -> H A^T`` for every head pair) leave the function unchanged; adaptive
sharpness is not invariant under them, and this search finds how far it moves.

It optimises a proxy that needs no forward pass per step. To first order, adaptive sharpness's worst case in the ball
``||delta / |w| ||_2 <= rho`` is ``rho * ||grad L (.) |w| ||_2`` (the norm of the gradient in the dual of the
elementwise metric, :mod:`~hf_geosharp.engine.geometry.elementwise`). Under the action the gradient moves covariantly,
``grad_G -> grad_G A^T`` and ``grad_H -> grad_H A^{-1}``, and every other coordinate keeps its weight and its
gradient, so the proxy at any transformed point follows from one gradient per batch at the original point. Each
``A = exp(X)`` comes from the Lie algebra (``X`` in the block's subalgebra when it has one), with
``||X||_2 <= log(condition) / 2`` so that ``A``'s condition number stays below ``condition``. Adam optimises ``log`` of
the batch-mean proxy over all ``X`` at once (maximised for ``"sharp"``, minimised for ``"flat"``). See
docs/hide_and_seek.md for why this moves the real measure, and by how much.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from torch import Tensor, nn

from ..symmetry.base import SymmetryMap
from ..symmetry.flat import flat_vector, pair_mask, parameters_in_order
from .geometry.lie import algebra_basis, algebra_elements
from .model_function.objective import LossFn, default_loss, preserved_model_state

logger = logging.getLogger(__name__)

#: ``"sharp"``: make the measure as large as the search finds; ``"flat"``: as small.
Target = Literal["flat", "sharp"]


class AdaptiveProxy:
    """The first-order adaptive worst case ``rho * ||grad L (.) |w| ||`` at any point of the orbit of ``w``, from one
    gradient per batch at ``w`` itself (taken here, with the model's state restored afterwards). It lives on the
    model's device, and so does the search that calls it.

    Args:
        model: the model at ``w`` (not changed).
        batches: the batches whose mean the proxy is (one gradient each).
        smap: the symmetry map: which coordinates the group moves.
        rho: the radius of the adaptive ball.
        loss_fn: ``loss_fn(model, batch) -> scalar``.
    """

    def __init__(self, model: nn.Module, batches: list, smap: SymmetryMap, rho: float, loss_fn: LossFn) -> None:
        params = parameters_in_order(model, smap)
        w = flat_vector(params)
        in_block = pair_mask(smap, len(w), w.device)
        self.rho, self.device = rho, w.device
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
        """Mean over batches of ``rho * ||grad (.) |w| ||`` at the point moved by ``A = exp(X)`` per pair
        (``xs``: one ``[k, h, h]`` float64 tensor per block); differentiable in ``xs``."""
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


@dataclass
class GroupSearchResult:
    """What :func:`search_group_element` found.

    Attributes:
        elements: one float64 ``[k, h, h]`` tensor per symmetry block: the ``A = exp(X)`` for each pair (the identity
            when no step beat the starting point).
        proxy_before, proxy_after: the proxy (mean over batches) at the original point and at ``elements``.
        max_condition: the largest condition number among ``elements``.
    """

    elements: list[Tensor] = field(repr=False)
    proxy_before: float
    proxy_after: float
    max_condition: float


def _improves(value: float, best: float, target: Target) -> bool:
    return value > best if target == "sharp" else value < best


def _adam_in_the_algebra(proxy: AdaptiveProxy, smap: SymmetryMap, target: Target, bound: float, steps: int,
                         lr: float, generator: torch.Generator) -> tuple[list[Tensor], float]:
    """One start: Adam on the Lie-algebra coordinates from a seeded random start, each pair's ``X`` projected back to
    ``||X||_2 <= bound`` after every step (so ``cond(exp(X)) <= exp(2 bound)``); returns the best ``X`` seen and its
    proxy."""
    coeffs, bases = [], []
    for block in smap.blocks:
        basis = algebra_basis(block.head_dim, block.lie_basis).to(proxy.device)
        # drawn on the CPU, so that a seed gives the same start on every device
        c = torch.randn(block.n_pairs, basis.shape[0], generator=generator, dtype=torch.float64).to(proxy.device)
        c *= 0.1 * bound / torch.linalg.matrix_norm(algebra_elements(c, basis), ord=2)[:, None]
        coeffs.append(c.requires_grad_(True))
        bases.append(basis)

    def xs() -> list[Tensor]:
        return [algebra_elements(c, b) for c, b in zip(coeffs, bases)]

    def project() -> None:
        with torch.no_grad():
            for c, b in zip(coeffs, bases):
                norms = torch.linalg.matrix_norm(algebra_elements(c, b), ord=2).clamp_min(1e-300)
                c.mul_((bound / norms).clamp(max=1.0)[:, None])

    sign = -1.0 if target == "sharp" else 1.0
    optimizer = torch.optim.Adam(coeffs, lr=lr)
    best: list[Tensor] = []
    best_value = math.nan
    for step in range(steps + 1):
        current = xs()
        value = proxy(current)
        v = float(value.detach())
        if not best or _improves(v, best_value, target):
            best, best_value = [x.detach().clone() for x in current], v
        if step == steps:
            break
        optimizer.zero_grad()
        (sign * value.log()).backward()
        optimizer.step()
        project()
    return best, best_value


def search_group_element(
    model: nn.Module,
    batches: Iterable[Any],
    smap: SymmetryMap,
    target: Target,
    *,
    rho: float,
    condition: float,
    search_steps: int,
    restarts: int,
    seed: int,
    lr: float | None = None,
    loss_fn: LossFn = default_loss,
) -> GroupSearchResult:
    """The group element, one ``A`` per pair of every block of ``smap``, that makes the first-order adaptive
    sharpness (:class:`AdaptiveProxy`) as large (``"sharp"``) or as small (``"flat"``) as the search finds; the model
    is not changed (apply the result with :func:`hf_geosharp.symmetry.group_action.apply_group_elements`).

    Args:
        model: the model (its state is restored after the gradients are taken).
        batches: what the proxy averages over (one gradient each).
        smap: the symmetry map (at least one block).
        target: ``"flat"`` or ``"sharp"``.
        rho: the radius of the adaptive ball.
        condition: the largest condition number allowed for each ``A``.
        search_steps: Adam steps per start (each costs a few matrix exponentials, no forward pass).
        restarts: seeded random starts; the best proxy wins (the identity if none beats it).
        seed: seeds the starts.
        lr: Adam's step (default ``log(condition) / 40``).
        loss_fn: ``loss_fn(model, batch) -> scalar`` (default ``model(**batch).loss``).
    """
    if target not in ("flat", "sharp"):
        raise ValueError(f"target must be 'flat' or 'sharp', got {target!r}.")
    if condition < 1.0 or not math.isfinite(condition):
        raise ValueError(f"condition must be a finite number >= 1, got {condition}.")
    if search_steps < 0 or restarts < 1:
        raise ValueError(f"search_steps must be >= 0 and restarts >= 1, got {search_steps} and {restarts}.")
    batches = list(batches)
    if not batches:
        raise ValueError("the group search needs at least one batch.")
    if not smap.blocks:
        raise ValueError("the model has no mapped attention symmetries: there is no group to move it along "
                         "(see `geosharp symmetry MODEL`).")
    bound = math.log(condition) / 2
    proxy = AdaptiveProxy(model, batches, smap, rho, loss_fn)
    identity = [torch.zeros(b.n_pairs, b.head_dim, b.head_dim, dtype=torch.float64, device=proxy.device)
                for b in smap.blocks]
    with torch.no_grad():
        proxy_before = float(proxy(identity))
    generator = torch.Generator().manual_seed(seed)
    best, best_value = identity, proxy_before
    for _ in range(restarts):
        xs, value = _adam_in_the_algebra(proxy, smap, target, bound, search_steps, lr or math.log(condition) / 40,
                                         generator)
        if _improves(value, best_value, target):
            best, best_value = xs, value
    elements = [torch.linalg.matrix_exp(x) for x in best]
    max_condition = max(float(torch.linalg.cond(a).max()) for a in elements)
    logger.info("group search (%s): proxy %.4g -> %.4g (max condition %.3g)", target, proxy_before, best_value,
                max_condition)
    return GroupSearchResult(elements, proxy_before, best_value, max_condition)
