"""The placement of a model in one process: the engine's vector holds the parameters themselves.

The perturbed weights are served by stateless reparametrisation (:func:`reparametrized`: the model's parameters are
swapped for views of the engine's buffer for one call, tied weights included), and the lookups of an embedding held
by its used rows by :class:`~hf_geosharp.engine.model_function.embedding_rows.RowLookup`; gradients are taken with
respect to those views only and streamed over the weights they replace. Under ``accelerate`` the batches are spread
over the processes, each of which holds the whole model.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import Tensor, nn
from torch.nn.utils import stateless

from ...symmetry.base import PairBlock
from ..defaults import ZERO_TOL
from ..model_function.embedding_rows import RowLookup
from ..settings import RunSettings
from ..solvers.memory import device_free_bytes, workspace_room
from ..space.workspace import Workspace
from .base import Backward, Holding


@contextlib.contextmanager
def reparametrized(model: nn.Module, tensors: Mapping[str, Tensor], tie_weights: bool = True) -> Iterator[None]:
    """``model`` computes with ``tensors`` (by parameter name) in place of its parameters inside the block (with
    ``tie_weights``, also in place of the parameters tied to them).

    The one use of PyTorch's private ``_reparametrize_module`` (the engine of ``torch.func.functional_call``, which
    cannot keep the swap open across a separate backward pass, as activation checkpointing needs); its behaviour
    is pinned by a test, so a change in PyTorch shows up there first."""
    with stateless._reparametrize_module(model, tensors, tie_weights=tie_weights):
        yield


class SingleProcess:
    """The whole model in this process (see the module docstring); ``accelerator`` (an ``accelerate.Accelerator``)
    spreads the batches over its processes."""

    shard = None
    where = ""

    def __init__(self, model: nn.Module, accelerator: Any = None) -> None:
        self.model = model
        self.rank, self.world = (accelerator.process_index, accelerator.num_processes) if accelerator else (0, 1)
        self.holding: Holding | None = None
        self._shapes: list[torch.Size] = []
        self._numels: list[int] = []
        self._offsets: list[int] = []

    @property
    def device(self) -> torch.device:
        """The device of the model's first parameter."""
        return next(self.model.parameters()).device

    def batches(self, n_batches: int) -> range:
        """Every ``world``-th batch from this process's rank."""
        return range(self.rank, n_batches, self.world)

    def collect(self, results: dict[int, Any]) -> dict[int, Any]:
        """Every process's results, merged (``accelerate``'s ``gather_object``)."""
        if self.world == 1:
            return results
        from accelerate.utils import gather_object

        merged: dict[int, Any] = {}
        for part in gather_object([results]):
            merged.update(part)
        return merged

    def prepare(self, settings: RunSettings, params: list[Tensor], batches: list[Any]) -> None:
        """Nothing to ready: every solver runs in one process."""

    def all_reduce(self, t: Tensor) -> Tensor:
        """``t``: nothing is shared with another process."""
        return t

    def covered(self, params: list[Tensor], trainable: list[bool], pair_params: set[int]) -> list[int]:
        """The trainable parameters, but those all of whose weights are zero (the elementwise metric divides by the
        weights: they cannot move) unless a pair holds them: every vector is then shorter."""
        return [i for i, (p, t) in enumerate(zip(params, trainable))
                if t and (i in pair_params or bool((p.detach().abs() >= ZERO_TOL).any()))]

    @contextlib.contextmanager
    def looked_up(self, positions: list[int]) -> Iterator[dict[int, Tensor]]:
        """The parameters themselves: the model's lookups receive them."""
        params = list(self.model.parameters())
        yield {i: params[i] for i in positions}

    def hold(self, holding: Holding, blocks: list[PairBlock]) -> tuple[list[Tensor], list[PairBlock]]:
        """The parameters (of an embedding held by rows, a copy of those rows), and the blocks re-indexed into the
        concatenation of what the vector holds."""
        params = holding.params
        base = [params[i].detach().index_select(0, holding.rows[i].rows) if i in holding.rows else params[i]
                for i in holding.covered]
        self.holding = holding
        self._shapes = [b.shape for b in base]
        self._numels = [b.numel() for b in base]
        self._offsets = [0, *torch.tensor(self._numels).cumsum(0).tolist()][:-1]
        kept = [0] * len(params)
        for i, n in zip(holding.covered, self._numels):
            kept[i] = n
        return base, _remap(blocks, [p.numel() for p in params], kept)

    def workspace(self, numel: int, dtype: torch.dtype) -> Workspace:
        """A workspace sized to the vector (``Workspace.sized_for``), which may grow to
        :func:`~..solvers.memory.workspace_room`: what the solver's bytes goal leaves beside four vectors, or on a GPU
        with more room a share of its free memory; one head chunk per pair group wherever that fits."""
        params = sum(p.numel() for p in self.model.parameters())
        room = workspace_room(params, numel * dtype.itemsize, device_free_bytes(torch.device(self.device)))
        return Workspace.sized_for(numel, dtype, self.device, room=room)

    @contextlib.contextmanager
    def substituted(self, out: Tensor, need_grad: bool) -> Iterator[Backward]:
        """Views of ``out`` swapped in for the held parameters, each with a version counter of its own (writing one
        parameter's gradient over its view then leaves the others valid); the lookups of an embedding held by rows
        answered from its view. Backward runs inside too: activation checkpointing recomputes the forward during
        backward, and must see the perturbed weights, not the user's."""
        assert self.holding is not None, "hold() first"
        names, params, rows = self.holding.names, self.holding.params, self.holding.rows
        tensors, leaves, looked_up = {}, [], {}
        for i, offset, shape in zip(self.holding.covered, self._offsets, self._shapes):
            t = _aliased(out, offset, shape)
            if t.dtype != params[i].dtype:  # a half-precision model computes with its own dtype (a copy)
                t = t.to(params[i].dtype)
            if need_grad:
                leaves.append(t.requires_grad_(True))
            if i in rows:
                looked_up[id(params[i])] = (rows[i], t)
            else:
                tensors[names[i]] = t
        lookups = RowLookup(looked_up) if looked_up else contextlib.nullcontext()
        with reparametrized(self.model, tensors), lookups:
            yield functools.partial(self.stream_backward, leaves, out.split(self._numels))

    def stream_backward(self, leaves: list[Tensor], segments: Sequence[Tensor], loss: Tensor) -> None:
        """``dloss/dtheta`` into ``segments``, each gradient copied over its weights as soon as backward has it and
        dropped (a plain backward keeps them all alive in ``.grad``); zero where no gradient arrives. Each view's
        version counter is bumped after the write, so that a model that read a weight again after its gradient was
        final fails loudly instead of computing with the gradient."""
        filled = set()

        def stream(position: int) -> Callable[[Tensor], None]:
            def hook(leaf: Tensor) -> None:
                segments[position].copy_(leaf.grad.reshape(-1))
                leaf.grad = None
                torch.autograd.graph.increment_version(leaf)
                filled.add(position)

            return hook

        for position, leaf in enumerate(leaves):
            leaf.register_post_accumulate_grad_hook(stream(position))
        torch.autograd.backward(loss, inputs=leaves)
        missing = [segment for i, segment in enumerate(segments) if i not in filled]
        if missing:
            torch._foreach_zero_(missing)

    def batch_loss(self, loss: Tensor, batch: Any) -> tuple[Tensor, Tensor]:
        """The loss itself (its value detached, on the device)."""
        return loss.detach(), loss


