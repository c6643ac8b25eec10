"""Embedding rows a worst-case solve never moves: the vocabulary its batches do not use.

The worst-case solver starts at zero and moves only along its step directions (metric-raised, projected
gradients), its momentum and the feasible set's radial scaling. The loss does not depend on the row of a token that
no batch contains, so that row's gradient is exactly zero at every point, and so are its direction and its
perturbation: the solver's vectors need not hold it. The measurement is the same (docs/scaling.md, "Embedding
rows"); the saving is large for encoders: half of MiniLM's 22.7 M parameters are its 30522 x 384 word embeddings, of
which a batch of 16 x 128 tokens uses a few thousand rows.

:func:`scan_used_rows` finds the rows with one gradient-free forward per batch under a ``TorchFunctionMode`` that
records what every ``F.embedding`` call looks up in each candidate weight. A weight is restricted only when nothing
but such lookups reads it (a tied LM head's ``F.linear`` reads every row, so tied embeddings stay whole), without
``max_norm`` (which renormalises the weight in place) or sparse gradients. During the solve, :class:`RowLookup`
answers each lookup of a restricted weight from the perturbed rows alone: ``F.embedding(place[ids], rows)`` returns
the same values as a lookup in the whole perturbed weight, and its backward the same gradient rows.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

#: Tensor methods that read a weight's metadata, not its values (attribute getters are recognised by name).
_METADATA = {Tensor.size, Tensor.dim, Tensor.numel, Tensor.is_floating_point, Tensor.is_complex, Tensor.element_size,
             Tensor.__len__}


@dataclass(frozen=True)
class UsedRows:
    """The rows of one embedding weight that the batches look up, and where each sits among them."""

    rows: Tensor  # sorted row indices, int64
    place: Tensor  # [num_rows] int64: row -> its position in ``rows``; -1 for the rows left out

    @classmethod
    def of(cls, rows: Tensor, num_rows: int) -> UsedRows:
        place = torch.full((num_rows,), -1, dtype=torch.long, device=rows.device)
        place[rows] = torch.arange(rows.numel(), device=rows.device)
        return cls(rows, place)


def _lookup(func: Callable, args: tuple, kwargs: dict) -> tuple[Tensor, Tensor, dict[str, Any]] | None:
    """``(ids, weight, options)`` of an ``F.embedding`` call, or None for any other function."""
    if func is not F.embedding:
        return None
    names = ("input", "weight", "padding_idx", "max_norm", "norm_type", "scale_grad_by_freq", "sparse")
    bound = {**dict(zip(names, args)), **kwargs}
    return bound.pop("input"), bound.pop("weight"), bound


def _reads_values(func: Callable) -> bool:
    return getattr(func, "__name__", "") != "__get__" and func not in _METADATA


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
            elif _reads_values(func):
                self.excluded |= hits
        return func(*args, **kwargs)


def scan_used_rows(params: list[Tensor], skip: set[int], forward: Callable[[], Any]) -> dict[int, UsedRows]:
    """``{position in params: rows}`` for the 2-D weights (positions not in ``skip``) that only embedding lookups
    read while ``forward()`` runs the model on every batch (gradient-free here), and that leaves partly unused."""
    weights = {id(p): i for i, p in enumerate(params) if i not in skip and p.dim() == 2}
    if not weights:
        return {}
    scan = _Scan(weights)
    with torch.no_grad(), scan:
        forward()
    found = {}
    for position, ids in scan.ids.items():
        num_rows = params[position].shape[0]
        if position in scan.excluded or not ids:
            continue
        rows = torch.cat(ids).unique()
        if rows.numel() < num_rows:
            found[position] = UsedRows.of(rows.to(params[position].device), num_rows)
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
            place = used.place[ids]
            if bool((place < 0).any()):
                raise RuntimeError("An embedding looked up a row that the scan of the batches did not see; this is a "
                                   "bug in hf_geosharp (please report it with the model).")
            padding = options.get("padding_idx")
            if padding is not None:
                found = int(used.place[padding % weight.shape[0]])
                options["padding_idx"] = found if found >= 0 else None  # an unused padding row changes nothing
            return func(place, rows, **options)
        if _reads_values(func) and any(isinstance(t, Tensor) and id(t) in self.restricted
                                       for t in tree_leaves((args, kwargs))):
            raise RuntimeError(f"{getattr(func, '__name__', func)} read an embedding weight that only lookups were "
                               "seen to read; this is a bug in hf_geosharp (please report it with the model).")
        return func(*args, **kwargs)
