"""``reparametrize``: apply a random element of the model's symmetry group in place (the universal probe).

If the map is right, the model computes exactly the same function afterwards while its weights have moved a lot;
any wrong index, orientation or group shows up as changed outputs.

Changing the weights is all-or-nothing: every new tensor is computed first, then they are copied in one block during
which Ctrl-C is held back; an exception or an interrupt during that block puts the original weights back, bit for
bit, before it propagates. So a model is either wholly transformed or exactly as it was.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

import torch
from torch import nn

from ..durable import held_interrupts
from ..engine.geometry.lie import random_group_element
from .base import SymmetryMap, renamed_map
from .flat import flat_vector, pair_mask, parameters_in_order
from .mapping import map_symmetries

logger = logging.getLogger(__name__)


def _copy(param: torch.Tensor, value: torch.Tensor) -> None:
    """One parameter's write (a separate function so that tests can interrupt the swap between writes)."""
    param.copy_(value)


def swap_parameters(params: Sequence[torch.Tensor], values: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Copy ``values`` into ``params`` all-or-nothing; returns the previous values (to undo it with another swap).

    An exception, or a Ctrl-C received while copying, restores every parameter to its previous value and then
    propagates (the interrupt as ``KeyboardInterrupt``)."""
    with torch.no_grad():
        previous = [p.detach().clone() for p in params]
        with held_interrupts() as received:
            try:
                for p, v in zip(params, values):
                    _copy(p, v)
            except BaseException:
                for p, v in zip(params, previous):
                    p.copy_(v)
                raise
            if received:
                for p, v in zip(params, previous):
                    p.copy_(v)
                raise KeyboardInterrupt
    return previous


def transformed_parameters(
    params: Sequence[nn.Parameter], smap: SymmetryMap, elements: Sequence[torch.Tensor]
) -> tuple[list[int], list[torch.Tensor]]:
    """The new values of the parameters that ``elements`` (one ``[k, h, h]`` per block) move: their positions in
    ``params`` and the tensors, computed in float64 on a flat copy and cast back; the model is not touched."""
    with torch.no_grad():
        flat = flat_vector(list(params))
        for block, a in zip(smap.blocks, elements):
            a_dev = a.to(device=flat.device, dtype=torch.float64)
            g_index, h_index = block.G_index.to(flat.device), block.H_index.to(flat.device)
            flat[g_index] = torch.linalg.solve(a_dev, flat[g_index], left=False)  # G A^{-1}
            flat[h_index] = flat[h_index] @ a_dev.mT  # H A^T
        moved = pair_mask(smap, len(flat), flat.device)
        positions, values = [], []
        for i, (p, offset) in enumerate(zip(params, smap.offsets)):
            if bool(moved[offset:offset + p.numel()].any()):
                positions.append(i)
                values.append(flat[offset:offset + p.numel()].view_as(p).to(p.dtype))
    return positions, values


def apply_group_elements(
    model: nn.Module, smap: SymmetryMap, elements: Sequence[torch.Tensor]
) -> Callable[[], None]:
    """Act with ``elements`` on ``model`` in place, all-or-nothing; returns ``undo()``, which puts the previous
    weights back (all-or-nothing too), for callers that check the result and may have to roll it back."""
    params = parameters_in_order(model, smap)
    positions, values = transformed_parameters(params, smap, elements)
    moved = [params[i] for i in positions]
    previous = swap_parameters(moved, values)

    def undo() -> None:
        swap_parameters(moved, previous)

    return undo


def random_group_elements(
    smap: SymmetryMap, *, seed: int, condition: float, scale: float = 1.0
) -> list[torch.Tensor]:
    """One seeded random element per pair of every block (float64 ``[k, h, h]``, in ``smap.blocks`` order), in the
    block's subgroup when it has a ``lie_basis``; see :func:`~hf_geosharp.engine.geometry.lie.random_group_element`."""
    generator = torch.Generator().manual_seed(seed)
    return [
        random_group_element(block.n_pairs, block.head_dim, lie_basis=block.lie_basis, scale=scale,
                             condition=condition, generator=generator)
        for block in smap.blocks
    ]


def reparametrize(
    model: nn.Module,
    seed: int = 0,
    scale: float = 1.0,
    condition: float = 10.0,
    symmetry_map: SymmetryMap | None = None,
    *,
    smap: SymmetryMap | None = None,
) -> list[torch.Tensor]:
    """Act on every pair with its own random group element: ``G <- G A^{-1}``, ``H <- H A^T``, in place.

    Args:
        model: the model to transform (its parameters are overwritten under ``torch.no_grad``, all-or-nothing).
        seed: seed of the random group elements.
        scale: overall size of each ``A`` (its singular values are ``scale * condition^{+-1/2}`` at the extremes).
        condition: condition number of each ``A``; larger moves the weights further from the original.
        symmetry_map: the map to use; default ``map_symmetries(model)``.
        smap: deprecated name of ``symmetry_map``.

    Returns:
        One float64 tensor ``[k, h, h]`` per block of the map's ``blocks`` (same order): the ``A`` applied to each pair.
        Blocks with a ``lie_basis`` get elements of that subgroup (e.g. the RoPE commutant).

    The arithmetic runs in float64 on a flat copy of the parameters (the model's size again, in float64), and the
    moved parameters are kept once more while they are swapped in (to restore them on an exception or Ctrl-C).
    """
    smap = renamed_map(symmetry_map, smap, "reparametrize")
    smap = map_symmetries(model) if smap is None else smap
    applied = random_group_elements(smap, seed=seed, condition=condition, scale=scale)
    apply_group_elements(model, smap, applied)
    logger.debug("reparametrized %d blocks (seed %d, condition %g)", len(applied), seed, condition)
    return applied