def _aliased(flat: Tensor, offset: int, shape: torch.Size) -> Tensor:
    """A contiguous tensor of ``shape`` on ``flat``'s memory at ``offset``, with a version counter of its own (a
    view would share ``flat``'s, and writing one parameter's gradient would then invalidate every other)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    storage, start = flat.untyped_storage(), flat.storage_offset() + offset
    return flat.new_empty(0).set_(storage, start, shape, tuple(reversed(strides)))


def _remap(blocks: list[PairBlock], sizes: list[int], kept_sizes: list[int]) -> list[PairBlock]:
    """The blocks re-indexed into the concatenation of what the vector holds of each parameter (``kept_sizes``: 0
    for a parameter left out, fewer than its size for an embedding's used rows; the blocks themselves when
    everything is kept: index maps are 8 bytes per pair coordinate). The builder passes only blocks whose parameters
    are held whole."""
    if kept_sizes == sizes:
        return blocks
    ends = torch.tensor(sizes).cumsum(0)
    removed = torch.tensor([n - k for n, k in zip(sizes, kept_sizes)])
    skipped = removed.cumsum(0) - removed
    out = []
    for b in blocks:
        G, H = (i - skipped[torch.bucketize(i.cpu(), ends, right=True)].to(i.device) for i in (b.G_index, b.H_index))
        out.append(dataclasses.replace(b, G_index=G, H_index=H))
    return out
