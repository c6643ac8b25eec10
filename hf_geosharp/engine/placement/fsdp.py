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
import functools
import hashlib
import logging
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ...symmetry.base import PairBlock
from ..model_function.embedding_rows import RowLookup, UsedRows, rows_of_every_rank
from ..settings import RunSettings
from ..solvers.memory import device_free_bytes, workspace_room
from ..space.workspace import Workspace
from .base import Backward, Holding
from .fsdp_layout import ShardedLayout, fsdp_state

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _ShardRows:
    """An embedding held by its used rows, on this rank: the used rows of its shard."""

    used: UsedRows  # the rows any rank's batches look up
    weight: Tensor  # the unsharded parameter that the model's lookups receive
    slots: Tensor  # the positions, among ``used.rows``, of the rows in this rank's shard
    local: Tensor  # those rows' indices in this rank's padded shard
    width: int  # entries per row

    @classmethod
    def of(cls, used: UsedRows, weight: Tensor, layout: ShardedLayout, i: int) -> _ShardRows:
        n_rows, width = layout.global_shapes[i]
        chunk = -(-n_rows // layout.world)  # rows per shard, as torch.chunk cuts them
        first = layout.rank * chunk
        mine = (used.rows >= first) & (used.rows < first + chunk)
        return cls(used, weight, mine.nonzero().flatten(), used.rows[mine] - first, width)


class FsdpPlacement:
    """An FSDP2-sharded model (see the module docstring): the engine's vector holds this rank's padded shards
    (:class:`~hf_geosharp.engine.placement.fsdp_layout.ShardedLayout`), FSDP gathers the perturbed ones, and every
    sum is taken over the ranks."""

    def __init__(self, model: nn.Module, layout: ShardedLayout) -> None:
        self.model, self.layout = model, layout
        self.rank, self.world, self.shard = layout.rank, layout.world, layout
        self.where = f" on this rank of {layout.world}"
        self.shares = False  # whether each rank was given its share of every batch (see ``prepare``)
        self.holding: Holding | None = None
        self._rows: dict[int, _ShardRows] = {}
        self._served_dtype: torch.dtype | None = None
        self._served: Tensor | None = None  # a copy in the model's dtype, only for half-precision models

    @classmethod
    def of(cls, model: nn.Module) -> FsdpPlacement | None:
        """The placement of ``model`` when it has FSDP2 modules (see ``fsdp_state`` for what is refused), else None."""
        layout = fsdp_state(model)
        return None if layout is None else cls(model, layout)

    @property
    def device(self) -> torch.device:
        """This rank's device on the FSDP mesh."""
        return self.layout.device

    def batches(self, n_batches: int) -> range:
        """Every batch: FSDP's forward and backward are collective, so every rank takes part in each."""
        return range(n_batches)

    def collect(self, results: dict[int, Any]) -> dict[int, Any]:
        """This rank's results: every rank solved every batch together."""
        return results

    def prepare(self, settings: RunSettings, params: list[Tensor], batches: list[Any]) -> None:
        """Refuse the solvers that need global gradient norms, find out whether the ranks hold shares of the
        batches, and have FSDP reduce every parameter's gradient under ``params="all"`` (FSDP reduces only those that
        require one; the flags are restored with the model's state)."""
        if settings.full_gradient:
            raise ValueError("Under FSDP, adaptive_sharpness(variant='as23') and step_normalization='euclidean' are "
                             "not supported (they need global gradient norms); use the defaults (variant='clean').")
        self.shares = batches_are_shares(self.layout, batches)
        if settings.params == "all":
            for p in params:
                p.requires_grad_(True)

    def all_reduce(self, t: Tensor) -> Tensor:
        """In-place sum over the FSDP group."""
        return self.layout.all_reduce(t)

    def covered(self, params: list[Tensor], trainable: list[bool], pair_params: set[int]) -> list[int]:
        """Every parameter's shard, frozen and zero ones as coordinates that never move: each rank lays its vector out
        from the shapes alone, without a collective over the weights."""
        return list(range(len(params)))

    @contextlib.contextmanager
    def looked_up(self, positions: list[int]) -> Iterator[dict[int, Tensor]]:
        """The unsharded weights of the parameters sharded by rows (FSDP's default ``Shard(0)``); afterwards every
        gathered copy is dropped (a collective: every rank calls it with the same positions)."""
        try:
            yield self.layout.unsharded_weights([i for i in positions if self.layout.shard_dims[i] == 0])
        finally:
            self.layout.reshard_all()

    def hold(self, holding: Holding, blocks: list[PairBlock]) -> tuple[list[Tensor], list[PairBlock]]:
        """This rank's padded shards (of an embedding held by rows, a copy of the used rows of its shard), and the
        blocks as they are: their global indices are placed by the layout (``ShardedLayout.localize``)."""
        layout, covered = self.layout, set(holding.covered)
        with self.looked_up(list(holding.rows)) as weights:
            self._rows = {i: _ShardRows.of(u, weights[i], layout, i) for i, u in holding.rows.items()}
        layout.hold([0 if i not in covered else r.local.numel() * r.width if (r := self._rows.get(i)) else n
                     for i, n in enumerate(layout.local_sizes)])
        own = layout.base()
        base = [own[i].view(-1, r.width).index_select(0, r.local).reshape(-1) if (r := self._rows.get(i)) else own[i]
                for i in holding.covered]
        dtypes = {b.dtype for b in own}
        self._served_dtype = dtypes.pop() if len(dtypes) == 1 else None
        self.holding = holding
        return base, blocks

    def workspace(self, numel: int, dtype: torch.dtype) -> Workspace:
        """The default workspace on every rank, which may grow to the least of the ranks'
        :func:`~..solvers.memory.workspace_room` (each on its shard and its device's free memory): every rank then
        plans the same head chunks from the groups' global sizes. On GPUs with room that is one chunk per pair group;
        where the goal leaves no room beside the vectors (a CPU), the default size."""
        room = workspace_room(self.layout.numel, numel * dtype.itemsize, device_free_bytes(self.device))
        return Workspace(dtype, self.device, limit=self.layout.least(room) // dtype.itemsize)

    @contextlib.contextmanager
    def substituted(self, out: Tensor, need_grad: bool) -> Iterator[Backward]:
        """FSDP gathers the perturbed shards from ``out`` (the model's own shards for the parameters not held whole);
        the lookups of the embeddings held by rows read their perturbed used rows, assembled on every rank."""
        assert self.holding is not None, "hold() first"
        layout, whole = self.layout, set(self.holding.covered) - set(self._rows)
        segments = out.split(layout.held_sizes)
        served = segments
        if self._served_dtype not in (None, out.dtype):
            self._served = torch.empty_like(out, dtype=self._served_dtype) if self._served is None else self._served
            served = self._served.copy_(out).split(layout.held_sizes)
        own = layout.base()
        shards = [s if i in whole else own[i] for i, s in enumerate(served)]
        leaves = {i: segments[i].view(-1, r.width).clone().requires_grad_(need_grad) for i, r in self._rows.items()}
        gradients = [s if i in whole else None for i, s in enumerate(segments)]
        with layout.serving(shards), self._lookups(leaves):
            yield functools.partial(self.stream_backward, gradients, segments, leaves)

    def stream_backward(self, gradients: list[Tensor | None], segments: Sequence[Tensor], leaves: dict[int, Tensor],
                        loss: Tensor) -> None:
        """``dloss/dtheta`` into the segments: the shards' gradients streamed after FSDP's reduce-scatter, the held
        rows' gradients after the backward's all-reduce (zeros where none arrives)."""
        with self.layout.stream_gradients(gradients):
            loss.backward()
        for i, leaf in leaves.items():
            if leaf.grad is None:
                segments[i].zero_()
            else:
                segments[i].copy_(leaf.grad.reshape(-1))

    def _lookups(self, leaves: dict[int, Tensor]) -> contextlib.AbstractContextManager:
        """Lookups of the embeddings held by rows read their perturbed used rows, gathered from every rank."""
        if not leaves:
            return contextlib.nullcontext()
        restricted = {}
        for i, leaf in leaves.items():
            held = self._rows[i]
            rows = rows_of_every_rank(leaf.to(held.weight.dtype), held.slots, held.used.rows.numel(),
                                      self.layout.all_reduce, self.layout.world)
            restricted[id(held.weight)] = (held.used, rows)
        return RowLookup(restricted)

    def batch_loss(self, loss: Tensor, batch: Any) -> tuple[Tensor, Tensor]:
        """The batch's loss over all shares (detached, on the device), and this rank's loss scaled so that FSDP's
        average over the ranks is the batch's gradient."""
        if not self.shares:
            return loss.detach(), loss
        rows = float(_rows(batch))
        local = torch.stack([loss.detach().double() * rows, torch.full((), rows, dtype=torch.float64,
                                                                        device=loss.device)])
        total = self.all_reduce(local.to(self.device))
        return total[0] / total[1], loss * (rows * self.world / total[1]).to(loss.dtype)


def _rows(batch: Any) -> int:
    """The number of examples in a batch: dimension 0 of its first tensor."""
    tensors = [v for v in (batch.values() if isinstance(batch, Mapping) else [batch]) if isinstance(v, Tensor)]
    if not tensors or tensors[0].dim() == 0:
        raise ValueError("Under FSDP with per-rank shares of the batches, each batch must be a dict of tensors with "
                         "the examples along dimension 0 (or pass the same batches on every rank).")
    return tensors[0].shape[0]


def _fingerprint(batches: list[Any]) -> str:
    """A digest of the batches' keys, dtypes, shapes and values: equal on ranks given the same batches."""
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
