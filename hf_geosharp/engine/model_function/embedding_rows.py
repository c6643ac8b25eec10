"""Embedding rows a worst-case solve never moves: the vocabulary its batches do not use.

The worst-case solver starts at zero and moves only along its step directions (metric-raised, projected
gradients), its momentum and the feasible set's radial scaling. The loss does not depend on the row of a token that
no batch contains, so that row's gradient is exactly zero at every point, and so are its direction and its
perturbation: the solver's vectors need not hold it. The measurement is the same (docs/scaling.md, "Embedding
rows"); the saving is large for encoders: half of MiniLM's 22.7 M parameters are its 30522 x 384 word embeddings, of
which a batch of 16 x 128 tokens uses a few thousand rows.

:func:`scan_used_rows` finds the rows with one gradient-free forward per batch under a ``TorchFunctionMode`` that
records what every ``F.embedding`` call looks up in each candidate weight. A weight is restricted only when nothing
but such lookups touches it: every other call that receives it counts as a read of every row (a tied LM head's
``F.linear``, ``weight.T`` or ``weight.t()`` before a matmul, an ``einsum``, indexing, any view), unless it is one of a
few calls that return metadata, or an attribute getter that returns no tensor (``.shape``, ``.dtype``, ``.device``).
So the rule fails safe: an unknown use keeps the weight whole. Lookups with ``max_norm`` (which renormalises the
weight in place) or sparse gradients keep it whole too. During the solve, :class:`RowLookup`
answers each lookup of a restricted weight from the perturbed rows alone: ``F.embedding(place[ids], rows)`` returns
the same values as a lookup in the whole perturbed weight, and its backward the same gradient rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

#: Tensor methods that read a weight's metadata, not its values (attribute getters are recognised by name);
#: ``requires_grad_`` is what FSDP calls on its unsharded parameters when a parameter's flag changed.
_METADATA = {Tensor.size, Tensor.dim, Tensor.numel, Tensor.is_floating_point, Tensor.is_complex, Tensor.element_size,
             Tensor.__len__, Tensor.requires_grad_}


@dataclass(frozen=True)
class UsedRows:
    """The rows of one embedding weight that the batches look up, and where each sits among them."""

    rows: Tensor  # sorted row indices, int64
    place: Tensor  # [num_rows] int64: row -> its position in ``rows``; -1 for the rows left out
    #: Lookups already translated and checked (:meth:`places`), so that a solve's steps, which look up the same ids
    #: at every forward, neither wait for the device nor translate them again.
    _seen: dict = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, rows: Tensor, num_rows: int) -> UsedRows:
        """The sorted ``rows`` of a weight with ``num_rows`` rows, and their places."""
        place = torch.full((num_rows,), -1, dtype=torch.long, device=rows.device)
        place[rows] = torch.arange(rows.numel(), device=rows.device)
        return cls(rows, place)

    #: At most this many lookups are remembered (a solve's batches; the oldest are dropped first).
    SEEN = 64

    def places(self, ids: Tensor) -> Tensor:
        """``place[ids]``, refused if an id is a row left out. The translation of ids seen before is reused: the
        key is the memory the ids occupy, their layout and their version counter (an in-place write changes it),
        and the entry holds the ids themselves, so their memory cannot be reused by other ids while it lives.
        The check is an assertion on the device (``torch._assert_async``): the host never waits for it (on a CPU it
        raises at once; on CUDA, at the next synchronisation)."""
        key = (ids.untyped_storage().data_ptr(), ids.storage_offset(), tuple(ids.shape), tuple(ids.stride()),
               ids.dtype, ids.device, ids._version)
        seen = self._seen.get(key)
        if seen is not None:
            return seen[1]
        place = self.place[ids]
        torch._assert_async((place >= 0).all(), "An embedding looked up a row that the scan of the batches did not "
                            "see; this is a bug in hf_geosharp (please report it with the model).")
        if len(self._seen) >= self.SEEN:
            self._seen.pop(next(iter(self._seen)))
        self._seen[key] = (ids, place)
        return place

    def padding(self, padding_idx: int) -> int | None:
        """Where the row ``padding_idx`` sits among the used rows (None if unused), read once."""
        key = ("padding", padding_idx)
        if key not in self._seen:
            found = int(self.place[padding_idx])
            self._seen[key] = (None, found if found >= 0 else None)
        return self._seen[key][1]


def _lookup(func: Callable, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, dict[str, Any]] | None:
    """``(ids, weight, options)`` of an ``F.embedding`` call, or None for any other function."""
    if func is not F.embedding:
        return None
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    bound = {**dict(zip(names, args)), **kwargs}
    return bound.pop("input"), bound.pop("weight"), bound


def _reads_values(func: Callable, result: Any) -> bool:
    """Whether a call that received a weight may have read its values: every call but the metadata methods and the
    attribute getters that return no tensor (``.T``, ``.mT``, ``.data`` return views of the values)."""
    if func in _METADATA:
        return False
    getter = getattr(func, "__name__", "") == "__get__"
    return not getter or any(isinstance(t, Tensor) for t in tree_leaves(result))


class _Scan(TorchFunctionMode):
    """Records, per candidate weight, the ids looked up in it, and which weights anything else reads."""

    def __init__(self, weights: dict[int, int]) -> None:
        super().__init__()
        self.weights = weights  # id(weight) -> its position
        self.ids: dict[int, list[Tensor]] = {position: [] for position in weights.values()}
        self.excluded: set[int] = set()

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        hits = {self.weights[id(t)] for t in tree_leaves((args, kwargs))
                if isinstance(t, Tensor) and id(t) in self.weights}
        if hits:
            lookup = _lookup(func, args, kwargs)
            plain = lookup is not None and hits == {self.weights.get(id(lookup[1]))} and id(lookup[0]) not in \
                self.weights and not lookup[2].get("max_norm") and not lookup[2].get("sparse")
            if plain:
                self.ids[self.weights[id(lookup[1])]].append(lookup[0].detach().reshape(-1).unique())
                return func(*args, **kwargs)
        result = func(*args, **kwargs)
        if hits and _reads_values(func, result):
            self.excluded |= hits
        return result


def scan_used_rows(weights: dict[int, Tensor], forward: Callable[[], Any],
                   reduce: Callable[[Tensor], Tensor] | None = None) -> dict[int, UsedRows]:
    """``{position: rows}`` for the candidate 2-D ``weights`` (by position) that only embedding lookups read while
    ``forward()`` runs the model on every batch (gradient-free here), and that it leaves partly unused.

    ``reduce`` (an in-place sum over the ranks of a sharded run, called once on every rank) makes the rows those of
    every rank's batches, and leaves a weight whole when any rank saw it read otherwise."""
    if not weights:
        return {}
    scan = _Scan({id(w): position for position, w in weights.items()})
    with torch.no_grad(), scan:
        forward()
    device = next(iter(weights.values())).device
    seen = [torch.zeros(w.shape[0] + 1, dtype=torch.int32, device=device) for w in weights.values()]
    for counts, position in zip(seen, weights):  # the last entry counts the ranks that saw another read
        for ids in scan.ids[position]:
            counts[ids.to(device)] = 1
        counts[-1] = int(position in scan.excluded)
    if reduce is not None:
        seen = list(reduce(torch.cat(seen)).split([counts.numel() for counts in seen]))
    found = {}
    for counts, (position, weight) in zip(seen, weights.items()):
        rows = counts[:-1].nonzero().flatten()
        if not bool(counts[-1]) and 0 < rows.numel() < weight.shape[0]:
            found[position] = UsedRows.of(rows, weight.shape[0])
    return found


