"""The FSDP2 internals the engine uses, all in this module: what torch offers no public route to.

Everything else of FSDP2 is reached through its public API (:mod:`hf_geosharp.engine.placement.fsdp_layout`: the
mesh and shard dimension from each DTensor parameter, ``FSDPModule.unshard()/reshard()``, ``DTensor.to_local()`` of
parameters and gradients, ``register_post_accumulate_grad_hook``). Each private use, and why it has no public route:

* **The padded shard** (``FSDPParam._sharded_param_data``): FSDP all-gathers from one 1-D tensor per parameter, the
  local shard with its shard dimension padded to ``ceil(size / world)``. The engine lays its vectors out in these
  padded shards, so that every rank's vector has the same length and every global entry one fixed place; the public
  ``to_local()`` is the unpadded view of the same storage, so the padded tensor is not reachable without a copy.
* **Serving other weights** (:meth:`PaddedShards.replaced`): the attribute is pointed at the engine's buffer of
  perturbed weights for one measurement, so the model computes with them while its own shards, the base point, are
  never written. The public alternative, writing the perturbed weights into ``to_local()`` under ``no_grad`` as an
  optimizer does, overwrites the base point: keeping it costs a fifth parameter-sized vector (the memory goal is four
  float32 vectors, 16 bytes per parameter), and the model would then be restored after every evaluation instead of
  never being written to.
* **Lazy initialisation** (``FSDPState._lazy_init``): at the first forward FSDP marks the root and re-pads the shards
  (replacing the padded tensor); it must have run before the shards are read, and only a forward runs it publicly.
* **Refusals**: CPU offload and an int ``reshard_after_forward`` are settings FSDP keeps only internally
  (``offload_to_cpu``, ``post_forward_mesh_info``); under either the padded shard is not what the all-gather reads.

:func:`check_torch` checks the torch version once; an attribute missing on a newer torch raises the same clear error.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import Tensor, nn

#: The torch versions whose FSDP2 internals this module uses: the package's floor, 2.11, through 2.15, all run by CI.
SUPPORTED = "torch >= 2.11 (FSDP2 internals as of torch 2.11 to 2.15)"


def _unsupported(missing: str) -> RuntimeError:
    return RuntimeError(f"Measuring an FSDP2 model needs FSDP2 internals that this torch ({torch.__version__}) lacks "
                        f"({missing}); hf_geosharp supports {SUPPORTED}. Install a supported torch, or measure the "
                        "model unsharded.")


@functools.cache
def check_torch() -> None:
    """Raise a clear error on a torch whose FSDP2 lacks what this module uses (checked once per process)."""
    if torch.torch_version.TorchVersion(torch.__version__) < (2, 11):
        raise _unsupported("a torch older than 2.11")
    try:
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError as err:
        raise _unsupported(str(err)) from err
    wanted = {FSDPModule: ["_get_fsdp_state"], FSDPState: ["_lazy_init"]}
    missing = [f"{owner.__name__}.{name}" for owner, names in wanted.items() for name in names
               if not hasattr(owner, name)]
    missing += [f"FSDPParam.{name}" for name in ("_sharded_param_data", "sharded_param")
                if name not in FSDPParam.__annotations__]
    if missing:
        raise _unsupported(", ".join(missing))


@contextlib.contextmanager
def _internals() -> Iterator[None]:
    """Turn a missing internal attribute (a torch this module does not know) into the clear error."""
    try:
        yield
    except AttributeError as err:
        raise _unsupported(str(err)) from err


def _param_groups(state: Any) -> list[Any]:
    """The FSDP state's parameter groups: a list from torch 2.13, before it one group or None."""
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    return [] if state._fsdp_param_group is None else [state._fsdp_param_group]


class PaddedShards:
    """The padded shards FSDP all-gathers from, for the parameters of the FSDP2 ``modules`` (in pre-order).

    Creating it runs FSDP's lazy initialisation (what the first forward would do); the first uninitialised state met
    in pre-order is a root and initialises everything below it."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        check_torch()
        self._groups: list[Any] = []
        with _internals():
            for module in modules:
                state = module._get_fsdp_state()
                if state._is_root is None:
                    state._lazy_init()
                self._groups.extend(g for g in _param_groups(state) if g not in self._groups)
            self._by_param = {id(fp.sharded_param): fp for g in self._groups for fp in g.fsdp_params}
        self._order: list[Any] = []
        self._own: list[Tensor] | None = None  # the model's shards while others are served

    def manages(self, param: Tensor) -> bool:
        """Whether FSDP shards ``param`` (a parameter of the modules, as the model registers it)."""
        return id(param) in self._by_param

    def refuse_unsupported(self, named: Sequence[tuple[str, Tensor]]) -> None:
        """A ValueError for what the padded shards cannot serve: CPU offload, an int ``reshard_after_forward``."""
        with _internals():
            for group in self._groups:
                if group.post_forward_mesh_info is not None and group.post_forward_mesh_info != group.mesh_info:
                    raise ValueError("reshard_after_forward given as an int is not supported; pass True or False")
            for name, param in named:
                if self.manages(param) and self._by_param[id(param)].offload_to_cpu:
                    raise ValueError(f"{name}: FSDP CPU offload is not supported (the shards must live on the mesh)")

    def select(self, params: Sequence[Tensor]) -> None:
        """Address the shards of ``params`` (each managed by FSDP), in that order, from now on."""
        self._order = [self._by_param[id(p)] for p in params]

    def own(self) -> list[Tensor]:
        """Per parameter the 1-D padded shard as FSDP stores it, also while others are served (read, never write)."""
        if self._own is not None:
            return list(self._own)
        with _internals():
            return [fp._sharded_param_data for fp in self._order]

    @contextlib.contextmanager
    def replaced(self, shards: Sequence[Tensor]) -> Iterator[None]:
        """While inside, FSDP all-gathers parameter ``i`` from ``shards[i]``; the attribute is restored on any exit."""
        if self._own is not None:
            raise RuntimeError("serving() is already active on this model")
        own = self.own()
        self._own = own
        try:
            for fp, shard in zip(self._order, shards):
                fp._sharded_param_data = shard
            yield
        finally:
            for fp, saved in zip(self._order, own):
                fp._sharded_param_data = saved
            self._own = None
