"""A group of equal-shaped attention pairs as the perturbation space works on it: where its factors sit in the flat
vector (:class:`~hf_geosharp.engine.space.coordinates.Factor`), its geometry at the base point, the head chunks in which
every operation runs, and, where the layout allows, views of its base point into the weights, so that no copy of the
paired weights is kept (each chunk reads its own into the workspace).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch
from torch import Tensor

from ..geometry.gl_quotient import GLQuotient
from .coordinates import Factor
from .workspace import Workspace

Pair = tuple[Tensor, Tensor]


@dataclass
class PairGroup:
    """Pair blocks of one shape, stacked: their ``G`` and ``H`` factors, the geometry, and the head chunks in which
    operations run (rank-independent, so that sharded runs reduce in step)."""

    g: Factor
    h: Factor
    geometry: GLQuotient
    chunks: list[slice]
    #: The base point's factors as views into the weights (see :meth:`Factor.segment_views`); the geometry then
    #: keeps no copy of them, and each head chunk reads its own into the workspace (:meth:`part`).
    base_views: tuple[list, list] | None = None
    #: With ``base_views`` on a shard: the base point's shared rows of ``G`` and ``H`` (a copy; None without any).
    shared_base: tuple[Tensor | None, Tensor | None] = (None, None)
    #: Each head's calibration weight of the metric (float64 ``[k]``, see
    #: :func:`~hf_geosharp.engine.space.perturbation_space.pair_weights`); None: the paper's unweighted metric.
    weight: Tensor | None = None

    def part(self, ws: Workspace, heads: slice, geometry: GLQuotient | None = None) -> GLQuotient:
        """The geometry of ``heads`` (or ``geometry`` again), with its base point read into ``ws`` if not kept."""
        part = geometry or self.geometry.heads(heads)
        if self.base_views is not None:
            part.G, part.H = (self._read(f, views, shared, ws.take(f.rows(heads)), heads) for f, views, shared
                              in zip((self.g, self.h), self.base_views, self.shared_base))
        return part

    @staticmethod
    def _read(factor: Factor, views: list, shared: Tensor | None, out: Tensor, heads: slice = slice(None)) -> Tensor:
        """``out <-`` the base point's ``factor`` for ``heads``: own rows from the weights, shared ones copied."""
        factor.gather_views(views, out, heads)
        if shared is not None:
            out[:, factor.n_own :].copy_(shared[heads])
        return out

    @contextlib.contextmanager
    def whole_base(self) -> Iterator[GLQuotient]:
        """The whole group's geometry with its base point (a fresh copy while the block runs, if not kept)."""
        geometry = self.geometry
        if self.base_views is None:
            yield geometry
            return
        dtype, device = geometry.dtype, geometry._P64.device
        geometry.G, geometry.H = (self._read(f, views, shared, torch.empty(f.shape, dtype=dtype, device=device))
                                  for f, views, shared in zip((self.g, self.h), self.base_views, self.shared_base))
        try:
            yield geometry
        finally:
            geometry.G = geometry.H = None

    def gather(self, x: Tensor, ws: Workspace, heads: slice) -> Pair:
        """This group's coordinates of the flat vector ``x`` for ``heads``, in workspace tensors."""
        g, h = self.g, self.h
        return g.gather(x, ws.take(g.rows(heads)), heads), h.gather(x, ws.take(h.rows(heads)), heads)

    def write(self, out: Tensor, pair: Pair, heads: slice, add: bool = False) -> None:
        """Write (or add) both factors of ``pair`` for ``heads`` into the flat vector ``out``."""
        self.g.write(out, pair[0], heads, add)
        self.h.write(out, pair[1], heads, add)

    def own_dot(self, a: Pair, b: Pair) -> Tensor:
        """``<a, b>`` (Frobenius) over the rows this rank counts (shared rows on one rank only), float64."""
        nG, nH = self.geometry._rows
        return (torch.dot(a[0][:, :nG].reshape(-1), b[0][:, :nG].reshape(-1)).double()
                + torch.dot(a[1][:, :nH].reshape(-1), b[1][:, :nH].reshape(-1)).double())
