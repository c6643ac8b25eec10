"""The engine's view of an FSDP2-sharded model: each rank's padded local shards as one flat vector.

Under ``torch.distributed.fsdp.fully_shard`` every rank holds, per parameter, one padded shard
(``FSDPParam._sharded_param_data``: 1-D, the ``torch.chunk`` piece of the shard dimension with zeros after it), and
FSDP all-gathers from exactly that tensor before a forward. The engine keeps its perturbed weights in one flat buffer
laid out like the concatenation of these shards (``named_parameters`` order; of an embedding whose unused rows it
leaves out, the used rows of this shard only: :meth:`ShardedLayout.hold`), and ``serving(shards)`` points the
attribute at one tensor per parameter for the duration of a measurement: the forward and backward see the perturbed
weights while the model's own shards, the base point, are never written to, and restoring the attribute restores
the model bit for bit. Gradients arrive per parameter after FSDP's reduce-scatter (which averages over the ranks)
and ``stream_gradients`` copies each into its segment of the flat buffer, so sharded gradients are never all alive
at once. ``ShardedLayout.localize`` maps the symmetry map's global flat indices (into the unsharded
``named_parameters`` concatenation) to ``(owner rank, position in the owner's local vector)``.
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

__all__ = ["ShardedLayout", "fsdp_state"]


def fsdp_modules(model: nn.Module) -> list[nn.Module]:
    """The FSDP2 modules of ``model`` (in ``modules()`` order).

    A module can only be an ``FSDPModule`` once ``torch.distributed.fsdp`` is imported (``fully_shard`` lives there), so
    an unsharded run never imports FSDP."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    if fsdp is None:
        return []
    return [m for m in model.modules() if isinstance(m, fsdp.FSDPModule)]


def _lazy_init(modules: list[nn.Module]) -> list[Any]:
    """Run FSDP's lazy initialisation (what the first forward would do) and return every FSDP param group.

    Lazy init re-pads the local shards once (``reset_sharded_param``); it must have run before ``serving`` swaps
    ``_sharded_param_data``, or the first forward would undo the swap. ``modules`` is in pre-order, so the first
    uninitialised state met is a root and initialises everything below it."""
    groups: list[Any] = []
    for module in modules:
        state = module._get_fsdp_state()
        if state._is_root is None:
            state._lazy_init()
        groups.extend(g for g in state._fsdp_param_groups if g not in groups)
    return groups


def _refuse_unsupported(groups: list[Any]) -> Any:
    """The one 1-D mesh every group shares, or a ValueError for a setup whose shards this layer cannot serve."""
    meshes: list[Any] = []
    for mesh in (fp.mesh_info.mesh for g in groups for fp in g.fsdp_params):
        if mesh not in meshes:  # equal meshes (same devices and names) built separately count once
            meshes.append(mesh)
    if len(meshes) != 1:
        raise ValueError(f"the model's parameters are sharded over {len(meshes)} FSDP meshes; one mesh is supported")
    mesh = meshes[0]
    if mesh.ndim != 1:
        raise ValueError(
            f"FSDP over a {mesh.ndim}-D mesh (HSDP or FSDP combined with another parallelism) is not supported yet; "
            "shard over a 1-D mesh"
        )
    for group in groups:
        if group.post_forward_mesh_info is not None and group.post_forward_mesh_info != group.mesh_info:
            raise ValueError("reshard_after_forward given as an int is not supported; pass True or False")
        for fp in group.fsdp_params:
            name = fp._param_fqn
            if fp.offload_to_cpu:
                raise ValueError(f"{name}: FSDP CPU offload is not supported (the shards must live on the mesh)")
            if hasattr(fp._sharded_local_tensor, "fsdp_pre_all_gather"):
                raise ValueError(f"{name}: tensor-subclass all-gather extensions (fsdp_pre_all_gather) are not "
                                 "supported")  # fmt: skip
            if fp.is_dtensor:
                raise ValueError(f"{name}: the parameter was a DTensor before FSDP (tensor parallelism); only "
                                 "FSDP's own sharding is supported")  # fmt: skip
    return mesh


