"""The engine's view of an FSDP2-sharded model: each rank's padded local shards as one flat vector.

Under ``torch.distributed.fsdp.fully_shard`` every rank holds, per parameter, one padded shard
(``FSDPParam._sharded_param_data``: 1-D, the ``torch.chunk`` piece of the shard dimension with zeros after it), and
FSDP all-gathers from exactly that tensor before a forward. The engine keeps its perturbed weights in one flat buffer
``theta`` laid out like the concatenation of these shards (``named_parameters`` order), and ``serving(theta)``
points the attribute at ``theta``'s segments for the duration of a measurement: the forward and backward see the
perturbed weights while the model's own shards, the base point, are never written to, and restoring the attribute
restores the model bit for bit. Gradients arrive per parameter after FSDP's reduce-scatter (which averages over the
ranks) and ``stream_gradients`` copies each into the matching segment of a flat buffer, so sharded gradients are
never all alive at once.

Global flat indices (the symmetry map's, into the unsharded ``named_parameters`` concatenation) are turned into
``(owner rank, position in the owner's local vector)`` by ``ShardedLayout.localize``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from .coordinates import Factor, SharedRows

logger = logging.getLogger(__name__)

__all__ = ["ShardedLayout", "attention_placement", "fsdp_state", "init_distributed", "is_sharded",
           "shard_model"]


def _fsdp_modules(model: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


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
    modules = _fsdp_modules(model)
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
    ``global_shapes`` and ``local_sizes`` (padded local numel, equal on every rank) describe the parameters;
    ``numel`` is the local vector's length and ``global_numel`` the unsharded one's."""

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
        self.local_sizes: list[int] = [fp.padded_sharded_param_size.numel() for fp in self._fsdp]
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
        owner, local = self.localize(index)
        owner, local = owner.cpu(), local.cpu()
        flat = owner.permute(1, 0, 2).reshape(index.shape[1], -1)
        mine = (flat == self.rank).all(1)
        single = (flat == flat[:, :1]).all(1)
        own_rows = mine.nonzero().flatten()
        shared_rows = (~single).nonzero().flatten()
        positions = torch.where(owner == self.rank, local, -1)[:, shared_rows].to(device)
        shared = SharedRows(positions, self.all_reduce) if len(shared_rows) else None
        factor = Factor.of(local[:, own_rows], device, shared)
        counted = len(own_rows) + (len(shared_rows) if self.rank == 0 else 0)
        return factor, counted, torch.cat([own_rows, shared_rows]), index.shape[1]

    def local_part(self, i: int, full: Tensor) -> Tensor:
        """Parameter ``i``'s local padded shard of ``full`` (the whole parameter, any layout-independent values)."""
        fp, shape = self._fsdp[i], self.global_shapes[i]
        d = fp.fsdp_placement.dim
        pieces = full.reshape(shape).chunk(self.world, dim=d) if len(shape) else (full,)
        out = full.new_zeros(fp.padded_sharded_param_size)
        if self.rank < len(pieces):
            out.narrow(d, 0, pieces[self.rank].shape[d]).copy_(pieces[self.rank])
        return out.reshape(-1)

    def _check_flat(self, t: Tensor, what: str) -> None:
        if t.dim() != 1 or t.numel() != self.numel:
            raise ValueError(f"{what} must be a 1-D tensor of {self.numel} entries, got shape {tuple(t.shape)}")
        if t.device != self.device:
            raise ValueError(f"{what} is on {t.device}; the shards are on {self.device}")

    def _reshard_all(self) -> None:
        """Drop every all-gathered copy, so the next forward gathers from whatever the shards point at now (the root
        keeps its parameters unsharded after a forward that had no backward)."""
        for group in self._groups:
            if not group.is_sharded:
                group.reshard()

    @contextmanager
    def serving(self, theta: Tensor) -> Iterator[None]:
        """While inside, FSDP all-gathers from ``theta`` (the local flat vector, the parameters' dtype) instead of the
        model's shards; the shards themselves are never written to and the attribute is restored on any exit.

        ``theta`` may change between forwards: every forward of the root re-gathers. One forward per backward."""
        self._check_flat(theta, "theta")
        dtypes = {fp._sharded_param_data.dtype for fp in self._fsdp}
        if dtypes and dtypes != {theta.dtype}:
            raise ValueError(f"theta is {theta.dtype}; the shards are {sorted(map(str, dtypes))}")
        if self._serving is not None:
            raise RuntimeError("serving() is already active on this model")
        own = [fp._sharded_param_data for fp in self._fsdp]
        hooks = [r.register_forward_pre_hook(lambda *_: self._reshard_all(), prepend=True) for r in self._roots]
        self._reshard_all()
        self._serving = own
        try:
            for fp, view in zip(self._fsdp, theta.split(self.local_sizes)):
                fp._sharded_param_data = view
            yield
        finally:
            for fp, saved in zip(self._fsdp, own):
                fp._sharded_param_data = saved
            self._serving = None
            for hook in hooks:
                hook.remove()
            self._reshard_all()

    @contextmanager
    def stream_gradients(self, out: Tensor) -> Iterator[list[bool]]:
        """While inside, each parameter's local gradient (after FSDP's reduce-scatter, which averages over the ranks)
        is copied into its segment of ``out`` (zeros in the padding) and dropped at once. Yields the per-parameter
        "filled" flags; on exit the segments of parameters that got no gradient (frozen, unused) are zeroed and
        the ``.grad`` each parameter had before is put back. Meant for one backward per context."""
        self._check_flat(out, "out")
        segments = out.split(self.local_sizes)
        filled = [False] * len(self._fsdp)
        params = [fp.sharded_param for fp in self._fsdp]
        saved = [p.grad for p in params]
        handles = []
        try:
            for p in params:
                p.grad = None
            for i, (fp, p) in enumerate(zip(self._fsdp, params)):
                if p.requires_grad:  # FSDP reduces no gradient for a frozen parameter
                    handles.append(p.register_post_accumulate_grad_hook(self._grad_hook(i, fp, segments[i], filled)))
            yield filled
        finally:
            for h in handles:
                h.remove()
            for seg, done in zip(segments, filled):
                if not done:
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
    agreeing on an exit code). Raises ``RuntimeError`` outside a distributed launch (no ``RANK``/``WORLD_SIZE``)."""
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
    """Whether any module of ``model`` is an FSDP2 module (then the engine measures it sharded)."""
    return bool(_fsdp_modules(model))


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

