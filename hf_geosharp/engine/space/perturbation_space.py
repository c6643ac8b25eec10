"""The perturbation space: where the solver moves, in the model's own parameter coordinates.

A tangent vector ``xi`` is a flat tensor laid out like the concatenation of the base point's segments (the
parameters being measured, flattened). Coordinates that belong to a GL(h) pair are handled by
:class:`~hf_geosharp.engine.geometry.gl_quotient.GLQuotient`; all other coordinates by
:class:`~hf_geosharp.engine.geometry.elementwise.ElementwiseGeometry`. Adaptive sharpness is the same space with no
pairs and first-order steps, so one solver serves both measures. Where the pairs sit is
:mod:`hf_geosharp.engine.space.coordinates`.

Performance and memory: a solver step must cost one forward and one backward plus little else, and the parameter
vector is large (1e8 entries), so

* pair blocks of equal shape (every layer of a BERT) are stacked into one group, and every geometric operation runs
  once on the whole group (a few heads at a time only where memory requires it, :meth:`Workspace.plan`), with
  temporaries from the space's :class:`~hf_geosharp.engine.space.workspace.Workspace`: nothing pair-sized is allocated
  per step, and the count of operations per step does not grow with depth;
* the space stores nothing parameter-sized: it reads the base point from the weights and recomputes ``w^2`` in
  each pass;
* :meth:`PerturbationSpace.exp_point` writes the perturbed point into a caller's buffer without autograd; the
  derivative of the second-order geodesic term is a closed-form, pair-sized vector-Jacobian product applied
  afterwards;
* :meth:`PerturbationSpace.ascent_direction` uses the defining identity of the Riemannian gradient,
  ``<grad f, x>_g = <df, x>`` for horizontal ``x``, so the solver's norms cost one matrix-vector product per step,
  and it may write the direction over the gradient it comes from.

Sharded runs (:mod:`hf_geosharp.engine.placement.fsdp_layout`) pass a ``shard``: every vector is then this rank's
part, the pair factors hold this rank's rows (see :class:`~hf_geosharp.engine.space.coordinates.SharedRows`), and
every sum goes through ``shard.all_reduce``.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol, get_args

import torch
from torch import Tensor

from ...symmetry.base import PairBlock
from ..capture import capture_choice, compiled
from ..defaults import BALL, ELEMENTWISE_CURVATURE, EPSILON, METRIC
from ..geometry.elementwise import Curvature, ElementwiseGeometry, per_segment
from ..geometry.gl_quotient import GLQuotient, Metric, RowSums, cache_bytes, gl_quotient
from .coordinates import Factor, stack_alike
from .pair_group import PairGroup
from .workspace import Workspace

Pullback = Callable[[Tensor], None]
Pair = tuple[Tensor, Tensor]
Ball = Literal["calibrated", "paper"]
BALLS: tuple[Ball, ...] = get_args(Ball)
#: Group-sized temporaries one operation holds at most (the pullback: base point, cotangent, point and result).
_TEMPORARIES = 4


@dataclass(frozen=True)
class SpaceOptions:
    """How the perturbation space is built; the ablation switches of the paper's App. G live here.

    Attributes:
        metric: ``"inv"``/``"mix"`` for geodesic sharpness, ``None`` for adaptive sharpness (no pairs).
        epsilon: relaxation of ``G^T G`` and ``H^T H``.
        second_order: move attention pairs along ``Exp2`` (True) or ``w + xi`` (False).
        riemannian_norm: measure pairs in the quotient metric (True) or elementwise like adaptive sharpness.
        horizontal_projection: restrict pair perturbations to the horizontal space.
        elementwise_curvature: geodesic used for the non-pair coordinates.
        ball: the radius convention: ``"calibrated"`` multiplies each pair's metric by its weight
            (:func:`pair_weights`), ``"paper"`` keeps the paper's unweighted metric.
    """

    metric: Metric | None = METRIC
    epsilon: float = EPSILON
    second_order: bool = True
    riemannian_norm: bool = True
    horizontal_projection: bool = True
    elementwise_curvature: Curvature = ELEMENTWISE_CURVATURE
    ball: Ball = BALL


def pair_weights(GtG: Tensor, HtH: Tensor, metric: Metric, n: int, m: int, epsilon: float = EPSILON) -> Tensor:
    """Each head's calibration weight of the metric under ``ball="calibrated"`` (float64 ``[k]``).

    inv: ``w = (n + m) / 2``, which makes the norm of scaling a head's factors, ``(G, H) -> (1 + t)(G, H)``, what
    adaptive sharpness gives it, ``t sqrt((n + m) h)`` (the inv metric gives that direction ``2 t^2 h``). mix:
    ``w = w_inv / lambda_min(P Q)``, the smallest weight that puts the mix ball inside the calibrated inv ball:
    ``w [tr(Q xi_G^T xi_G) + tr(P xi_H^T xi_H)] >= w_inv [tr(P^-1 xi_G^T xi_G) + tr(Q^-1 xi_H^T xi_H)]`` for every
    ``xi`` iff ``w Q >= w_inv P^-1`` and ``w P >= w_inv Q^-1``, i.e. ``w lambda_min(P Q) >= w_inv``. The eigenvalues of
    ``P Q`` (the relaxed Gram matrices) are those of ``L^T Q L`` (``P = L L^T``), so one batched ``h x h`` Cholesky
    and ``eigvalsh``; they are the squared singular values of ``G H^T``, each raised by the relaxation to
    ``(sigma + epsilon tau / sigma)^2 >= 4 epsilon tau`` (``tau = ||G H^T||_F^2 / h``). Both weights are invariant
    under the group (``P Q`` transforms by similarity), and a constant factor per head leaves the horizontal space
    and the geodesics of the metric unchanged (docs/method.md, "Radius convention").

    Args:
        GtG: ``[k, h, h]`` the unrelaxed ``G^T G`` (summed over the ranks on a shard).
        HtH: ``[k, h, h]`` the unrelaxed ``H^T H``.
        metric: ``"inv"`` or ``"mix"``.
        n: the rows of ``G`` (all ranks together).
        m: the rows of ``H``.
        epsilon: the metric's relaxation (:meth:`GLQuotient.relaxed_grams`), the same as the geometry's.

    Returns:
            ``[k]`` float64, positive and finite: ``lambda_min`` is floored at ``2.2e-16 lambda_max`` (below it the
        eigensolver's round-off); a head with ``G H^T = 0`` gets the relaxation's stand-in scale, as
        ``relaxed_grams`` does. ``P`` must be positive definite (``epsilon > 0``, or full-rank factors).
    """
    w_inv = torch.full(GtG.shape[:1], (n + m) / 2, dtype=torch.float64, device=GtG.device)
    if metric == "inv":
        return w_inv
    P, Q = GLQuotient.relaxed_grams(GtG.double(), HtH.double(), epsilon)
    L = torch.linalg.cholesky(P)
    eigenvalues = torch.linalg.eigvalsh(L.mT @ Q @ L)  # those of P Q, ascending
    top = eigenvalues[..., -1].clamp_min(torch.finfo(torch.float64).tiny)
    lowest = torch.maximum(eigenvalues[..., 0], torch.finfo(torch.float64).eps * top)
    return w_inv / lowest


class Shard(Protocol):
    """What a sharded run tells the space (implemented by
    :class:`hf_geosharp.engine.placement.fsdp_layout.ShardedLayout`)."""

    rank: int
    global_shapes: list[torch.Size]

    def all_reduce(self, t: Tensor) -> Tensor:
        """In-place sum of ``t`` over the ranks; returns ``t``."""
        ...

    def pair_factors(self, index: Tensor, device: torch.device) -> tuple[Factor, int, Tensor, int]:
        """This rank's part of a pair factor given by global indices ``[k, n, h]``: ``(factor, rows it counts in
        sums, the global row of each local row, n)``."""
        ...

    def local_part(self, i: int, full: Tensor) -> Tensor:
        """Parameter ``i``'s local part of ``full``, the whole parameter, laid out as this rank's vector holds it."""
        ...


def _identity(t: Tensor) -> Tensor:
    return t


class PerturbationSpace:
    """Norms, gradients, projections and geodesic points for flat tangent vectors at the base point.

    Args:
        base: the weights: one flat tensor, or the parameters being measured (any shapes; read, never copied or
            modified). The working dtype is float32, or wider if the weights are.
        blocks: GL(h) pair blocks, indexing the concatenation of ``base`` (ignored when ``options.metric`` is None).
        options: see :class:`SpaceOptions`.
        movable: ``[N]`` bool, the coordinates that may be perturbed (default: all).
        probe_seed: seed of the fixed probe used by the equivariant Gaussian sampler.
        workspace: the scratch memory of the geometry (default: a new :class:`Workspace`).
        shard: for sharded runs; ``blocks`` then index the unsharded parameters.
        segment_ids: which parameter of the model each segment of ``base`` is (default: 0, 1, ...); random
            directions are drawn per parameter from it, so they do not depend on which parameters are measured or on
            how they are sharded.
    """

    def __init__(
        self,
        base: Tensor | Sequence[Tensor],
        blocks: list[PairBlock],
        options: SpaceOptions = SpaceOptions(),
        movable: Tensor | None = None,
        probe_seed: int = 0,
        workspace: Workspace | None = None,
        shard: Shard | None = None,
        segment_ids: list[int] | None = None,
    ) -> None:
        self.base = [base.detach().reshape(-1)] if isinstance(base, Tensor) else [b.detach().reshape(-1) for b in base]
        self._base_sizes = [b.numel() for b in self.base]
        self.segment_ids = list(range(len(self.base))) if segment_ids is None else list(segment_ids)
        self.options, self.shard, self.numel = options, shard, sum(self._base_sizes)
        widest = max((b.dtype for b in self.base), key=lambda d: torch.finfo(d).bits)
        self.dtype = torch.promote_types(torch.float32, widest)
        self.device = self.base[0].device
        self.workspace = workspace or Workspace(self.dtype, self.device)
        self._reduce = shard.all_reduce if shard is not None else _identity
        movable = None if movable is None else movable.to(device=self.device, dtype=torch.bool)
        blocks = [  # only while building: the index maps cost 8 bytes per pair coordinate
            b for b in (blocks if options.metric is not None else [])
            if shard is not None or movable is None
            or bool(movable[b.G_index.to(self.device)].all() and movable[b.H_index.to(self.device)].all())
        ]
        self.pairs = self._build_pairs(blocks, probe_seed)
        self._capture: _Captured | None = None  # the compiled step functions, while captured() is active
        self._compiled: dict[str, _Captured] = {}
        pair_mask = self._pair_mask()
        measure = pair_mask.logical_not() if pair_mask is not None else movable
        if pair_mask is not None and movable is not None:
            measure &= movable
        keep = per_segment(pair_mask, self._base_sizes, False)
        self.elementwise = ElementwiseGeometry(
            self.base, curvature=options.elementwise_curvature, dtype=self.dtype,
            measure=per_segment(measure, self._base_sizes, True), keep=keep,
        )
        # Ablation "riemannian_norm=False": pair coordinates are measured like adaptive sharpness measures them.
        self.pair_elementwise = (
            None if options.riemannian_norm or not self.pairs
            else ElementwiseGeometry(self.base, dtype=self.dtype, measure=keep)
        )
        pairs_in = [k is not False for k in keep]
        self._segment_moves = [a or b for a, b in zip(self.elementwise.segment_moves(), pairs_in)]

    def _build_pairs(self, blocks: list[PairBlock], probe_seed: int) -> list[PairGroup]:
        """Stack the blocks into groups and build each group's geometry at the base point (one flat copy of the
        weights exists while this runs)."""
        if not blocks:
            return []
        flat = torch.cat([b.to(self.dtype) for b in self.base])
        probe = torch.Generator().manual_seed(probe_seed)
        groups, stacked = [], stack_alike(blocks)
        # global sizes: every rank decides and chunks alike
        caches = sum(cache_bytes(gi.shape[0], gi.shape[2], self.dtype) for gi, _, _ in stacked)
        keep = self.workspace.plan([gi.shape[0] * (gi.shape[1] + hi.shape[1]) * gi.shape[2] for gi, hi, _ in stacked],
                                   _TEMPORARIES, held=-(-caches // self.dtype.itemsize))
        for gi, hi, basis in stacked:
            if self.shard is None:
                g, h = Factor.of(gi, self.device), Factor.of(hi, device=self.device)
                rows = None
            else:
                g, nG, rows_G, n_global_G = self.shard.pair_factors(gi, self.device)
                h, nH, rows_H, n_global_H = self.shard.pair_factors(hi, self.device)
                rows = RowSums((nG, nH), self._reduce, (rows_G, rows_H), (n_global_G, n_global_H))
            G = g.gather(flat, torch.empty(g.shape, dtype=self.dtype, device=self.device))
            H = h.gather(flat, torch.empty(h.shape, dtype=self.dtype, device=self.device))
            views, shared = (g.segment_views(self.base), h.segment_views(self.base)), (None, None)
            rows_shared = sum(f.shape[1] - f.n_own for f in (g, h))  # copied anyway (heads cut across ranks, biases)
            if keep or None in views or 2 * rows_shared > g.shape[1] + h.shape[1]:
                views = None  # the geometry keeps its copy of the base point
            else:  # read from the weights, a head chunk at a time
                shared = tuple(F[:, f.n_own :].clone() if f.shared is not None else None for F, f in ((G, g), (H, h)))
            geometry = gl_quotient(G, H, self.options.metric, self.options.epsilon, basis, probe, rows=rows,
                                   keep_base=views is None)
            per_head = (gi.shape[1] + hi.shape[1]) * gi.shape[2]  # global sizes: every rank chunks alike
            step = self.workspace.heads_per_chunk(per_head, _TEMPORARIES - 1 if keep else _TEMPORARIES)
            chunks = [slice(k, min(k + step, gi.shape[0])) for k in range(0, gi.shape[0], step)]
            calibrated = self.options.ball == "calibrated" and self.options.riemannian_norm
            weight = self._pair_weights(G, H, rows) if calibrated else None
            groups.append(PairGroup(g, h, geometry, chunks, views, shared, weight))
        return groups

    def _pair_weights(self, G: Tensor, H: Tensor, rows: RowSums | None) -> Tensor:
        """:func:`pair_weights` of a group from its gathered factors (on a shard: the rows this rank counts, summed
        over the ranks, and the factors' global row counts)."""
        rows = rows or RowSums()
        G64, H64 = G.double(), H.double()
        GtG, HtH = rows.gram(G64, G64, 0), rows.gram(H64, H64, 1)
        n, m = (G.shape[1], H.shape[1]) if rows.whole is None else rows.whole
        return pair_weights(GtG, HtH, self.options.metric, n, m, self.options.epsilon)

    @staticmethod
    def _weighted(group: PairGroup, heads: slice, values: Tensor) -> Tensor:
        """Per-head ``values`` (``[k]``) times the heads' calibration weights (unchanged under the paper's ball)."""
        return values if group.weight is None else values * group.weight[heads]

    @staticmethod
    def _unweighted(group: PairGroup, heads: slice, pair: Pair) -> Pair:
        """``pair``'s heads divided by their calibration weights, in place (the Riemannian gradient of a metric
        multiplied by ``w`` is divided by ``w``)."""
        if group.weight is not None:
            scale = group.weight[heads].reciprocal().to(pair[0].dtype)[:, None, None]
            pair[0].mul_(scale)
            pair[1].mul_(scale)
        return pair

    # ------------------------------------------------------------------ helpers
    def zero(self) -> Tensor:
        """A zero tangent vector (the base point itself)."""
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def empty(self) -> Tensor:
        """An uninitialised flat vector (its pages cost memory only once written)."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def _pair_mask(self) -> Tensor | None:
        """``[N]`` bool, the coordinates of GL(h) pairs held here (``None`` without pairs); built on demand."""
        if not self.pairs:
            return None
        mask = torch.zeros(self.numel, dtype=torch.bool, device=self.device)
        for group in self.pairs:
            group.g.write(mask, torch.ones(group.g.shape, dtype=torch.bool, device=self.device))
            group.h.write(mask, torch.ones(group.h.shape, dtype=torch.bool, device=self.device))
        return mask

    @property
    def movable(self) -> Tensor:
        """``[N]`` bool: the coordinates that can move (frozen and zero-weight ones never do); a new tensor."""
        pair_mask = self._pair_mask()
        return self.elementwise.movable if pair_mask is None else pair_mask.logical_or_(self.elementwise.movable)

    def segment_moves(self) -> list[bool]:
        """For each segment of the base point (e.g. each parameter), whether any of its coordinates can move."""
        return list(self._segment_moves)

    @property
    def n_pairs(self) -> int:
        """How many GL(h) pairs (heads) the space holds."""
        return sum(group.g.shape[0] for group in self.pairs)

    @property
    def held_bytes(self) -> int:
        """What the space holds besides the solver's vectors: the pairs' ``h x h`` caches, index maps and copies of
        the base point, and the workspace they use (an input of the solver's memory rule,
        :func:`hf_geosharp.engine.solvers.memory.keeps_best_gradient`)."""
        tensors = []
        for group in self.pairs:
            geometry = vars(group.geometry)
            tensors += [*geometry.values(), *geometry.get("_low", {}).values(), *group.shared_base]
            for factor in (group.g, group.h):
                tensors += [factor.index, None if factor.shared is None else factor.shared.positions]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in tensors if isinstance(t, Tensor)}
        workspace = self.workspace.entries * self.workspace.dtype.itemsize if self.pairs else 0
        return sum(storages.values()) + workspace

    def total(self, values: Tensor) -> Tensor:
        """``values`` summed over the ranks of a sharded run (``values`` itself in one process)."""
        return self._reduce(values)

    def _chunks(self) -> Iterator[tuple[PairGroup, slice, GLQuotient]]:
        """Every (group, heads, geometry of those heads), with a fresh workspace for each."""
        for group in self.pairs:
            for heads in group.chunks:
                yield group, heads, group.part(self.workspace.fresh(), heads)

    def _map_pairs(self, x: Tensor, out: Tensor, fn: Callable[[GLQuotient, Pair], Pair]) -> None:
        """``out``'s pair coordinates <- ``fn(geometry, x's pair coordinates)``, a few heads at a time."""
        for group, heads, geometry in self._chunks():
            group.write(out, fn(geometry, group.gather(x, self.workspace, heads)), heads)

    # ------------------------------------------------------------------ metric
    def inner_product(self, a: Tensor, b: Tensor) -> Tensor:
        """Riemannian inner product at the base point (float64 scalar)."""
        total = self._reduce(self.elementwise.inner_product(a, b))
        if self.pair_elementwise is not None:
            return total + self._reduce(self.pair_elementwise.inner_product(a, b))
        for group, heads, geometry in self._chunks():
            ws = self.workspace
            products = geometry.inner_product(group.gather(a, ws, heads), group.gather(b, ws, heads))
            total = total + self._weighted(group, heads, products).sum()
        return total

    def norm(self, xi: Tensor) -> Tensor:
        """Riemannian norm at the base point (float64 scalar)."""
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    def riemannian_gradient(self, egrad: Tensor, out: Tensor | None = None) -> Tensor:
        """Raise the Euclidean gradient with the metric, then make it horizontal (a valid ascent direction).

        The slow, obvious path (:meth:`ascent_direction` is the fast one). Zero on frozen coordinates. Written into
        ``out`` when given (not ``egrad``)."""
        r = self.elementwise.euclidean_to_riemannian_gradient(egrad, out=out)
        if not self.pairs:
            return r
        if self.pair_elementwise is not None:
            r.addcmul_(egrad, self.pair_elementwise.scale_sq)
            if self.options.horizontal_projection:
                self._map_pairs(r, r, lambda g, x: g.projection(x))
            return r
        for group, heads, geometry in self._chunks():
            group.write(r, self._pair_gradient(group, heads, geometry, group.gather(egrad, self.workspace, heads)),
                        heads)
        return r

    def _pair_gradient(self, group: PairGroup, heads: slice, geometry: GLQuotient, egrad: Pair) -> Pair:
        rp = geometry.euclidean_to_riemannian_gradient(egrad)
        rp = geometry.projection(rp) if self.options.horizontal_projection else rp
        return self._unweighted(group, heads, rp)

    #: :meth:`ascent_direction` can leave its sums on the device (``host=False``): the solver's step reads nothing.
    sums_on_device = True

    def ascent_direction(self, egrad: Tensor, vectors: Tensor, out: Tensor, save: Tensor | None = None,
                         host: bool = True) -> tuple[Tensor, float | Tensor, list[float] | Tensor]:
        """The solver's step direction ``d = riemannian_gradient(egrad)``, written into ``out``, with ``<d, d>_g``
        and ``<d, v>_g`` for every horizontal row ``v`` of ``vectors`` (``[r, N]``, ``r`` may be 0); with ``save``,
        a copy of ``egrad`` is written there too (in the same pass: the solver keeps its best point's gradient so).

        ``out`` may be ``egrad`` itself: the gradient is then consumed, which spares the solver a parameter-sized
        buffer. One pass over the data computes the elementwise part of ``d``, its share of ``<d, d>_g = <e, d>``
        and the products ``<e, v>`` (for horizontal ``v`` and a g-self-adjoint projection, the defining identity of
        the Riemannian gradient gives ``<R e, v>_g = <e, v>``, checked by the tests); it leaves the pair
        coordinates alone, so the pair directions are then made from the gradient still there, a few heads at a
        time. With ``host=False`` the square (0-dim) and the products (``[r]``) come back as float64 tensors on the
        device, unread by the host. Under :meth:`captured` (``host=False``) it runs as one captured graph."""
        if self._capture is not None and not host and self.pair_elementwise is None:
            return self._capture.direction(egrad, vectors, out, save)
        if self.pair_elementwise is not None:  # ablation: the projection is not orthogonal in the measuring metric
            if save is not None:
                save.copy_(egrad)
            d = self.riemannian_gradient(egrad)
            sums = torch.stack([self.inner_product(d, d)] + [self.inner_product(d, v) for v in vectors])
            if not host:
                return out.copy_(d), sums[0].double().clamp_min(0.0), sums[1:].double()
            square, *products = sums.tolist()
            return out.copy_(d), max(square, 0.0), products
        out, square, products = self._direction(egrad, vectors, out, save)
        if not host:
            return out, square, products
        square, *products = torch.cat([square.reshape(1), products]).tolist()
        return out, square, products

    def _direction(self, egrad: Tensor, vectors: Tensor, out: Tensor, save: Tensor | None) -> tuple[Tensor, ...]:
        """:meth:`ascent_direction`'s work (outside the ablation): the direction into ``out``, ``<d, d>_g`` (0-dim)
        and ``<d, v>_g`` (``[r]``), float64 on the device."""
        square, products = self.elementwise.riemannian_gradient_pass(egrad, out, vectors, save)
        return self._pair_direction(egrad, out, square, products)

    def _pair_direction(self, egrad: Tensor, out: Tensor, square: Tensor, products: Tensor) -> tuple[Tensor, ...]:
        """:meth:`_direction` after the elementwise pass (its sums ``square`` and ``products``): the pairs'
        directions written into ``out`` and the sums completed. A function of tensors: :meth:`captured` compiles
        it."""
        sums = torch.cat([square.reshape(1), products])
        read = self._reads_first(egrad)
        for i, (group, heads, geometry) in enumerate(self._chunks()):
            e = group.gather(egrad, self.workspace, heads) if read is None else read[i]
            r = geometry.euclidean_to_riemannian_gradient(e, out=(self.workspace.take(e[0].shape),
                                                                 self.workspace.take(e[1].shape)))
            if self.options.horizontal_projection:
                geometry.projection(r, in_place=True)
            self._unweighted(group, heads, r)
            sums[0] += group.own_dot(e, r)
            group.write(out, r, heads)
        sums = self._reduce(sums)
        return out, sums[0].double().clamp_min(0.0), sums[1:].double()

    def horizontal(self, xi: Tensor) -> Tensor:
        """g-orthogonal projection onto the horizontal space (identity on movable elementwise coordinates, zero on
        frozen ones). A new tensor."""
        out = self.elementwise.restrict(xi)
        project = self.options.horizontal_projection
        self._map_pairs(xi, out, lambda g, x: g.projection(x, in_place=True) if project else x)
        return out

    def project(self, xi: Tensor, rho: float) -> Tensor:
        """Onto the feasible set ``{horizontal, ||xi||_g <= rho}``: horizontal projection, then radial scaling.

        Both steps are g-orthogonal, so their composition is the g-orthogonal projection onto the set."""
        xi = self.horizontal(xi)
        norm = float(self.norm(xi))
        return xi.mul_(rho / norm) if norm > rho else xi

    # ------------------------------------------------------------------ per-block reads (breakdowns)
    def segment_products(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """Per segment of the base point, over its coordinates outside the pairs: ``(<a, b>_g, <a, b>)`` (the
        metric and the Euclidean product), float64 ``[segments]`` each. One process only (not on a shard)."""
        self._refuse_shard("segment_products")
        return self.elementwise.segment_products(a, b)

    def pair_products(self, a: Tensor, b: Tensor) -> list[tuple[Tensor, Tensor]]:
        """Per pair group, per head: ``(<a, b>_g, <a, b>)`` over that head's pair coordinates, float64 ``[k]``
        each. The metric is block-diagonal over heads and segments, so :meth:`segment_products` and these sum to
        :meth:`inner_product`. One process only (not on a shard)."""
        self._refuse_shard("pair_products")
        scale_sq = None if self.pair_elementwise is None else self.pair_elementwise.scale_sq  # (ablation only)
        out = []
        for group in self.pairs:
            metric, plain = [], []
            for heads in group.chunks:
                ws = self.workspace.fresh()
                geometry = group.part(ws, heads)
                x, y = group.gather(a, ws, heads), group.gather(b, ws, heads)
                plain.append(sum((p * q).sum(dim=(1, 2), dtype=torch.float64) for p, q in zip(x, y)))
                if scale_sq is None:
                    metric.append(self._weighted(group, heads, geometry.inner_product(x, y).to(torch.float64)))
                else:
                    sq = group.gather(scale_sq, ws, heads)
                    metric.append(sum(torch.where(s > 0, p * q / s, 0.0).sum(dim=(1, 2), dtype=torch.float64)
                                      for p, q, s in zip(x, y, sq)))
            out.append((torch.cat(metric), torch.cat(plain)))
        return out

    def pair_anchors(self) -> list[Tensor]:
        """Per pair group, where each head's ``G[0, 0]`` entry sits in the flat vector (int64 ``[k]``, CPU): what
        names a head (it is the first entry of its ``G`` factor in the symmetry map too). One process only."""
        self._refuse_shard("pair_anchors")
        anchors = []
        for group in self.pairs:
            factor = group.g
            if factor.index is not None:
                anchors.append(factor.index[:, 0, 0].cpu())
                continue
            first = torch.full((factor.shape[0],), -1, dtype=torch.long)
            for piece in factor.pieces:
                if piece.r.start == 0:
                    heads = torch.arange(piece.k.start, piece.k.stop)
                    first[heads] = piece.offset + (heads - piece.k.start) * piece.stride[0]
            anchors.append(first)
        return anchors

    def _refuse_shard(self, what: str) -> None:
        if self.shard is not None:
            raise NotImplementedError(f"{what} reads one process's whole vector; a sharded space has a part of it.")

    # ------------------------------------------------------------------ geodesics
    def exp_point(self, xi: Tensor, out: Tensor, need_grad: bool) -> Pullback | None:
        """Write ``Exp(w; xi)`` into ``out``: ``Exp2`` on pairs, the chosen curvature elsewhere.

        ``out`` is filled without autograd. With ``need_grad`` the return value is the pullback ``pullback(grad)``
        that turns ``dL/dtheta`` (a flat tensor, modified in place) into ``dL/dxi``; it reads ``xi`` again, which
        must not change in between; it is ``None`` for a first-order space, where the two coincide. Pairs use the
        closed-form pullback of :meth:`GLQuotient.exp2_correction_with_pullback`; the (ablation-only) elementwise
        curvature is differentiated by autograd. Under :meth:`captured` (first-order elementwise coordinates) the
        point and the pullback each run as one captured graph."""
        if self._capture is not None and self.options.elementwise_curvature == "none":
            return self._capture.exp_point(xi, out, need_grad)
        self._first_order_point(xi, out)
        curvature = None
        if self.options.elementwise_curvature != "none":
            leaf = xi.detach().requires_grad_(need_grad)
            with torch.set_grad_enabled(need_grad):
                correction = self.elementwise.exp_correction(leaf)
            out.add_(correction.detach())
            curvature = (correction, leaf)
        pulls = []  # per head chunk: the pullback, which keeps only h x h factors of the forward
        if self.options.second_order:
            for group, heads, geometry in self._chunks():
                x = group.gather(xi, self.workspace, heads)
                correction, pull = geometry.exp2_correction_with_pullback(x, out=self._like(x))
                group.write(out, correction, heads, add=True)
                pulls.append((group, heads, pull))
        if not need_grad or (curvature is None and not pulls):
            return None

        def pullback(grad: Tensor) -> None:
            # Every product reads dL/dtheta before any is added to it: the curvature's product is made first, and
            # each head chunk reads and writes only its own coordinates.
            extra = None if curvature is None else torch.autograd.grad(curvature[0], curvature[1], grad)[0]
            for group, heads, pull in pulls:
                ws = self.workspace.fresh()
                base = group.base(ws, heads)  # the base point again (the workspace was used in between)
                x = group.gather(xi, ws, heads)
                group.write(grad, pull(group.gather(grad, ws, heads), x, self._like(x), base), heads, add=True)
            if extra is not None:
                grad.add_(extra)

        return pullback

    def _first_order_point(self, xi: Tensor, out: Tensor) -> None:
        """``w + xi`` into ``out``: one list operation over the segments (a fused kernel on CUDA)."""
        outs = out.split(self._base_sizes)
        torch._foreach_copy_(outs, self.base)
        torch._foreach_add_(outs, xi.split(self._base_sizes))

    def _exp_pairs(self, xi: Tensor, out: Tensor) -> list[tuple[Tensor, ...]]:
        """:meth:`exp_point`'s second-order part for a space whose elementwise coordinates move first-order: the
        pairs' ``Exp2`` corrections added to ``out`` (which holds ``w + xi``); returns each head chunk's pullback
        state (:meth:`GLQuotient.exp2_correction_saving`). A function of tensors: :meth:`captured` compiles it."""
        saved = []
        if self.options.second_order:
            for group, heads, geometry in self._chunks():
                x = group.gather(xi, self.workspace, heads)
                correction, keep = geometry.exp2_correction_saving(x, out=self._like(x))
                group.write(out, correction, heads, add=True)
                saved.append(keep)
        return saved

    def _pull_first_order(self, xi: Tensor, grad: Tensor, saved: list[tuple[Tensor, ...]]) -> None:
        """The pullback of :meth:`_exp_pairs` applied to ``grad`` in place, from its state ``saved``."""
        chunks = [(group, heads) for group in self.pairs for heads in group.chunks]
        read = self._reads_first(grad)
        for i, ((group, heads), keep) in enumerate(zip(chunks, saved)):
            ws = self.workspace.fresh()
            base = group.base(ws, heads)
            x = group.gather(xi, ws, heads)
            cotangent = group.gather(grad, ws, heads) if read is None else read[i]
            pulled = group.geometry.heads(heads).exp2_pullback(keep, cotangent, x, self._like(x), base)
            group.write(grad, pulled, heads, add=True)

    def _capture_key(self) -> str:
        """What the captured graphs of the step depend on besides tensor shapes: the options, the segments, and per
        pair group its geometry, factor layouts and head chunks. Spaces with the same key (a model measured again,
        or another with the same architecture) share the graphs (:func:`~hf_geosharp.engine.capture.compiled`)."""
        groups = [(type(g.geometry).__name__, [(f.shape, f.pieces, None if f.index is None else f.index.shape)
                                               for f in (g.g, g.h)],
                   [(c.start, c.stop) for c in g.chunks], g.base_views is None, g.weight is None) for g in self.pairs]
        return repr((self.options, self.dtype, str(self.device), self._base_sizes, groups))

    def _reads_first(self, x: Tensor) -> list[Pair] | None:
        """Inside a captured graph, every head chunk's coordinates of ``x`` gathered before the caller writes into
        ``x``: with no read of ``x`` after a write, the graph writes into ``x`` in place instead of into a copy of
        the whole flat vector. Eagerly None: each chunk reads into its workspace when its turn comes."""
        if not torch.compiler.is_compiling():
            return None
        return [group.gather(x, self.workspace, heads) for group in self.pairs for heads in group.chunks]

    def captured(self, compile: str) -> contextlib.AbstractContextManager[None]:
        """Within this context the solver's per-step geometry runs as captured graphs
        (``torch.compile(fullgraph=True)``): :meth:`ascent_direction` with ``host=False`` (the elementwise pass,
        the pairs' directions and the sums) and :meth:`exp_point` with its pullback (first-order elementwise
        coordinates; the ablations' curvature and pair-elementwise paths stay eager). The compiled functions are
        kept with the space, so every solve of a run reuses them.

        Args:
            compile: ``"default"`` (the inductor compiler), ``"reduce-overhead"`` (inductor with CUDA graphs; CUDA
                only), or the name of another ``torch.compile`` backend (``"aot_eager"`` checks the capture on a
                CPU with the eager kernels).

        Returns:
            A context manager.
        """
        return _capturing(self, compile)

    def _draw(self, i: int, seed: int) -> Tensor:
        """Standard normal entries for segment ``i``, from its own generator (float64, CPU): the whole parameter is
        drawn and, on a shard, this rank's part kept."""
        parameter = self.segment_ids[i]
        g = torch.Generator().manual_seed((seed + 7919 * (parameter + 1)) % (2**63 - 1))
        if self.shard is None:
            return torch.randn(self._base_sizes[i], generator=g, dtype=torch.float64)
        full = torch.randn(self.shard.global_shapes[parameter].numel(), generator=g, dtype=torch.float64)
        return self.shard.local_part(parameter, full)

    def _like(self, pair: Pair) -> Pair:
        return self.workspace.take(pair[0].shape), self.workspace.take(pair[1].shape)

    # ------------------------------------------------------------------ sampling
    def random_tangent_vector(self, generator: torch.Generator) -> Tensor:
        """A metric-isotropic Gaussian horizontal vector; equivariant under the pairs' group actions (a pair's draw is
        divided by the square root of its calibration weight, isotropic in the weighted metric)."""
        seed = int(torch.randint(2**62, (1,), generator=generator))
        draw = lambda i: self._draw(i, seed)  # noqa: E731
        z = self.elementwise.random_tangent_vector(generator, draw)
        if self.pair_elementwise is not None:
            z = z + self.pair_elementwise.random_tangent_vector(generator, draw)
        else:
            for group in self.pairs:
                draw_pair = group.whole().random_tangent_vector(generator)
                if group.weight is not None:
                    scale = group.weight.rsqrt().to(draw_pair[0].dtype)[:, None, None]
                    draw_pair = (draw_pair[0] * scale, draw_pair[1] * scale)
                group.write(z, draw_pair, slice(None))
        return self.horizontal(z)


class _Captured:
    """A space's step functions compiled with ``torch.compile(fullgraph=True)`` (see
    :meth:`PerturbationSpace.captured`)."""

    def __init__(self, space: PerturbationSpace, compile: str) -> None:
        self.space = space
        key = space._capture_key()
        self._pair_direction = functools.partial(compiled(PerturbationSpace._pair_direction, compile, key), space)
        self._exp_pairs = functools.partial(compiled(PerturbationSpace._exp_pairs, compile, key), space)
        self._pull = functools.partial(compiled(PerturbationSpace._pull_first_order, compile, key), space)

    # The elementwise list passes run eagerly (a few fused launches on CUDA, whatever the depth): inside a graph,
    # inductor lowers list writes into the views of one flat vector as one kernel that tests every segment's bounds
    # at every coordinate (MiniLM: 0.49 s a call on a CPU core where the eager pass takes 10 ms).

    def direction(self, egrad: Tensor, vectors: Tensor, out: Tensor, save: Tensor | None) -> tuple[Tensor, ...]:
        """:meth:`PerturbationSpace._direction` with its pair part captured."""
        square, products = self.space.elementwise.riemannian_gradient_pass(egrad, out, vectors, save)
        return self._pair_direction(egrad, out, square, products)

    def exp_point(self, xi: Tensor, out: Tensor, need_grad: bool) -> Pullback | None:
        """:meth:`PerturbationSpace.exp_point` through the captured graphs."""
        self.space._first_order_point(xi, out)
        saved = self._exp_pairs(xi, out)
        if not need_grad or not saved:
            return None
        return lambda grad: self._pull(xi, grad, saved)


@contextlib.contextmanager
def _capturing(space: PerturbationSpace, compile: str) -> Iterator[None]:
    capture_choice(compile, space.device)
    if compile != "off" and space.shard is not None:
        raise ValueError(f"compile={compile!r} captures one process's step; a sharded space sums over the ranks "
                         "between its operations and runs eagerly. Pass compile='off'.")
    if compile == "off":
        yield
        return
    # What the step's functions cache on first use is made here, eagerly: a graph cannot branch on data (the
    # segments' kinds) and should not allocate what outlives it (the metric's casts).
    space.elementwise.kinds()
    for group in space.pairs:
        for name in ("P", "Q", "P_inv", "Q_inv"):
            getattr(group.geometry, name)
    if compile not in space._compiled:
        space._compiled[compile] = _Captured(space, compile)
    space._capture = space._compiled[compile]
    try:
        yield
    finally:
        space._capture = None
