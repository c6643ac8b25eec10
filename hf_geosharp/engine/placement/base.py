"""A placement: where the engine's flat vectors live and how the model computes with them.

The builder (:mod:`hf_geosharp.engine.builder`) decides once what the engine's vector holds of each parameter (a
:class:`Holding`: the covered parameters and, of an embedding that only lookups read, the rows the batches use); the
placement it is given realises that decision. :class:`~hf_geosharp.engine.placement.single.SingleProcess` holds the
parameters themselves and swaps views of the perturbed weights into the model for each call;
:class:`~hf_geosharp.engine.placement.fsdp.FsdpPlacement` holds this rank's FSDP2 shards and has FSDP gather the
perturbed shards. The space, the solver and the objective are the same for both.
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import Tensor

from ...symmetry.base import PairBlock
from ..model_function.embedding_rows import UsedRows
from ..settings import RunSettings
from ..space.perturbation_space import Shard
from ..space.workspace import Workspace

#: Runs the backward pass of a loss and leaves ``dloss/dtheta`` in the buffer the perturbed weights were served from.
Backward = Callable[[Tensor], None]


@dataclass(frozen=True)
class Holding:
    """What the engine's flat vector holds of the model's parameters, in order.

    Attributes:
        names, params: every measured parameter (``measured_parameters``).
        covered: positions in ``params`` of the parameters the vector holds (the others stay the model's).
        rows: ``{position: rows}`` for embedding weights of which only the rows the batches look up are held
            (:mod:`hf_geosharp.engine.model_function.embedding_rows`); their lookups read the perturbed rows.
    """

    names: list[str]
    params: list[Tensor]
    covered: list[int]
    rows: dict[int, UsedRows] = field(default_factory=dict)

    @classmethod
    def whole(cls, names: list[str], params: list[Tensor]) -> Holding:
        """Every parameter, whole."""
        return cls(names, params, list(range(len(params))))


class Placement(Protocol):
    """What the builder, the objective and the runner ask of a placement.

    ``rank`` and ``world`` say which process this is of how many; ``shard`` is what a sharded space needs (None in
    one process); ``where`` completes the runner's log line (e.g. " on this rank of 4")."""

    rank: int
    world: int
    shard: Shard | None
    where: str

    @property
    def device(self) -> torch.device:
        """Where the engine's vectors and the batches live."""
        ...

    def batches(self, n_batches: int) -> range:
        """The batches (by index) this process solves."""
        ...

    def collect(self, results: dict[int, Any]) -> dict[int, Any]:
        """Every batch's result, from this process's (per-batch results gathered where processes split them)."""
        ...

    def prepare(self, settings: RunSettings, params: list[Tensor], batches: list[Any]) -> None:
        """Refuse settings that cannot run here and ready the model for them (inside the model-state guarantee)."""
        ...

    def all_reduce(self, t: Tensor) -> Tensor:
        """In-place sum of ``t`` over the processes that share the vectors; ``t`` itself in one process."""
        ...

    def covered(self, params: list[Tensor], trainable: list[bool], pair_params: set[int]) -> list[int]:
        """The positions of the parameters the vector holds when only what can move need be held (the parameters
        that may move: ``trainable``; a pair's, by ``pair_params``); those held that cannot move are masked."""
        ...

    def looked_up(self, positions: list[int]) -> AbstractContextManager[dict[int, Tensor]]:
        """Of the parameters at ``positions``, those whose used rows this placement can hold, as the weights that
        the model's lookups receive during a forward, while inside."""
        ...

    def hold(self, holding: Holding, blocks: list[PairBlock]) -> tuple[list[Tensor], list[PairBlock]]:
        """Lay the vector out as ``holding`` says: the base point per covered parameter (read, never written), and
        ``blocks`` (whose parameters are all held whole) in the coordinates the space is given."""
        ...

    def workspace(self, numel: int, dtype: torch.dtype) -> Workspace:
        """The geometry's scratch memory for a vector of ``numel`` entries."""
        ...

    def substituted(self, out: Tensor, need_grad: bool) -> AbstractContextManager[Backward]:
        """While inside, the model computes with the perturbed weights in ``out`` (laid out as held); the yielded
        backward writes ``dloss/dtheta`` over them (zeros where no gradient arrives)."""
        ...

    def batch_loss(self, loss: Tensor, batch: Any) -> tuple[Tensor, Tensor]:
        """The batch's loss value (detached, 0-dim, on the device: nothing is read by the host) and the tensor whose
        backward gives the batch's gradient."""
        ...
