"""The engine's view of an FSDP2-sharded model: each rank's padded local shards as one flat vector.

Under ``torch.distributed.fsdp.fully_shard`` every rank holds, per parameter, one padded shard (1-D, the
``torch.chunk`` piece of the shard dimension with zeros after it), and FSDP all-gathers from exactly that tensor
before a forward. The engine keeps its perturbed weights in one flat buffer laid out like the concatenation of these
shards (``named_parameters`` order; of an embedding whose unused rows it leaves out, the used rows of this shard
only: :meth:`ShardedLayout.hold`), and ``serving(shards)`` has FSDP gather from one tensor per parameter for the
duration of a measurement: the forward and backward see the perturbed weights while the model's own shards, the base
point, are never written to, and ending the measurement restores the model bit for bit. Gradients arrive per
parameter after FSDP's reduce-scatter (which averages over the ranks) and ``stream_gradients`` copies each into its
segment of the flat buffer, so sharded gradients are never all alive at once. ``ShardedLayout.localize`` maps the
symmetry map's global flat indices (into the unsharded ``named_parameters`` concatenation) to ``(owner rank,
position in the owner's local vector)``.

FSDP2 is reached through its public API (mesh and shard dimension from the DTensor parameters,
``FSDPModule.unshard()/reshard()``, ``DTensor.to_local()``), except the padded shards themselves:
:mod:`hf_geosharp.engine.placement.fsdp_internals` holds every use of FSDP's internals, and says why.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from ..space.coordinates import Factor, SharedRows
from .fsdp_internals import PaddedShards

__all__ = ["ShardedLayout", "fsdp_modules", "fsdp_state"]


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of ``model`` (in ``modules()`` order).

    A module can only be an ``FSDPModule`` once ``torch.distributed.fsdp`` is imported (``fully_shard`` lives there), so
    an unsharded run never imports FSDP."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def fsdp_state(model: nn.Module) -> ShardedLayout | None:
    """The sharded layout of ``model``, or ``None`` when no module of it is an FSDP2 module.

    Runs FSDP's lazy initialisation, and raises ``ValueError`` for what cannot be served: a parameter FSDP does not
    manage next to sharded ones, tensor-subclass extensions, CPU offload, an int ``reshard_after_forward``, several
    meshes or a 2-D (HSDP) mesh."""
    return ShardedLayout(model) if fsdp_modules(model) else None


def _one_mesh(named: list[tuple[str, Any]]) -> Any:
    """The one 1-D mesh every sharded parameter shares, or a ValueError for a setup this layer cannot serve."""
    from torch.distributed.tensor import DTensor

    meshes: list[Any] = []
    for mesh in (p.device_mesh for _, p in named if isinstance(p, DTensor)):
        if mesh not in meshes:  # equal meshes (same devices and names) built separately count once
            meshes.append(mesh)
    if len(meshes) != 1:
        raise ValueError(f"the model's parameters are sharded over {len(meshes)} FSDP meshes; one mesh is supported")
    if meshes[0].ndim != 1:
        raise ValueError(
            f"FSDP over a {meshes[0].ndim}-D mesh (HSDP or FSDP combined with another parallelism) is not supported "
            "yet; shard over a 1-D mesh"
        )
    return meshes[0]


def _under(name: str, prefix: str) -> bool:
    """Whether the module or parameter ``name`` lies under the module named ``prefix`` (the root is ``""``)."""
    return prefix == "" or name.startswith(prefix + ".")


def _managing(model: nn.Module, modules: list[nn.Module], names: list[str]) -> tuple[list[nn.Module], list[nn.Module]]:
    """The roots among the FSDP ``modules`` (under no other), and per parameter name the FSDP module that manages it
    (the innermost one it lies under)."""
    named = [(name, m) for name, m in model.named_modules() if any(m is f for f in modules)]
    roots = [m for name, m in named if not any(other != name and _under(name, other) for other, _ in named)]
    owners = [max(((prefix, m) for prefix, m in named if _under(name, prefix)), key=lambda e: len(e[0]))[1]
              for name in names]
    return roots, owners


class ShardedLayout:
    """Per-rank layout of the local flat vector: the padded local shards in ``named_parameters`` order.

    ``rank``/``world``/``group``/``device`` come from the FSDP mesh (gloo on CPU, NCCL on GPU); ``names``,
    ``global_shapes``, ``shard_dims`` and ``local_sizes`` (padded local numel, equal on every rank) describe the
    parameters; ``numel`` is the local vector's length and ``global_numel`` the unsharded one's. ``held_sizes`` is
    what the engine's vector holds of each parameter (see :meth:`hold`)."""

    def __init__(self, model: nn.Module) -> None:
        from torch.distributed.tensor import DTensor

        self._model = model
        self._modules = fsdp_modules(model)
        self._shards = PaddedShards(self._modules)
        named = list(model.named_parameters())
        mesh = _one_mesh(named)
        self._shards.refuse_unsupported(named)
        with torch.no_grad():  # the local tensor itself, not an autograd view of it
            extended = [n for n, p in named if isinstance(p, DTensor) and hasattr(p.to_local(), "fsdp_pre_all_gather")]
        if extended:
            raise ValueError(f"{extended[0]}: tensor-subclass all-gather extensions (fsdp_pre_all_gather) are not "
                             "supported")  # fmt: skip
        unmanaged = [name for name, p in named if not self._shards.manages(p)]
        if unmanaged:
            raise ValueError(
                f"{len(unmanaged)} parameter(s) are not managed by FSDP while others are sharded (first: "
                f"{unmanaged[0]}); call fully_shard on a module that contains them (for example the root)"
            )
        self._params: list[Any] = [p for _, p in named]
        self._shards.select(self._params)
        self._roots, self._owners = _managing(model, self._modules, [name for name, _ in named])
        self.rank: int = mesh.get_local_rank()
        self.world: int = mesh.size()
        self.group: dist.ProcessGroup = mesh.get_group()
        self.device: torch.device = self._params[0].to_local().device if self._params else torch.device(
            mesh.device_type)
        self.names: list[str] = [name for name, _ in named]
        self.global_shapes: list[torch.Size] = [p.shape for p in self._params]
        self.shard_dims: list[int] = [p.placements[0].dim for p in self._params]
        self.padded_shapes: list[torch.Size] = [
            torch.Size(s[:d] + (-(-s[d] // self.world),) + s[d + 1 :]) if len(s) else s
            for s, d in zip(self.global_shapes, self.shard_dims)]
        self.local_sizes: list[int] = [s.numel() for s in self.padded_shapes]
        self.held_sizes: list[int] = list(self.local_sizes)
        self.numel: int = sum(self.local_sizes)
        self.global_numel: int = sum(s.numel() for s in self.global_shapes)
        self._index = self._index_tables()

    def _index_tables(self) -> dict[str, Tensor]:
        """Per parameter: global and local offsets and the ``(outer, dim, inner)`` factorisation around the shard
        dimension, the chunk length on it, as int64 tensors that ``localize`` indexes by parameter."""
        rows: list[list[int]] = []
        g_off = l_off = 0
        for name, shape, d, own in zip(self.names, self.global_shapes, self.shard_dims, self._shards.own()):
            outer = int(torch.Size(shape[:d]).numel())
            length = shape[d] if len(shape) else 1
            inner = int(torch.Size(shape[d + 1 :]).numel())
            chunk = -(-length // self.world)
            if outer * chunk * inner != own.numel():
                raise ValueError(f"{name}: unexpected FSDP padding ({own.numel()} local entries for {tuple(shape)} "
                                 f"over {self.world} ranks on dim {d})")  # fmt: skip
            rows.append([g_off, l_off, outer, length, inner, chunk])
            g_off, l_off = g_off + shape.numel(), l_off + own.numel()
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
        keys = ("g_off", "l_off", "outer", "length", "inner", "chunk")
        return {k: table[:, i].contiguous() for i, k in enumerate(keys)}

    def base(self) -> list[Tensor]:
        """Per parameter the 1-D padded local shard as FSDP stores it (the base point; read it, never write it)."""
        return self._shards.own()

    def hold(self, sizes: list[int]) -> None:
        """Lay the engine's vector out with ``sizes[i]`` entries of parameter ``i``: its padded shard, or fewer for
        an embedding of which only used rows are held (never a pair's weight); ``localize`` then places the other
        parameters' entries in that vector."""
        self.held_sizes = list(sizes)
        self._index["l_off"] = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)

    def unsharded_weights(self, positions: list[int]) -> dict[int, Tensor]:
        """``{position: the unsharded parameter the modules compute with during a forward}``: the managing modules
        are unsharded, read and resharded (a collective: every rank calls it with the same positions). FSDP keeps
        that parameter object from one forward to the next."""
        owners: list[nn.Module] = []
        for i in positions:
            if not any(self._owners[i] is m for m in owners):
                owners.append(self._owners[i])
        for module in owners:
            module.unshard()
        try:
            return {i: self._model.get_parameter(self.names[i]) for i in positions}
        finally:
            for module in owners:
                module.reshard()

    def localize(self, global_index: Tensor) -> tuple[Tensor, Tensor]:
        """``(owner_rank, local_position)`` for global flat indices of any shape (int64, same shape back).

        The shard dimension is cut as ``torch.chunk`` cuts it (chunks of ``ceil(size / world)``, the last ranks short
        or empty); a local position is row-major in the owner's padded shard plus that shard's offset."""
        idx = global_index.to(torch.int64).cpu()
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.global_numel):
            raise IndexError(f"global flat index out of range [0, {self.global_numel})")
        t = self._index
        ends = t["g_off"] + t["outer"] * t["length"] * t["inner"]
        p = torch.searchsorted(ends, idx, right=True)
        r = idx - t["g_off"][p]
        length, inner, chunk = t["length"][p], t["inner"][p], t["chunk"][p]
        a, b, c = r // (length * inner), (r // inner) % length, r % inner
        owner = b // chunk
        local = t["l_off"][p] + (a * chunk + b % chunk) * inner + c
        return owner.to(global_index.device), local.to(global_index.device)

    def pair_factors(self, index: Tensor, device: torch.device) -> tuple[Factor, int, Tensor, int]:
        """This rank's part of a pair factor given by global indices ``[k, n, h]``: ``(factor, rows it counts in
        sums, the global row of each local row, n)``.

        A row (an index along ``n``, across all heads) is this rank's when every entry of it, in every head, is
        stored here; it is absent when every entry is stored on one other rank; otherwise it is shared (a head cut
        by a shard boundary, a bias row split like its weight): assembled on every rank, counted by rank 0."""
        (K, n, h), first = index.shape, None
        mine, single = torch.ones(n, dtype=torch.bool), torch.ones(n, dtype=torch.bool)
        step = max(1, (1 << 20) // max(1, n * h))  # a few heads at a time: localize makes int64 temporaries
        for k in range(0, K, step):
            owner = self.localize(index[k : k + step])[0].cpu().permute(1, 0, 2).reshape(n, -1)
            first = owner[:, :1] if first is None else first
            single &= (owner == first).all(1)
            mine &= (owner == self.rank).all(1)
        own_rows = mine.nonzero().flatten()
        shared_rows = (~single).nonzero().flatten()
        local = self.localize(index[:, own_rows])[1].cpu()
        owner_s, local_s = self.localize(index[:, shared_rows])
        positions = torch.where(owner_s == self.rank, local_s, -1).to(device)
        shared = SharedRows(positions, self.all_reduce) if len(shared_rows) else None
        factor = Factor.of(local, device, shared)
        counted = len(own_rows) + (len(shared_rows) if self.rank == 0 else 0)
        return factor, counted, torch.cat([own_rows, shared_rows]), n

    def local_part(self, i: int, full: Tensor) -> Tensor:
        """Parameter ``i``'s local padded shard of ``full`` (the whole parameter, any layout-independent values)."""
        shape, d = self.global_shapes[i], self.shard_dims[i]
        pieces = full.reshape(shape).chunk(self.world, dim=d) if len(shape) else (full,)
        out = full.new_zeros(self.padded_shapes[i])
        if self.rank < len(pieces):
            out.narrow(d, 0, pieces[self.rank].shape[d]).copy_(pieces[self.rank])
        return out.reshape(-1)

    def _check_shards(self, tensors: Sequence[Tensor | None], what: str) -> None:
        """One 1-D tensor of each parameter's padded local size on the mesh's device (``None`` where allowed)."""
        shapes = [None if t is None else (t.dim(), t.numel(), t.device) for t in tensors]
        want = [(1, n, self.device) for n in self.local_sizes]
        if len(shapes) != len(want) or any(s is not None and s != w for s, w in zip(shapes, want)):
            raise ValueError(f"{what} must be one 1-D tensor per parameter, of sizes {self.local_sizes} on "
                             f"{self.device}; got {shapes}")

    def reshard_all(self) -> None:
        """Drop every all-gathered copy, so the next forward gathers from whatever the shards point at now (the root
        keeps its parameters unsharded after a forward that had no backward)."""
        for module in self._modules:
            module.reshard()

    @contextmanager
    def serving(self, shards: Sequence[Tensor]) -> Iterator[None]:
        """While inside, FSDP all-gathers parameter ``i`` from ``shards[i]`` (1-D, its padded local size, its dtype)
        instead of the model's shard; the model's shards are never written to (one of them may be passed itself),
        and the model gathers from its own shards again on any exit.

        The shards' values may change between forwards: every forward of the root re-gathers. One forward per
        backward."""
        self._check_shards(shards, "shards")
        wrong = [name for name, own, t in zip(self.names, self.base(), shards) if t.dtype != own.dtype]
        if wrong:
            raise ValueError(f"the shards served for {wrong} do not have their parameters' dtypes")
        with self._shards.replaced(shards):
            hooks = [r.register_forward_pre_hook(lambda *_: self.reshard_all(), prepend=True) for r in self._roots]
            try:
                self.reshard_all()
                yield
            finally:
                for hook in hooks:
                    hook.remove()
                self.reshard_all()

    @contextmanager
    def stream_gradients(self, segments: Sequence[Tensor | None]) -> Iterator[list[bool]]:
        """While inside, parameter ``i``'s local gradient (after FSDP's reduce-scatter, which averages over the ranks)
        is copied into ``segments[i]`` (zeros in the padding) and dropped at once; a ``None`` segment takes nothing.
        Yields the per-parameter "filled" flags; on exit the segments of parameters that got no gradient (frozen,
        unused) are zeroed and the ``.grad`` each parameter had before is put back. Meant for one backward per
        context."""
        self._check_shards(segments, "segments")
        filled = [False] * len(self._params)
        saved = [p.grad for p in self._params]
        handles = []
        try:
            for p in self._params:
                p.grad = None
            for i, (p, segment) in enumerate(zip(self._params, segments)):
                if p.requires_grad and segment is not None:  # FSDP reduces no gradient for a frozen parameter
                    handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(i, segment, filled)))
            yield filled
        finally:
            for h in handles:
                h.remove()
            for seg, done in zip(segments, filled):
                if seg is not None and not done:
                    seg.zero_()
            for p, g in zip(self._params, saved):
                p.grad = g

    def _grad_hook(self, i: int, segment: Tensor, filled: list[bool]) -> Callable[[Tensor], None]:
        padded, d = segment.view(self.padded_shapes[i]), self.shard_dims[i]

        def hook(param: Tensor) -> None:
            with torch.no_grad():
                local = param.grad.to_local()
                if local.shape != padded.shape:
                    padded.zero_()
                if local.numel():
                    padded.narrow(d, 0, local.shape[d]).copy_(local)
            filled[i] = True
            param.grad = None

        return hook

    def all_reduce(self, t: Tensor) -> Tensor:
        """In-place sum of ``t`` over the FSDP group (float64 included); returns ``t``."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t

    def least(self, value: int) -> int:
        """The smallest of the ranks' ``value`` (a collective: every rank calls it)."""
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.group)
        return int(t.item())
