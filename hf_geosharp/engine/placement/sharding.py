"""Sharding a model for a measurement with FSDP2 (``--fsdp``, ``compute(fsdp=True)``), and the placement that keeps
every attention row on one rank; the engine's view of the sharded model is
:mod:`hf_geosharp.engine.placement.fsdp_layout`."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .fsdp_layout import fsdp_modules

logger = logging.getLogger(__name__)

__all__ = ["attention_placement", "init_distributed", "is_sharded", "shard_model"]


def _blocks(model: nn.Module) -> list[nn.Module]:
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 1:
            return list(module)
    return []


def shard_model(
    model: nn.Module,
    mesh: Any | None = None,
    placement: Callable[[nn.Parameter], Any] | None = None,
) -> nn.Module:
    """FSDP2-shard ``model`` in place the way ``--fsdp`` does, and return it.

    The transformer blocks are taken to be the children of the first ``nn.ModuleList`` with at least one element
    met in ``model.modules()`` order (``encoder.layer`` in BERT, ``model.layers`` in Llama); each is one FSDP unit and
    the root takes the rest (embeddings, head, tied weights). ``mesh`` defaults to a 1-D mesh over the whole world
    from the environment (cuda when available, else cpu); ``placement`` is passed as ``shard_placement_fn``."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if mesh is None:
        device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if not dist.is_initialized():
            dist.init_process_group("nccl" if device_type == "cuda" else "gloo")
        if device_type == "cuda":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count())))
        mesh = init_device_mesh(device_type, (dist.get_world_size(),))
    blocks = _blocks(model)
    for block in blocks:
        fully_shard(block, mesh=mesh, shard_placement_fn=placement)
    fully_shard(model, mesh=mesh, shard_placement_fn=placement)
    logger.info("FSDP2: %d blocks and the root sharded over %d ranks", len(blocks), mesh.size())
    return model


def init_distributed() -> torch.device:
    """Join the launcher's process group as ``shard_model`` does (NCCL and this rank's GPU where CUDA is available,
    else gloo) and return this rank's device; faces call it before any collective of their own (gathering inputs,
    agreeing on an exit code). Raises ``RuntimeError`` outside a distributed launch (no ``RANK``/``WORLD_SIZE``).

    Returns:
        This rank's device.
    """
    if not dist.is_initialized():
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RuntimeError("no distributed launch found (RANK and WORLD_SIZE are not set); start the processes "
                               "with torchrun --nproc_per_node N (or accelerate launch)")  # fmt: skip
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    if not torch.cuda.is_available():
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank() % torch.cuda.device_count()))
    torch.cuda.set_device(local)
    return torch.device("cuda", local)


def is_sharded(model: nn.Module) -> bool:
    """Whether any module of ``model`` is an FSDP2 module (then the engine measures it sharded).

    Args:
        model: the model.

    Returns:
        ``True`` when some module of it is an FSDP2 module.
    """
    return bool(fsdp_modules(model))


def _row_dims(shape: torch.Size, coords: Tensor, rows: Tensor) -> set[int]:
    """The dimensions of a parameter of ``shape`` along which each pair row's entries (flat positions ``coords``
    in the parameter, row number ``rows``) share one coordinate: sharding on such a dimension keeps rows whole."""
    dims = set()
    for d in range(len(shape)):
        along = torch.div(coords, int(torch.Size(shape[d + 1 :]).numel()), rounding_mode="floor") % shape[d]
        low = torch.full((int(rows.max()) + 1,), shape[d], dtype=torch.int64).scatter_reduce(0, rows, along, "amin")
        high = torch.full_like(low, -1).scatter_reduce(0, rows, along, "amax")
        if bool(((low == high) | (high < 0)).all()):
            dims.add(d)
    return dims


def attention_placement(model: nn.Module, symmetry_map: Any) -> Callable[[nn.Parameter], Any]:
    """A ``placement`` for :func:`shard_model` that keeps the rows of every pair factor on one rank where it can.

    A pair row (an index along ``n`` of a ``[k, n, h]`` factor, across all heads) cut between ranks is assembled on
    every rank at every step. A parameter holding pair coordinates is sharded on the first dimension along which
    every row keeps one coordinate, when that is not FSDP's default dim 0: ``Shard(1)`` for q/k/v ``nn.Linear``
    weights (rows are input features). Call it on the unsharded model with the map built from it."""
    from torch.distributed.tensor import Shard

    named = list(model.named_parameters())
    if [n for n, _ in named] != symmetry_map.param_names:
        raise ValueError("The symmetry map was built for another model; map this one with gs.map_symmetries(model).")
    ends = torch.tensor(symmetry_map.offsets[1:] + [symmetry_map.n_params])
    ok: dict[int, set[int]] = {}
    for block in symmetry_map.blocks:
        for index in (block.G_index, block.H_index):
            flat = index.permute(1, 0, 2).reshape(index.shape[1], -1)
            rows = torch.arange(index.shape[1]).unsqueeze(1).expand_as(flat).reshape(-1)
            owner = torch.searchsorted(ends, flat.reshape(-1), right=True)
            for i in owner.unique().tolist():
                mine = owner == i
                coords = flat.reshape(-1)[mine] - symmetry_map.offsets[i]
                dims = _row_dims(torch.Size(symmetry_map.param_shapes[i]), coords, rows[mine])
                ok[i] = ok.get(i, dims) & dims
    chosen = {id(named[i][1]): min(dims) for i, dims in ok.items() if dims and 0 not in dims}
    logger.info("FSDP2 placement: %d pair weight(s) sharded on a dimension other than 0", len(chosen))
    return lambda p: Shard(chosen[id(p)]) if id(p) in chosen else None