def fsdp_state(model: nn.Module) -> ShardedLayout | None:
    """The sharded layout of ``model``, or ``None`` when no module of it is an FSDP2 module.

    Runs FSDP's lazy initialisation, and raises ``ValueError`` for what cannot be served: a parameter FSDP does not
    manage next to sharded ones, tensor-subclass extensions, CPU offload, an int ``reshard_after_forward``, several
    meshes or a 2-D (HSDP) mesh."""
    modules = fsdp_modules(model)
    if not modules:
        return None
    groups = _lazy_init(modules)
    mesh = _refuse_unsupported(groups)
    owner = {id(fp.sharded_param): fp for g in groups for fp in g.fsdp_params}
    params = list(model.named_parameters())
    unmanaged = [name for name, p in params if id(p) not in owner]
    if unmanaged:
        raise ValueError(
            f"{len(unmanaged)} parameter(s) are not managed by FSDP while others are sharded (first: "
            f"{unmanaged[0]}); call fully_shard on a module that contains them (for example the root)"
        )
    roots = [m for m in modules if m._get_fsdp_state()._is_root]
    return ShardedLayout(mesh, [(name, owner[id(p)]) for name, p in params], groups, roots)


class ShardedLayout:
    """Per-rank layout of the local flat vector: the padded local shards in ``named_parameters`` order.

    ``rank``/``world``/``group``/``device`` come from the FSDP mesh (gloo on CPU, NCCL on GPU); ``names``,
    ``global_shapes``, ``shard_dims`` and ``local_sizes`` (padded local numel, equal on every rank) describe the
    parameters; ``numel`` is the local vector's length and ``global_numel`` the unsharded one's. ``held_sizes`` is
    what the engine's vector holds of each parameter (see :meth:`hold`)."""

    def __init__(self, mesh: Any, params: list[tuple[str, Any]], groups: list[Any], roots: list[nn.Module]) -> None:
        self._fsdp = [fp for _, fp in params]
        self._groups = groups
        self._roots = roots
        self.rank: int = mesh.get_local_rank()
        self.world: int = mesh.size()
        self.group: dist.ProcessGroup = mesh.get_group()
        self.device: torch.device = self._fsdp[0].device if self._fsdp else torch.device(mesh.device_type)
        self.names: list[str] = [name for name, _ in params]
        self.global_shapes: list[torch.Size] = [fp._orig_size for fp in self._fsdp]
        self.shard_dims: list[int] = [fp.fsdp_placement.dim for fp in self._fsdp]
        self.local_sizes: list[int] = [fp.padded_sharded_param_size.numel() for fp in self._fsdp]
        self.held_sizes: list[int] = list(self.local_sizes)
        self.numel: int = sum(self.local_sizes)
        self.global_numel: int = sum(s.numel() for s in self.global_shapes)
        self._serving: list[Tensor] | None = None
        self._index = self._index_tables()

    def _index_tables(self) -> dict[str, Tensor]:
        """Per parameter: global and local offsets and the ``(outer, dim, inner)`` factorisation around the shard
        dimension, the chunk length on it, as int64 tensors that ``localize`` indexes by parameter."""
        rows: list[list[int]] = []
        g_off = l_off = 0
        for fp, shape, size in zip(self._fsdp, self.global_shapes, self.local_sizes):
            d = fp.fsdp_placement.dim
            outer = int(torch.Size(shape[:d]).numel())
            length = shape[d] if len(shape) else 1
            inner = int(torch.Size(shape[d + 1 :]).numel())
            chunk = -(-length // self.world)
            if outer * chunk * inner != size:
                raise ValueError(f"{fp._param_fqn}: unexpected FSDP padding ({size} local entries for {tuple(shape)} "
                                 f"over {self.world} ranks on dim {d})")  # fmt: skip
            rows.append([g_off, l_off, outer, length, inner, chunk])
            g_off, l_off = g_off + shape.numel(), l_off + size
        table = torch.tensor(rows, dtype=torch.int64).reshape(-1, 6)
        keys = ("g_off", "l_off", "outer", "length", "inner", "chunk")
        return {k: table[:, i].contiguous() for i, k in enumerate(keys)}

    def base(self) -> list[Tensor]:
        """Per parameter the 1-D padded local shard as FSDP stores it (the base point; read it, never write it)."""
        if self._serving is not None:
            return list(self._serving)
        return [fp._sharded_param_data for fp in self._fsdp]

    def hold(self, sizes: list[int]) -> None:
        """Lay the engine's vector out with ``sizes[i]`` entries of parameter ``i``: its padded shard, or fewer for
        an embedding of which only used rows are held (never a pair's weight); ``localize`` then places the other
        parameters' entries in that vector."""
        self.held_sizes = list(sizes)
        self._index["l_off"] = torch.tensor([0, *sizes[:-1]], dtype=torch.int64).cumsum(0)

    def unsharded_weights(self, positions: list[int]) -> dict[int, Tensor]:
        """``{position: the unsharded parameter the modules compute with during a forward}``. FSDP makes it at a
        group's first all-gather; groups that have not gathered yet are gathered once here and resharded (a
        collective: every rank calls it with the same positions)."""
        wanted = [self._fsdp[i] for i in positions]
        for group in self._groups:
            if any(fp in wanted and not hasattr(fp, "_unsharded_param") for fp in group.fsdp_params):
                group.unshard()
                group.wait_for_unshard()
                group.reshard()
        return {i: fp._unsharded_param for i, fp in zip(positions, wanted)}

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
        fp, shape = self._fsdp[i], self.global_shapes[i]
        d = fp.fsdp_placement.dim
        pieces = full.reshape(shape).chunk(self.world, dim=d) if len(shape) else (full,)
        out = full.new_zeros(fp.padded_sharded_param_size)
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
        for group in self._groups:
            if not group.is_sharded:
                group.reshard()

    @contextmanager
    def serving(self, shards: Sequence[Tensor]) -> Iterator[None]:
        """While inside, FSDP all-gathers parameter ``i`` from ``shards[i]`` (1-D, its padded local size, its dtype)
        instead of the model's shard; the model's shards are never written to (one of them may be passed itself),
        and the attribute is restored on any exit.

        The shards' values may change between forwards: every forward of the root re-gathers. One forward per
        backward."""
        self._check_shards(shards, "shards")
        wrong = [fp._param_fqn for fp, t in zip(self._fsdp, shards) if t.dtype != fp._sharded_param_data.dtype]
        if wrong:
            raise ValueError(f"the shards served for {wrong} do not have their parameters' dtypes")
        if self._serving is not None:
            raise RuntimeError("serving() is already active on this model")
        own = [fp._sharded_param_data for fp in self._fsdp]
        hooks = [r.register_forward_pre_hook(lambda *_: self.reshard_all(), prepend=True) for r in self._roots]
        self.reshard_all()
        self._serving = own
        try:
            for fp, view in zip(self._fsdp, shards):
                fp._sharded_param_data = view
            yield
        finally:
            for fp, saved in zip(self._fsdp, own):
                fp._sharded_param_data = saved
            self._serving = None
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
        filled = [False] * len(self._fsdp)
        params = [fp.sharded_param for fp in self._fsdp]
        saved = [p.grad for p in params]
        handles = []
        try:
            for p in params:
                p.grad = None
            for i, (fp, p) in enumerate(zip(self._fsdp, params)):
                if p.requires_grad and segments[i] is not None:  # FSDP reduces no gradient for a frozen parameter
                    handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(i, fp, segments[i], filled)))
            yield filled
        finally:
            for h in handles:
                h.remove()
            for seg, done in zip(segments, filled):
                if seg is not None and not done:
                    seg.zero_()
            for p, g in zip(params, saved):
                p.grad = g

    @staticmethod
    def _grad_hook(i: int, fp: Any, segment: Tensor, filled: list[bool]) -> Callable[[Tensor], None]:
        padded = segment.view(fp.padded_sharded_param_size)

        def hook(param: Tensor) -> None:
            local = param.grad._local_tensor
            with torch.no_grad():
                if local.shape != padded.shape:
                    padded.zero_()
                if local.numel():
                    padded.narrow(fp.fsdp_placement.dim, 0, local.shape[fp.fsdp_placement.dim]).copy_(local)
            filled[i] = True
            param.grad = None

        return hook

    def all_reduce(self, t: Tensor) -> Tensor:
        """In-place sum of ``t`` over the FSDP group (float64 included); returns ``t``."""
        dist.all_reduce(t, op=dist.ReduceOp.SUM, group=self.group)
        return t
