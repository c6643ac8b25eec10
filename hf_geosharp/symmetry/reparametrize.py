"""``reparametrize``: apply a random element of the model's symmetry group in place (the universal probe).

If the map is right, the model computes exactly the same function afterwards while its weights have moved a lot;
any wrong index, orientation or group shows up as changed outputs.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from ..geometry.lie import random_group_element
from ._flat import flat_vector, parameters_in_order
from .base import SymmetryMap
from .mapping import map_symmetries

logger = logging.getLogger(__name__)


def reparametrize(
    model: nn.Module,
    seed: int = 0,
    scale: float = 1.0,
    condition: float = 10.0,
    smap: SymmetryMap | None = None,
) -> list[torch.Tensor]:
    """Act on every pair with its own random group element: ``G <- G A^{-1}``, ``H <- H A^T``, in place.

    Args:
        model: the model to transform (its parameters are overwritten under ``torch.no_grad``).
        seed: seed of the random group elements.
        scale: overall size of each ``A`` (its singular values are ``scale * condition^{+-1/2}`` at the extremes).
        condition: condition number of each ``A``; larger moves the weights further from the original.
        smap: the map to use; default ``map_symmetries(model)``.

    Returns:
        One float64 tensor ``[k, h, h]`` per block of ``smap.blocks`` (same order): the ``A`` applied to each pair.
        Blocks with a ``lie_basis`` get elements of that subgroup (e.g. the RoPE commutant).

    The arithmetic runs in float64 on a flat copy of the parameters (the model's size again, in float64).
    """
    smap = map_symmetries(model) if smap is None else smap
    params = parameters_in_order(model, smap)
    generator = torch.Generator().manual_seed(seed)
    applied: list[torch.Tensor] = []
    with torch.no_grad():
        flat = flat_vector(params)
        for block in smap.blocks:
            a = random_group_element(block.n_pairs, block.head_dim, lie_basis=block.lie_basis, scale=scale,
                                     condition=condition, generator=generator)
            a_dev = a.to(flat.device)
            g_index, h_index = block.G_index.to(flat.device), block.H_index.to(flat.device)
            flat[g_index] = torch.linalg.solve(a_dev, flat[g_index], left=False)  # G A^{-1}
            flat[h_index] = flat[h_index] @ a_dev.mT  # H A^T
            applied.append(a)
        for p, offset in zip(params, smap.offsets):
            p.copy_(flat[offset:offset + p.numel()].view_as(p))
    logger.debug("reparametrized %d blocks (seed %d, condition %g)", len(applied), seed, condition)
    return applied
