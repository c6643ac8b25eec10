"""Measuring an FSDP2-sharded model: each rank keeps its shard of the weights and of every solver vector.

Every rank takes part in every batch (FSDP's forward and backward are collective), so batches are not spread over
the ranks as in data-parallel runs. A rank may be given

* **the same batches as every other rank**: each rank computes the whole batch; memory is sharded, compute is not,
  and the number is the single-process number for any loss;
* **its own share of every batch** (e.g. what ``accelerate``'s prepared data loader yields): the batch's loss is the
  mean of the shares' losses weighted by their number of rows (examples), which is the whole batch's loss when the
  loss is a mean over examples (sequence classification); for a loss averaged over tokens, give the shares equal
  token counts. The gradient is scaled to match (FSDP averages gradients over the ranks).

Which of the two it is, is found out by comparing fingerprints of the batches across the ranks: shares that happen to
be identical give the same number either way.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .coordinates import pair_parameters
from .objective import LossFn, Objective, measured_parameters, refuse_reentrant_checkpointing
from .sharding import ShardedLayout
from .space import PerturbationSpace, SpaceOptions
from .symmetry.base import SymmetryMap
from .workspace import Workspace

logger = logging.getLogger(__name__)


class ShardedObjective(Objective):
    """The objective of :class:`~hf_geosharp.objective.Objective` on an FSDP2 model: the perturbed local shards are
    written into the flat buffer ``out``, which FSDP all-gathers from (``layout.serving``); each parameter's local
    gradient is copied over its perturbed weights after the reduce-scatter (``layout.stream_gradients``)."""

    def __init__(self, model: nn.Module, layout: ShardedLayout, space: PerturbationSpace, loss_fn: LossFn,
                 rho: float, shares: bool) -> None:
        super().__init__(model, [], [], space, loss_fn, rho)
        self.layout, self.shares = layout, shares
        dtypes = {b.dtype for b in layout.base()}
        self.served_dtype = dtypes.pop() if len(dtypes) == 1 else space.dtype
        self._served: Tensor | None = None  # a copy in the model's dtype, only for half-precision models

    def __call__(self, xi: Tensor, need_grad: bool, out: Tensor | None = None) -> tuple[float, Tensor | None]:
        out = self._buffer_for(out, need_grad)
        pullback = self.space.exp_point(xi, out, need_grad)
        served = out
        if self.served_dtype != out.dtype:
            self._served = torch.empty_like(out, dtype=self.served_dtype) if self._served is None else self._served
            served = self._served.copy_(out)
        with self.layout.serving(served), torch.set_grad_enabled(need_grad):
            loss = self.loss_fn(self.model, self.batch)
            if not isinstance(loss, Tensor) or loss.numel() != 1:
                raise TypeError("The loss must be a scalar tensor (a mean over the batch).")
            value, scale = self._batch_loss(loss)
            value = self._checked_value(torch.tensor(value, dtype=torch.float64), xi)
            if not need_grad:
                return value, None
            if not self.graph_checked:
                refuse_reentrant_checkpointing(loss)
                self.graph_checked = True
            with self.layout.stream_gradients(out):
                (loss * scale).backward()
        if pullback is not None:
            pullback(out)
        return value, out

    def _batch_loss(self, loss: Tensor) -> tuple[float, float]:
        """The batch's loss (over all shares) and the factor on this rank's loss that makes FSDP's average over the
        ranks the batch's gradient."""
        if not self.shares:
            return float(loss.detach()), 1.0
        rows = float(_rows(self.batch))
        total = self.layout.all_reduce(torch.tensor([float(loss.detach()) * rows, rows], dtype=torch.float64,
                                                    device=self.layout.device))
        value, n = float(total[0] / total[1]), float(total[1])
        return value, rows * self.layout.world / n


def _rows(batch: Any) -> int:
    """The number of examples in a batch: dimension 0 of its first tensor."""
    tensors = [v for v in (batch.values() if isinstance(batch, Mapping) else [batch]) if isinstance(v, Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("Under FSDP with per-rank shares of the batches, each batch must be a dict of tensors with "
                         "the examples along dimension 0 (or pass the same batches on every rank).")
    return tensors[0].shape[0]


def _fingerprint(batches: list[Any]) -> str:
    digest = hashlib.sha256()
    for batch in batches:
        items = sorted(batch.items()) if isinstance(batch, Mapping) else [("", batch)]
        for key, value in items:
            digest.update(str(key).encode())
            if isinstance(value, Tensor):
                digest.update(str((value.dtype, tuple(value.shape))).encode())
                digest.update(value.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
            else:
                digest.update(repr(value).encode())
    return digest.hexdigest()


def batches_are_shares(layout: ShardedLayout, batches: list[Any]) -> bool:
    """Whether the ranks were given different batches (their shares) rather than the same ones; refuses ranks that
    disagree on the number of batches (they would wait on each other forever)."""
    found: list[Any] = [None] * layout.world
    dist.all_gather_object(found, (len(batches), _fingerprint(batches)), group=layout.group)
    if len({n for n, _ in found}) > 1:
        raise ValueError(f"Under FSDP every rank must pass the same number of batches; got {[n for n, _ in found]}.")
    shares = len({f for _, f in found}) > 1
    logger.info("FSDP over %d ranks: %s", layout.world, "each rank has its share of every batch" if shares
                else "every rank has the same batches")
    return shares


def build_sharded(model: nn.Module, layout: ShardedLayout, settings: Any, blocks: list, loss_fn: LossFn,
                  batches: list[Any]) -> tuple[PerturbationSpace, ShardedObjective]:
    """The sharded space (this rank's shards as base point) and its objective (see the module docstring)."""
    if settings.full_gradient:
        raise ValueError("Under FSDP, adaptive_sharpness(variant='as23') and step_normalization='euclidean' are not "
                         "supported (they need global gradient norms); use the defaults (variant='clean').")
    names, params = measured_parameters(model)
    if names != layout.names:
        raise ValueError("The FSDP layout and the model's parameters disagree; shard every parameter with FSDP2.")
    movable = None
    if settings.params == "trainable":  # pairs on frozen weights stay still: they are measured elementwise (as 0)
        frozen = {i for i, p in enumerate(params) if not p.requires_grad}
        sizes = [shape.numel() for shape in layout.global_shapes]
        blocks = [b for b in blocks if not pair_parameters([b], sizes) & frozen]
        movable = torch.cat([torch.full((n,), p.requires_grad, dtype=torch.bool, device=layout.device)
                             for p, n in zip(params, layout.local_sizes)])
        if not bool(layout.all_reduce(movable.any().double().reshape(1))):
            raise ValueError("params='trainable' but no parameter has requires_grad=True; use params='all'.")
    else:
        for p in params:  # FSDP reduces gradients only for parameters that require them (restored afterwards)
            p.requires_grad_(True)
    base = layout.base()
    dtype = torch.promote_types(torch.float32, base[0].dtype)
    # the default workspace on every rank (not sized by the local shard): all ranks must cut the heads alike
    space = PerturbationSpace(base, blocks, settings.options or SpaceOptions(metric=None), movable, settings.seed,
                              workspace=Workspace(dtype, layout.device), shard=layout)
    return space, ShardedObjective(model, layout, space, loss_fn, settings.rho, batches_are_shares(layout, batches))


def check_symmetry_map(symmetry_map: SymmetryMap | None, layout: ShardedLayout) -> None:
    if symmetry_map is not None and symmetry_map.n_params != layout.global_numel:
        raise ValueError("The symmetry map was built for another model; map the unsharded model (or the sharded "
                         "one) with gs.map_symmetries(model).")
