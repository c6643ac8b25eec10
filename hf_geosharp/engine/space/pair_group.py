"""A group of equal-shaped attention pairs as the perturbation space works on it: where its factors sit in the flat
vector (:class:`~hf_geosharp.engine.space.coordinates.Factor`), its geometry at the base point, and the head chunks in
which every operation runs. The geometry keeps the base point where the workspace's rule allows (one chunk: each
operation runs once on the whole group, whatever the depth); otherwise, where the layout allows, the group holds views
of its base point into the weights, so that no copy of the paired weights is kept (each chunk reads its own into the
workspace and hands it to the geometry).
"""

from __future__ import annotations

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
    #: The base point's factors as views into the weights (see :meth:`Factor.segment_views`) where the geometry
    #: keeps no copy of them (``geometry.G is None``); each head chunk then reads its own into the workspace.
    base_views: tuple[list, list] | None = None
    #: With ``base_views`` on a shard: the base point's shared rows of ``G`` and ``H`` (a copy; None without any).
    shared_base: tuple[Tensor | None, Tensor | None] = (None, None)
    #: Each head's calibration weight of the metric (float64 ``[k]``, see
    #: :func:`~hf_geosharp.engine.space.perturbation_space.pair_weights`); None: the paper's unweighted metric.
    weight: Tensor | None = None

    def base(self, ws: Workspace, heads: slice) -> Pair | None:
        """The base point of ``heads`` read into ``ws`` where the geometry does not keep it; None where it does."""
        if self.base_views is None:
            return None
        return tuple(self._read(f, views, shared, ws.take(f.rows(heads)), heads) for f, views, shared
                     in zip((self.g, self.h), self.base_views, self.shared_base))

    def part(self, ws: Workspace, heads: slice) -> GLQuotient:
        """The geometry of ``heads`` at its base point (read into ``ws`` if not kept; the geometry itself for one
        chunk of a kept base point)."""
        return self.geometry.heads(heads, self.base(ws, heads))

    @staticmethod
    def _read(factor: Factor, views: list, shared: Tensor | None, out: Tensor, heads: slice = slice(None)) -> Tensor:
        """``out <-`` the base point's ``factor`` for ``heads``: own rows from the weights, shared ones copied."""
        factor.gather_views(views, out, heads)
        if shared is not None:
            out[:, factor.n_own :].copy_(shared[heads])
        return out

    def whole(self) -> GLQuotient:
        """The whole group's geometry at its base point (a fresh copy of the base point, if not kept)."""
        if self.base_views is None:
            return self.geometry
        dtype, device = self.geometry.dtype, self.geometry._P64.device
        base = tuple(self._read(f, views, shared, torch.empty(f.shape, dtype=dtype, device=device))
                     for f, views, shared in zip((self.g, self.h), self.base_views, self.shared_base))
        return self.geometry.heads(slice(None), base)

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
        return self.geometry.rows.frobenius(a, b)
