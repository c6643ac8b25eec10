"""The model's flat parameter vector, as the :class:`SymmetryMap` indexes it (shared by the symmetry tools, ``hide``
and the engine's group search)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:  # base imports the report, which imports this module: no runtime import back
    from .base import SymmetryMap


def parameters_in_order(model: nn.Module, smap: SymmetryMap) -> list[nn.Parameter]:
    """The parameters behind ``smap``'s flat vector; raises if the map was built for a different model."""
    named = list(model.named_parameters())
    names, shapes = [n for n, _ in named], [tuple(p.shape) for _, p in named]
    if names != smap.param_names or shapes != [tuple(s) for s in smap.param_shapes]:
        raise ValueError(
            "the SymmetryMap does not match this model's parameters (names or shapes differ); build it with "
            "map_symmetries(model) for this very model."
        )
    return [p for _, p in named]


def flat_vector(params: list[nn.Parameter], dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """A detached copy of the flat parameter vector (on the first parameter's device)."""
    device = params[0].device if params else torch.device("cpu")
    return torch.cat([p.detach().reshape(-1).to(device=device, dtype=dtype) for p in params])


def pair_mask(smap: SymmetryMap, numel: int, device: torch.device) -> torch.Tensor:
    """``[numel]`` bool: the coordinates of the flat vector that some GL(h) pair of ``smap`` holds (the ones the group
    moves; every other coordinate keeps its value under the action)."""
    mask = torch.zeros(numel, dtype=torch.bool, device=device)
    for block in smap.blocks:
        mask[block.G_index.reshape(-1).to(device)] = True
        mask[block.H_index.reshape(-1).to(device)] = True
    return mask