class RowLookup(TorchFunctionMode):
    """Inside the block, ``F.embedding(ids, weight)`` for a restricted ``weight`` reads its perturbed rows instead.

    ``restricted`` maps ``id(weight)`` to ``(used rows, perturbed rows)``; the model keeps its own weight, which
    nothing else may read (:func:`scan_used_rows` checked that at the unperturbed point; checked again here)."""

    def __init__(self, restricted: dict[int, tuple[UsedRows, Tensor]]) -> None:
        super().__init__()
        self.restricted = restricted

    def __torch_function__(self, func: Callable, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        lookup = _lookup(func, args, kwargs)
        if lookup is not None and id(lookup[1]) in self.restricted:
            ids, weight, options = lookup
            used, rows = self.restricted[id(weight)]
            place = used.places(ids)
            padding = options.get("padding_idx")
            if padding is not None:  # an unused padding row changes nothing
                options["padding_idx"] = used.padding(padding % weight.shape[0])
            return func(place, rows, **options)
        result = func(*args, **kwargs)
        if any(isinstance(t, Tensor) and id(t) in self.restricted for t in tree_leaves((args, kwargs))) and \
                _reads_values(func, result):
            raise RuntimeError(f"{getattr(func, '__name__', func)} read an embedding weight that only lookups were "
                               "seen to read; this is a bug in hf_geosharp (please report it with the model).")
        return result


class _RowsOfEveryRank(torch.autograd.Function):
    """Each rank's perturbed rows in their places among all the used rows, summed over the ranks (every row is held
    by one rank, so the sum is exact); the backward hands each rank its rows of the ranks' mean gradient, as FSDP's
    reduce-scatter does for the sharded weights."""

    @staticmethod
    def forward(ctx: Any, local: Tensor, slots: Tensor, n_rows: int, reduce: Callable[[Tensor], Tensor],
                world: int) -> Tensor:
        ctx.slots, ctx.reduce, ctx.world = slots, reduce, world
        return reduce(local.new_zeros((n_rows, local.shape[1])).index_copy_(0, slots, local))

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, ...]:
        mean = ctx.reduce(grad.clone(memory_format=torch.contiguous_format)).div_(ctx.world)
        return mean.index_select(0, ctx.slots), None, None, None, None


def rows_of_every_rank(local: Tensor, slots: Tensor, n_rows: int, reduce: Callable[[Tensor], Tensor],
                       world: int) -> Tensor:
    """The ``[n_rows, width]`` used rows of a sharded embedding, assembled on every rank from each rank's ``local``
    rows (at positions ``slots``) by ``reduce`` (an in-place sum over the ranks); differentiable in ``local``."""
    return _RowsOfEveryRank.apply(local, slots, n_rows, reduce, world)
