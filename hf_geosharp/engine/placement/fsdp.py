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

For the worst case, an embedding's rows that no rank's batches look up are left out, as in one process
(:mod:`hf_geosharp.engine.model_function.embedding_rows`): each rank holds the used rows of its shard, FSDP still
gathers the model's own shard of the weight, and the lookups read the used rows, assembled on every rank by one small
all-reduce.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...symmetry.base import SymmetryMap
from ..model_function.embedding_rows import RowLookup, UsedRows, rows_of_every_rank, scan_used_rows
from ..model_function.objective import LossFn, Objective, measured_parameters, refuse_reentrant_checkpointing
from ..space.coordinates import pair_parameters
from ..space.perturbation_space import PerturbationSpace, SpaceOptions
from ..space.workspace import Workspace
from .fsdp_layout import ShardedLayout

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HeldRows:
    """An embedding of which this rank holds only the used rows of its shard (see the module docstring)."""

    used: UsedRows  # the rows any rank's batches look up
    weight: Tensor  # the unsharded parameter that the model's lookups read
    slots: Tensor  # the positions, among ``used.rows``, of the rows in this rank's shard
    local: Tensor  # those rows' indices in this rank's padded shard
    width: int  # entries per row


class ShardedObjective(Objective):
    """The objective of :class:`~hf_geosharp.engine.model_function.objective.Objective` on an FSDP2 model: the perturbed
    local shards are written into the flat buffer ``out``, which FSDP all-gathers from (``layout.serving``); each
    parameter's local gradient is copied over its perturbed weights after the reduce-scatter
    (``layout.stream_gradients``). The embeddings in ``held`` (by parameter position) are served from the model's own
    shards and looked up in their perturbed used rows."""

    def __init__(self, model: nn.Module, layout: ShardedLayout, space: PerturbationSpace, loss_fn: LossFn,
                 rho: float, shares: bool, held: dict[int, HeldRows]) -> None:
        super().__init__(model, [], [], space, loss_fn, rho)
        self.layout, self.shares, self.held = layout, shares, held
        dtypes = {b.dtype for b in layout.base()}
        self.served_dtype = dtypes.pop() if len(dtypes) == 1 else space.dtype
        self._served: Tensor | None = None  # a copy in the model's dtype, only for half-precision models

    def __call__(self, xi: Tensor, need_grad: bool, out: Tensor | None = None) -> tuple[float, Tensor | None]:
        out = self._buffer_for(out, need_grad)
        pullback = self.space.exp_point(xi, out, need_grad)
        segments = out.split(self.layout.held_sizes)
        served = segments
        if self.served_dtype != out.dtype:
            self._served = torch.empty_like(out, dtype=self.served_dtype) if self._served is None else self._served
            served = self._served.copy_(out).split(self.layout.held_sizes)
        own = self.layout.base()
        shards = [own[i] if i in self.held else s for i, s in enumerate(served)]
        leaves = {i: segments[i].view(-1, h.width).clone().requires_grad_(need_grad) for i, h in self.held.items()}
        with self.layout.serving(shards), torch.set_grad_enabled(need_grad), self._lookups(leaves):
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
            with self.layout.stream_gradients([None if i in self.held else s for i, s in enumerate(segments)]):
                (loss * scale).backward()
        for i, leaf in leaves.items():  # the held rows' gradient, after the backward's all-reduce
            if leaf.grad is None:
                segments[i].zero_()
            else:
                segments[i].copy_(leaf.grad.reshape(-1))
        if pullback is not None:
            pullback(out)
        return value, out

    def _lookups(self, leaves: dict[int, Tensor]) -> contextlib.AbstractContextManager:
        """Lookups of the held embeddings read their perturbed used rows, gathered from every rank."""
        if not leaves:
            return contextlib.nullcontext()
        restricted = {}
        for i, leaf in leaves.items():
            held = self.held[i]
            rows = rows_of_every_rank(leaf.to(held.weight.dtype), held.slots, held.used.rows.numel(),
                                      self.layout.all_reduce, self.layout.world)
            restricted[id(held.weight)] = (held.used, rows)
        return RowLookup(restricted)

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
                  batches: list[Any], scan_forward: Callable[[], None]) -> tuple[PerturbationSpace, ShardedObjective]:
    """The sharded space (this rank's shards as base point) and its objective (see the module docstring);
    ``scan_forward`` runs the model on every batch of this rank, for the scan of embedding rows."""
    if settings.full_gradient:
        raise ValueError("Under FSDP, adaptive_sharpness(variant='as23') and step_normalization='euclidean' are not "
                         "supported (they need global gradient norms); use the defaults (variant='clean').")
    names, params = measured_parameters(model)
    if names != layout.names:
        raise ValueError("The FSDP layout and the model's parameters disagree; shard every parameter with FSDP2.")
    shares = batches_are_shares(layout, batches)
    sizes = [shape.numel() for shape in layout.global_shapes]
    if settings.params == "trainable":  # pairs on frozen weights stay still: they are measured elementwise (as 0)
        frozen = {i for i, p in enumerate(params) if not p.requires_grad}
        blocks = [b for b in blocks if not pair_parameters([b], sizes) & frozen]
    else:
        for p in params:  # FSDP reduces gradients only for parameters that require them (restored afterwards)
            p.requires_grad_(True)
    held = _held_rows(layout, settings, pair_parameters(blocks, sizes), scan_forward)
    layout.hold([h.local.numel() * h.width if (h := held.get(i)) else n for i, n in enumerate(layout.local_sizes)])
    movable = None
    if settings.params == "trainable":
        movable = torch.cat([torch.full((n,), p.requires_grad, dtype=torch.bool, device=layout.device)
                             for p, n in zip(params, layout.held_sizes)])
        if not bool(layout.all_reduce(movable.any().double().reshape(1))):
            raise ValueError("params='trainable' but no parameter has requires_grad=True; use params='all'.")
    base = [shard.view(-1, h.width).index_select(0, h.local).reshape(-1) if (h := held.get(i)) else shard
            for i, shard in enumerate(layout.base())]
    dtype = torch.promote_types(torch.float32, base[0].dtype)
    # the default workspace on every rank (not sized by the local shard): all ranks must cut the heads alike
    space = PerturbationSpace(base, blocks, settings.options or SpaceOptions(metric=None), movable, settings.seed,
                              workspace=Workspace(dtype, layout.device), shard=layout)
    return space, ShardedObjective(model, layout, space, loss_fn, settings.rho, shares, held)


