"""Where the worst case is, and what the loss does along it.

For each batch's best point ``xi`` (a horizontal tangent vector of the perturbation space) this module reads

* its **breakdown** by block: the block's part of ``||xi||_g^2`` in the measure's own metric (the GL(h)-quotient
  metric on the attention pairs, the elementwise adaptive metric elsewhere) and of the loss increase's first-order
  term ``<grad L(w), xi>_g``. The metric is block-diagonal over heads and coordinates, and for a horizontal ``xi``
  the Riemannian gradient's product is the Euclidean one (``<grad_g L, xi>_g = <dL/dw, xi>``, per block too), so
  both are sums of per-block parts; blocks are the attention pairs (one per head or KV group, named by the symmetry
  map) and, outside the pairs, the parameters, grouped by transformer layer (:func:`block_of`);
* the **perturbation** itself, ``Exp(w; xi) - w`` per parameter (:class:`WorstCasePerturbation`, opt-in: it is
  parameter-sized);
* the **profile** (opt-in): the loss along ``t -> Exp(w; t xi)`` and along the straight segment
  ``t -> w + t (Exp(w; xi) - w)`` through the same end point, for ``t`` in ``[0, 2]``.

The breakdown needs the gradient at the clean point: the solver's copy of it where the memory rule keeps one
(:func:`~hf_geosharp.engine.solvers.memory.keeps_clean_gradient`), else one forward and backward per batch. A
profile costs two forwards per point. One process holds the whole vector
(:class:`~hf_geosharp.engine.placement.single.SingleProcess`); a sharded run has no breakdown.
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..symmetry.base import SymmetryMap
from .model_function.embedding_rows import UsedRows
from .model_function.objective import Objective
from .placement.single import reparametrized
from .result import BlockShare, Breakdown
from .space.perturbation_space import PerturbationSpace

#: A module path up to its first numeric component: the transformer layer (``bert.encoder.layer.3``).
_LAYER = re.compile(r"^((?:.*?\.)?\d+)(?:\.|$)")


def block_of(name: str) -> tuple[str, bool]:
    """The block a parameter (or module) belongs to, and whether it is a layer: the path through the first numeric
    component of its name (``bert.encoder.layer.3``, ``model.layers.0``, ``encoder.block.5``); outside the layers,
    the first two components of its module path (``bert.embeddings``, ``classifier``)."""
    found = _LAYER.match(name)
    if found:
        return found.group(1), True
    module = name.rsplit(".", 1)[0] if "." in name else name
    return ".".join(module.split(".")[:2]), False


def profile_points(n: int) -> list[float]:
    """``n`` evenly spaced points of ``[0, 2]`` (``n`` odd, at least 3, so that ``t = 1`` is one of them, exactly)."""
    if isinstance(n, bool) or not isinstance(n, int) or n < 3 or n % 2 == 0:
        raise ValueError(f"profile_points must be an odd integer >= 3 (so that t = 1, the worst case, is one of "
                         f"them), got {n!r}.")
    return [2 * j / (n - 1) for j in range(n)]


@dataclass
class WorstCasePerturbation:
    """One batch's worst-case perturbation.

    Attributes:
        delta: ``Exp(w; xi) - w`` per parameter name, for the parameters it moves (the space's dtype: float32 or
            wider; the model's device). Tied weights appear once, under the name ``model.named_parameters()``
            gives.
        batch: the batch's index.
        loss: the loss the solver found at this point on that batch.
        clean_loss: the batch's clean loss.
        measure: the result's measure (``"geodesic_inv_worst"``, ...).
    """

    delta: dict[str, Tensor] = field(repr=False)
    batch: int
    loss: float
    clean_loss: float
    measure: str

    @contextlib.contextmanager
    def applied(self, model: nn.Module) -> Iterator[nn.Module]:
        """Inside the block, ``model`` computes with ``w + delta`` (rounded to each parameter's dtype); its own
        parameters are swapped out for the duration, never written, so its bits are unchanged afterwards. Put the
        model in the mode it was measured in (``model.eval()``) to reproduce ``loss``."""
        params = dict(model.named_parameters())
        self._check_fits(params)  # every tensor before the model is touched: broadcasting would hide a mismatch
        with torch.no_grad():
            moved = {name: (params[name].detach().to(d.dtype) + d.to(params[name].device)).to(params[name].dtype)
                     for name, d in self.delta.items()}
        with reparametrized(model, moved):
            yield model


    def _check_fits(self, params: dict[str, Tensor]) -> None:
        """Refuse a model this perturbation was not measured on: a missing parameter, another shape (a head with
        another number of labels would broadcast), or a parameter or delta that is not floating point. Another
        device is fine: the delta moves to the parameter's."""
        fix = "apply the perturbation to the model it was measured on."
        missing = sorted(set(self.delta) - set(params))
        if missing:
            raise ValueError(f"the model has no parameters {missing[:3]}: {fix}")
        for name, d in self.delta.items():
            if not isinstance(d, Tensor) or not d.is_floating_point():
                raise ValueError(f"the perturbation of {name!r} is not a floating-point tensor "
                                 f"({getattr(d, 'dtype', type(d).__name__)}): {fix}")
            if tuple(d.shape) != tuple(params[name].shape):
                raise ValueError(f"parameter {name!r} has shape {list(params[name].shape)} in this model but "
                                 f"{list(d.shape)} in the perturbation: {fix}")
            if not params[name].is_floating_point():
                raise ValueError(f"parameter {name!r} is {params[name].dtype}, which a perturbation cannot move: "
                                 f"{fix}")


class WorstDirection:
    """Reads the best point of each batch (see the module docstring); built once per run, after the space.

    Args:
        space, objective: the run's (one process).
        names: every measured parameter's name, in the model's order (the space's ``segment_ids`` index it).
        rows: the embedding weights held by their used rows (``{position: UsedRows}``).
        symmetry_map: the map the space's pairs came from (None without pairs).
        measure: the result's measure name.
        n_profile: points of the profile (0: none).
        keep_perturbation: return each batch's perturbation.
    """

    def __init__(self, space: PerturbationSpace, objective: Objective, names: list[str], rows: dict[int, UsedRows],
                 symmetry_map: SymmetryMap | None, measure: str, n_profile: int = 0,
                 keep_perturbation: bool = False) -> None:
        self.space, self.objective, self.names, self.rows = space, objective, names, rows
        self.measure, self.keep_perturbation = measure, keep_perturbation
        self.t = profile_points(n_profile) if n_profile else []
        self.sizes = [b.numel() for b in space.base]
        self.starts = [0, *itertools.accumulate(self.sizes)]
        keys = [block_of(n) for n in names]
        self.layer_keys = list(dict.fromkeys(keys))  # (key, is_layer), in parameter order
        self.segment_layer = [self._layer(keys[i]) for i in space.segment_ids]
        self.pairs = self._pairs(symmetry_map)  # per head, in the space's order: (label, layer, head, kind)
        order = sorted(range(len(self.pairs)), key=lambda i: self.pairs[i][4])
        self.head_order = order  # parameter order of the heads

    def _layer(self, key: tuple[str, bool]) -> int:
        if key not in self.layer_keys:
            self.layer_keys.append(key)
        return self.layer_keys.index(key)

    def _pairs(self, smap: SymmetryMap | None) -> list[tuple[str, int, int, str, tuple[int, int]]]:
        """``(label, layer position, head, kind, (parameter, offset) of G[0, 0])`` per pair of the space."""
        anchors = self.space.pair_anchors()
        if not anchors:
            return []
        if smap is None:
            raise ValueError("the space has attention pairs but no symmetry map was given to name them.")
        offsets = smap.offsets
        ends = torch.tensor([*offsets[1:], smap.n_params])
        named: dict[tuple[int, int], tuple[str, int, int, str]] = {}
        for block in smap.blocks:
            first = block.G_index[:, 0, 0].cpu().contiguous()
            params = torch.bucketize(first, ends, right=True).tolist()
            for head, (p, flat) in enumerate(zip(params, first.tolist())):
                label = block.labels[head] if head < len(block.labels) else f"{block.module} pair {head}"
                named[(p, flat - offsets[p])] = (label, self._layer(block_of(block.module)), head, block.kind)
        out = []
        for group in anchors:
            for position in group.tolist():
                s = bisect.bisect_right(self.starts, position) - 1
                where = (self.space.segment_ids[s], position - self.starts[s])
                if where not in named:
                    raise RuntimeError(f"no pair of the symmetry map starts at parameter {self.names[where[0]]!r}, "
                                       f"entry {where[1]}; this is a bug in the breakdown.")
                out.append((*named[where], where))
        return out

    # ------------------------------------------------------------------ per batch
    def read(self, xi: Tensor, index: int, clean_loss: float, best_loss: float,
             gradient: Tensor | None = None) -> dict[str, Any]:
        """``{"parts": [[norm_sq, first_order] per layer, per head, outside the pairs], "geodesic", "segment":
        profile curves or None, "perturbation": WorstCasePerturbation or None}`` for the best point ``xi`` of the
        objective's current batch; ``gradient``: the loss's gradient at the clean point where the solver kept it
        (else one forward and backward computes it)."""
        space = self.space
        grad = gradient
        if grad is None:  # dL/dxi at 0 = dL/dw: Exp's derivative at 0 is the identity
            _, grad = self.objective(space.zero(), True)
        seg_norm, _ = space.segment_products(xi, xi)
        _, seg_first = space.segment_products(grad, xi)
        pair_norm = torch.cat([m for m, _ in space.pair_products(xi, xi)]) if self.pairs else torch.zeros(0)
        pair_first = torch.cat([p for _, p in space.pair_products(grad, xi)]) if self.pairs else torch.zeros(0)
        del grad
        layers = torch.zeros(len(self.layer_keys), 2, dtype=torch.float64)
        segment = torch.stack([seg_norm, seg_first], 1).cpu()
        layers.index_add_(0, torch.tensor(self.segment_layer, dtype=torch.long), segment)
        heads = torch.stack([pair_norm, pair_first], 1).cpu().to(torch.float64)
        if self.pairs:
            layers.index_add_(0, torch.tensor([p[1] for p in self.pairs], dtype=torch.long), heads)
        reading: dict[str, Any] = {"layers": layers.tolist(), "heads": heads[self.head_order].tolist(),
                                   "outside": segment.sum(0).tolist(), "geodesic": None, "segment": None,
                                   "perturbation": None}
        if not self.t and not self.keep_perturbation:
            return reading
        delta = space.empty()
        space.exp_point(xi, delta, False)
        for w, d in zip(space.base, delta.split(self.sizes)):
            d.sub_(w.reshape(-1))
        if self.t:
            reading["geodesic"], reading["segment"] = self._profile(xi, delta, clean_loss)
        if self.keep_perturbation:
            reading["perturbation"] = WorstCasePerturbation(self._state_dict(delta), index, best_loss, clean_loss,
                                                            self.measure)
        return reading

    def _profile(self, xi: Tensor, delta: Tensor, clean_loss: float) -> tuple[list[float], list[float]]:
        """The loss increase along ``Exp(w; t xi)`` and along ``w + t delta`` at each ``t``."""
        space, objective = self.space, self.objective
        point = space.empty()
        geodesic, segment = [], []
        for t in self.t:
            geodesic.append(objective(torch.mul(xi, t, out=point), False)[0] - clean_loss)
            for w, d, o in zip(space.base, delta.split(self.sizes), point.split(self.sizes)):
                torch.add(w.reshape(-1), d, alpha=t, out=o)
            segment.append(loss_at(objective, point) - clean_loss)
        return geodesic, segment

    def _state_dict(self, delta: Tensor) -> dict[str, Tensor]:
        """``delta`` (laid out as the space holds the parameters) as full-shaped tensors by parameter name; an
        embedding held by its used rows gets zeros in the other rows."""
        params = self.objective.placement.holding.params  # type: ignore[attr-defined]
        out = {}
        for i, d in zip(self.space.segment_ids, delta.split(self.sizes)):
            p = params[i]
            if i in self.rows:
                full = torch.zeros(p.shape, dtype=d.dtype, device=d.device)
                full.index_copy_(0, self.rows[i].rows.to(d.device), d.view(-1, *p.shape[1:]))
                out[self.names[i]] = full
            else:
                out[self.names[i]] = d.reshape(p.shape).clone()
        return out

    # ------------------------------------------------------------------ over batches
    def breakdown(self, readings: list[dict[str, Any]]) -> Breakdown:
        """The mean over batches of each block's parts, with their shares of the totals."""
        n = len(readings)
        layers = torch.tensor([r["layers"] for r in readings], dtype=torch.float64).mean(0)
        heads = torch.tensor([r["heads"] for r in readings], dtype=torch.float64).reshape(n, -1, 2).mean(0)
        outside = torch.tensor([r["outside"] for r in readings], dtype=torch.float64).mean(0)
        total = layers.sum(0)

        def share(part: float, whole: float) -> float:
            return part / whole if whole != 0 else float("nan")

        def block(name: str, layer: int | None, head: int | None, kind: str | None, parts: Tensor) -> BlockShare:
            norm_sq, first = (float(v) for v in parts)
            return BlockShare(name, layer, head, kind, norm_sq, first, share(norm_sq, float(total[0])),
                              share(first, float(total[1])))

        layer_index = {}
        for key, is_layer in self.layer_keys:
            if is_layer:
                layer_index[key] = len(layer_index)
        held = set(self.segment_layer) | {p[1] for p in self.pairs}  # layers with coordinates in the space
        rows = [block(key, layer_index.get(key), None, None, layers[i])
                for i, (key, _) in enumerate(self.layer_keys) if i in held]
        pairs = [self.pairs[i] for i in self.head_order]
        head_rows = [block(label, layer_index.get(self.layer_keys[layer][0]), head, kind, heads[j])
                     for j, (label, layer, head, kind, _) in enumerate(pairs)]
        return Breakdown(rows, head_rows, block("outside the pairs", None, None, None, outside), float(total[0]),
                         float(total[1]))


def loss_at(objective: Objective, point: Tensor) -> float:
    """The loss of the objective's current batch at the weights ``point`` (laid out as the space holds them), with
    no gradient: the evaluation the objective makes at ``Exp(w; xi)``, at any point."""
    with torch.no_grad(), objective.placement.substituted(point, False):
        loss = objective.loss_fn(objective.model, objective.batch)
        return float(objective.placement.batch_loss(loss, objective.batch)[0])