def _held_rows(layout: ShardedLayout, settings: Any, pair_params: set[int],
               scan_forward: Callable[[], None]) -> dict[int, HeldRows]:
    """The embeddings sharded by rows (FSDP's default ``Shard(0)``) whose unused rows the worst case leaves out:
    the rows every rank's batches look up, and this rank's part of them."""
    if settings.mode != "worst":
        return {}
    candidates = [i for i, shape in enumerate(layout.global_shapes)
                  if len(shape) == 2 and i not in pair_params and layout.shard_dims[i] == 0]
    weights = layout.unsharded_weights(candidates)
    used = scan_used_rows(weights, scan_forward, reduce=layout.all_reduce)
    layout.reshard_all()
    held = {}
    for i, u in used.items():
        n_rows, width = layout.global_shapes[i]
        chunk = -(-n_rows // layout.world)  # rows per shard, as torch.chunk cuts them
        first = layout.rank * chunk
        mine = (u.rows >= first) & (u.rows < first + chunk)
        held[i] = HeldRows(u, weights[i], mine.nonzero().flatten(), u.rows[mine] - first, width)
    if held:
        logger.info("embedding rows held (the rest are never looked up): %s", ", ".join(
            f"{layout.names[i]} {h.used.rows.numel():,} of {layout.global_shapes[i][0]:,}" for i, h in held.items()))
    return held


def check_symmetry_map(symmetry_map: SymmetryMap | None, layout: ShardedLayout) -> None:
    if symmetry_map is not None and symmetry_map.n_params != layout.global_numel:
        raise ValueError("The symmetry map was built for another model; map the unsharded model (or the sharded "
                         "one) with gs.map_symmetries(model).")
