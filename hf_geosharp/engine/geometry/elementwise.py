r"""Elementwise GL(1)+ rescaling geometry: the metric behind adaptive sharpness.

Tangent vectors are flat tensors laid out like a list of weight segments (the model's parameters, flattened). The
metric is :math:`g(\xi, \eta) = \sum_i \xi_i\eta_i / w_i^2`, i.e. :math:`\|\xi\|_g = \|\xi \oslash |w|\|_2`
(da Silva et al., App. F, Eq. 37). Its exact geodesic is :math:`w_i \exp(\xi_i / w_i)`; dropping the curvature term
gives AS23's adaptive sharpness with ``c = |w|`` (App. F, Eqs. 38-39). Coordinates with ``|w_i| < zero_tol`` get zero
allowed perturbation instead of a division by zero.

Nothing parameter-sized is stored: ``w^2`` is recomputed from the weights block by block inside each pass (it reads
``w`` where a stored copy would read ``w^2``: the same bytes, four fewer per parameter to hold). Which coordinates
this geometry measures is said per segment (``measure``): all of them, none, or a mask for the rare segment that is
part attention pair, part not. Coordinates it does not measure are either left alone (``keep``: another geometry, the
attention pairs, writes them) or are zero (frozen).

The solver's per-step pass (:meth:`ElementwiseGeometry.riemannian_gradient_pass`) runs as a handful of list
operations (``torch._foreach_*``: one fused launch per list on CUDA) over the segments sorted once into kinds, plus
flat operations on the whole vector, so its cost in operations does not grow with the number of parameter tensors
or with depth; segments of the rare kinds (a measured mask, weights below ``zero_tol`` but not zero) go block by
block. ``reference=True`` runs every segment block by block: the slow reference the tests compare it with.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..defaults import ELEMENTWISE_CURVATURE, ZERO_TOL
from ..device_paths import host_paths

Curvature = Literal["none", "second_order", "exact_exp"]
#: Per segment: every coordinate (True), none (False), or a bool mask over the segment.
Selection = bool | Tensor


def per_segment(flat: Tensor | None, sizes: list[int], default: bool) -> list[Selection]:
    """A flat bool mask as per-segment selections (True/False where a segment is uniform)."""
    if flat is None:
        return [default] * len(sizes)
    out: list[Selection] = []
    for part in flat.to(torch.bool).split(sizes):
        out.append(True if bool(part.all()) else False if not bool(part.any()) else part.clone())
    return out


@dataclass(frozen=True)
class SegmentKinds:
    """The segments sorted for the list pass, by position: ``scaled`` (every coordinate measured: ``e w w``, which is
    exactly 0 where ``w`` is), ``zeroed`` (nothing measured or kept: 0) and ``blockwise`` (the rest: a measured mask,
    weights below ``zero_tol`` that are not zero, a mask of kept coordinates); unmeasured, wholly kept segments are
    in none of them (another geometry writes them)."""

    scaled: list[int]
    zeroed: list[int]
    blockwise: list[int]


class ElementwiseGeometry:
    """GL(1)+ metric on a flat vector laid out like ``w`` (one tensor, or a list of 1-D segments).

    Args:
        w: the base point: a flat tensor, or the weights as 1-D views (read at every pass, never copied).
        mask: flat bool, the coordinates that may move and that this geometry measures (default: all); or use
            ``measure`` for per-segment selections.
        curvature: ``"none"`` (first order, ``w + xi``: adaptive sharpness), ``"second_order"``
            (``w + xi + xi^2 / (2w)``) or ``"exact_exp"`` (``w exp(xi / w)``).
        zero_tol: weights smaller than this in magnitude are frozen.
        keep: per-segment selections of unmeasured coordinates that passes leave untouched (default: none).
        dtype: working dtype (default: float32 or wider, as the weights).
        reference: run every pass block by block (the slow reference of the list pass).
    """

    #: Coordinates per block of a pass: a few MiB, so a block stays in cache.
    CHUNK = 1 << 20

    def __init__(
        self,
        w: Tensor | Sequence[Tensor],
        mask: Tensor | None = None,
        curvature: Curvature = ELEMENTWISE_CURVATURE,
        zero_tol: float = ZERO_TOL,
        *,
        measure: list[Selection] | None = None,
        keep: list[Selection] | None = None,
        dtype: torch.dtype | None = None,
        reference: bool = False,
    ) -> None:
        if curvature not in ("none", "second_order", "exact_exp"):
            raise ValueError(f"elementwise_curvature must be 'none', 'second_order' or 'exact_exp', got {curvature!r}.")
        self.segments = [w.detach().reshape(-1)] if isinstance(w, Tensor) else [s.detach().reshape(-1) for s in w]
        self.sizes = [s.numel() for s in self.segments]
        self.numel = sum(self.sizes)
        self.dtype = dtype or torch.promote_types(torch.float32, self.segments[0].dtype)
        self.device = self.segments[0].device
        self.measure = measure if measure is not None else per_segment(mask, self.sizes, True)
        self.keep = keep if keep is not None else [False] * len(self.sizes)
        self.curvature, self.zero_tol = curvature, zero_tol
        self._plain: tuple[int, list[bool]] | None = None
        self.reference = reference
        self._kinds: SegmentKinds | None = None

    # ------------------------------------------------------------------ blocks
    def _blocks(self, segments: Sequence[int] | None = None) -> Iterator[tuple[slice, Tensor, Selection, Selection]]:
        """``(where in the flat vector, weights, measure, keep)`` block by block (of the given segments only)."""
        offset, only = 0, None if segments is None else set(segments)
        for i, (w, measure, keep, n) in enumerate(zip(self.segments, self.measure, self.keep, self.sizes)):
            for start in range(0, n if only is None or i in only else 0, self.CHUNK):
                stop = min(start + self.CHUNK, n)
                pick = lambda s, a=start, b=stop: s if isinstance(s, bool) else s[a:b]  # noqa: E731
                yield slice(offset + start, offset + stop), w[start:stop], pick(measure), pick(keep)
            offset += n

    def kinds(self) -> SegmentKinds:
        """The segments by kind (:class:`SegmentKinds`), read once, block by block (the base point does not change
        while the geometry lives)."""
        if self._kinds is None:
            tol_sq = self.zero_tol**2
            tiny = [False] * len(self.sizes)  # 0 < w^2 < zero_tol^2 somewhere: e w w would not be exactly 0 there
            for i, (w, measure) in enumerate(zip(self.segments, self.measure)):
                if measure is True:
                    blocks = (w[s : s + self.CHUNK] for s in range(0, w.numel(), self.CHUNK))
                    tiny[i] = any(bool((b.to(self.dtype).square() < tol_sq).logical_and_(b != 0).any()) for b in blocks)
            scaled, zeroed, blockwise = [], [], []
            for i, (measure, keep) in enumerate(zip(self.measure, self.keep)):
                if measure is True and not tiny[i]:
                    scaled.append(i)
                elif measure is False and keep is False:
                    zeroed.append(i)
                elif not (measure is False and keep is True):
                    blockwise.append(i)
            self._kinds = SegmentKinds(scaled, zeroed, blockwise)
        return self._kinds

    def _plain_blocks(self) -> list[bool]:
        """Per block, whether every coordinate is measured and movable, so that the step's pass needs no mask: read
        once per block size, since the base point does not change while the geometry lives."""
        if self._plain is None or self._plain[0] != self.CHUNK:
            flags = [measure is True and not bool((self._scale_sq(w, True) == 0).any())
                     for _, w, measure, _ in self._blocks()]
            self._plain = (self.CHUNK, flags)
        return self._plain[1]

    def _scale_sq(self, w: Tensor, measure: Selection) -> Tensor:
        """``w^2`` on measured movable coordinates of a block, else 0 (a block-sized tensor)."""
        sq = w.to(self.dtype).square()
        sq.masked_fill_(sq < self.zero_tol**2, 0.0)
        return sq if measure is True else sq.mul_(measure) if isinstance(measure, Tensor) else sq.zero_()

    def _apply(self, fn: Callable[[Tensor, Tensor], Tensor], x: Tensor | None = None) -> Tensor:
        """A new flat tensor: ``fn(block of x or None, w^2 of the block)`` on measured blocks, zero elsewhere."""
        out = torch.zeros(self.numel, dtype=self.dtype, device=self.device)
        for where, w, measure, _ in self._blocks():
            if measure is not False:
                out[where] = fn(None if x is None else x[where], self._scale_sq(w, measure))
        return out

    # ------------------------------------------------------------------ derived vectors (not for per-step use)
    @property
    def scale_sq(self) -> Tensor:
        """``w^2`` on measured movable coordinates, else 0 (a new flat tensor)."""
        return self._apply(lambda _, sq: sq)

    @property
    def movable(self) -> Tensor:
        """``[N]`` bool, the coordinates that move (a new tensor)."""
        return self.scale_sq > 0

    @property
    def scale(self) -> Tensor:
        """``|w|`` on movable coordinates, else 0 (``sqrt(w^2)``: exactly ``|w|`` in float32; within an ulp in
        float64)."""
        return self._apply(lambda _, sq: sq.sqrt())

    @property
    def inv_scale(self) -> Tensor:
        """``1/|w|`` on movable coordinates, else 0 (a new tensor)."""
        return self._apply(lambda _, sq: torch.where(sq > 0, sq.rsqrt(), 0.0))

    def segment_moves(self) -> list[bool]:
        """Whether any coordinate of each segment can move."""
        return [
            measure is not False and any(
                bool(self._scale_sq(w[s : s + self.CHUNK], measure if isinstance(measure, bool)
                                    else measure[s : s + self.CHUNK]).any())
                for s in range(0, w.numel(), self.CHUNK)
            )
            for w, measure in zip(self.segments, self.measure)
        ]

    # ------------------------------------------------------------------ metric
    def inner_product(self, a: Tensor, b: Tensor) -> Tensor:
        """``sum a b / w^2`` over measured movable coordinates (float64 scalar, summed in float64 across blocks)."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for where, w, measure, _ in self._blocks():
            if measure is not False:
                sq = self._scale_sq(w, measure)
                ratio = (a[where] * b[where]).div_(sq)  # inf or nan off the movable set, dropped below
                total += torch.where(sq > 0, ratio, 0.0).sum().double()
        return total

    def segment_products(self, a: Tensor, b: Tensor) -> tuple[Tensor, Tensor]:
        """Per segment, over its measured movable coordinates: ``sum a b / w^2`` (the metric) and ``sum a b``
        (Euclidean), float64 ``[segments]`` each. Summed over the segments they give :meth:`inner_product`."""
        metric = torch.zeros(len(self.sizes), dtype=torch.float64, device=self.device)
        plain = torch.zeros(len(self.sizes), dtype=torch.float64, device=self.device)
        offset = 0
        for i, (w, measure, n) in enumerate(zip(self.segments, self.measure, self.sizes)):
            for start in range(0, n if measure is not False else 0, self.CHUNK):
                stop = min(start + self.CHUNK, n)
                sq = self._scale_sq(w[start:stop], measure if isinstance(measure, bool) else measure[start:stop])
                product = a[offset + start : offset + stop] * b[offset + start : offset + stop]
                moving = sq > 0
                metric[i] += torch.where(moving, product / sq, 0.0).sum(dtype=torch.float64)
                plain[i] += torch.where(moving, product, 0.0).sum(dtype=torch.float64)
            offset += n
        return metric, plain

    def norm(self, xi: Tensor) -> Tensor:
        """The Riemannian norm ``||xi||_g`` (float64 scalar)."""
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    def euclidean_to_riemannian_gradient(self, egrad: Tensor, out: Tensor | None = None) -> Tensor:
        """``egrad * w^2`` on measured coordinates, zero elsewhere (``keep`` coordinates too), into ``out`` if given."""
        out = torch.empty_like(egrad) if out is None else out
        for where, w, measure, _ in self._blocks():
            if measure is False:
                out[where].zero_()
            else:
                torch.mul(egrad[where], self._scale_sq(w, measure), out=out[where])
        return out

    def riemannian_gradient_pass(self, egrad: Tensor, out: Tensor, vectors: Tensor,
                                 save: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """``out <- egrad * w^2`` on measured coordinates (``out`` may be ``egrad`` itself), with ``sum egrad^2 w^2``
        and ``vectors @ egrad`` over all coordinates (``vectors``: ``[r, N]``), in a few passes over the data; with
        ``save``, a copy of ``egrad`` is written into it first.

        ``keep`` coordinates of ``out`` are left as they are (when ``out`` is ``egrad`` they still hold the gradient,
        for the pair geometry to read); other unmeasured ones are zeroed. Everything that reads ``egrad`` runs
        before it is overwritten. Returns ``(square, products)``
        as float64 tensors on the device (no synchronisation).

        Segments of one kind (:meth:`kinds`) go through one list operation each, so the count of operations does not
        grow with the segments; ``<d, d>_g`` sums the squares per segment and ``vectors @ egrad`` per 1 Mi block,
        in float64 across them. Nothing parameter-sized is allocated."""
        if self.reference:
            return self._reference_pass(egrad, out, vectors, save)
        kinds = self.kinds()
        if save is not None:
            save.copy_(egrad)
        products = blocked_products(vectors, egrad, self.CHUNK)
        square = torch.zeros((), dtype=torch.float64, device=egrad.device)
        outs = out.split(self.sizes)
        scaled = [outs[i] for i in kinds.scaled]
        if scaled:
            w = [self.segments[i] for i in kinds.scaled]
            if not _same_tensor(out, egrad):
                torch._foreach_copy_(scaled, [egrad.split(self.sizes)[i] for i in kinds.scaled])
            torch._foreach_mul_(scaled, w)  # e w: its squares are e^2 w^2
            norms = torch.stack(torch._foreach_norm(scaled)).to(torch.float64)
            square = torch.dot(norms, norms)
            torch._foreach_mul_(scaled, w)  # (e w) w
        if kinds.zeroed:
            torch._foreach_zero_([outs[i] for i in kinds.zeroed])
        for where, w, measure, keep in self._blocks(kinds.blockwise):
            e = egrad[where]
            if measure is False:  # keep is a mask here
                out[where].mul_(keep)
                continue
            r = e * self._scale_sq(w, measure)
            square = square + torch.dot(e, r)
            if isinstance(measure, Tensor):
                other = out[where] if keep is True else out[where] * keep if isinstance(keep, Tensor) else 0.0
                r = torch.where(measure, r, other)
            out[where].copy_(r)
        return square, products

    def _reference_pass(self, egrad: Tensor, out: Tensor, vectors: Tensor,
                        save: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """The block-by-block :meth:`riemannian_gradient_pass`: every segment, one 1 Mi block at a time."""
        sums = torch.zeros(len(vectors) + 1, dtype=torch.float64, device=egrad.device)
        for (where, w, measure, keep), plain in zip(self._blocks(), self._plain_blocks()):
            e = egrad[where]
            if save is not None:
                save[where].copy_(e)
            if len(vectors):
                sums[1:] += torch.mv(vectors[:, where], e)
            if plain:  # every coordinate measured and movable: (e w) w, with no mask and no temporary
                scaled = torch.mul(e, w, out=out[where])  # e is not read again, so out may be egrad
                sums[0] += torch.dot(scaled, scaled)
                scaled.mul_(w)
                continue
            if measure is False:
                if keep is not True:
                    out[where].mul_(keep) if isinstance(keep, Tensor) else out[where].zero_()
                continue
            r = e * self._scale_sq(w, measure)
            sums[0] += torch.dot(e, r)
            if isinstance(measure, Tensor):  # part of a segment: keep (pair) coordinates as they are, zero the rest
                other = out[where] if keep is True else out[where] * keep if isinstance(keep, Tensor) else 0.0
                r = torch.where(measure, r, other)
            out[where].copy_(r)
        return sums[0], sums[1:]

    def restrict(self, xi: Tensor) -> Tensor:
        """``xi`` on measured movable coordinates, zero elsewhere (a new tensor)."""
        return self._apply(lambda x, sq: torch.where(sq > 0, x, 0.0), xi)

    def projection(self, xi: Tensor) -> Tensor:
        """No symmetry is quotiented out; only frozen coordinates are zeroed."""
        return self.restrict(xi)

    # ------------------------------------------------------------------ geodesic and sampling
    def _flat_weights(self) -> Tensor:
        return torch.cat([s.to(self.dtype) for s in self.segments])

    def exp_correction(self, xi: Tensor) -> Tensor | None:
        """What the chosen geodesic adds to ``w + xi`` (``None`` for first order); differentiable (an ablation: it
        builds parameter-sized temporaries)."""
        if self.curvature == "none":
            return None
        w = self._flat_weights()
        ratio = xi * self.inv_scale * torch.sign(w)  # xi / w on movable coordinates
        if self.curvature == "second_order":
            return 0.5 * xi * ratio
        return w * (torch.expm1(ratio) - ratio)

    def random_tangent_vector(
        self, generator: torch.Generator | None = None, draw: Callable[[int], Tensor] | None = None
    ) -> Tensor:
        """``Z |w|`` with ``Z ~ N(0, I)``: AS23's adaptive Gaussian direction (metric-isotropic), zero off the measured
        coordinates.

        ``Z`` is drawn segment by segment on the CPU in float64, so that a seed gives the same direction on every
        device and dtype; ``draw(i)`` (default: ``randn`` of segment ``i``'s size) lets a sharded caller draw the
        whole parameter and keep its own part."""
        draw = draw or (lambda i: torch.randn(self.sizes[i], generator=generator, dtype=torch.float64, device="cpu"))
        z = torch.cat([draw(i) for i in range(len(self.sizes))]).to(device=self.device, dtype=self.dtype)
        return z.mul_(self.scale)


def _same_tensor(a: Tensor, b: Tensor) -> bool:
    """Whether ``a`` and ``b`` are the same flat buffer (the pass then writes over its input); under
    ``torch.compile`` by identity (a captured graph cannot compare data pointers), else by data pointer."""
    if torch.compiler.is_compiling():
        return a is b
    return a.data_ptr() == b.data_ptr()


def blocked_products(vectors: Tensor, x: Tensor, block: int) -> Tensor:
    """``vectors @ x`` (``[r, N] @ [N]``, float64) as float64 sums of per-block products (``block`` entries each);
    nothing ``N``-sized is allocated.

    On a GPU, one batched product per row of ``vectors`` and one for the tail, whatever ``N``. Where the host is the
    device (:func:`~hf_geosharp.engine.device_paths.host_paths`), one matrix-vector product of all rows per block:
    a CPU's batched product of ``1 x block`` by ``block x 1`` matrices reads its data about four times slower than
    a matrix-vector product, and a kernel per block costs no launch there."""
    n = x.numel()
    full = n - n % block
    count = full // block
    parts = torch.empty(len(vectors), count + (full < n), dtype=x.dtype, device=x.device)
    if host_paths(x.device):
        for i, start in enumerate(range(0, n, block)):
            torch.mv(vectors[:, start : start + block], x[start : start + block], out=parts[:, i])
        return parts.sum(1, dtype=torch.float64)
    for j, v in enumerate(vectors):
        if full:
            into = parts[j, :count].view(count, 1, 1)
            torch.bmm(v[:full].view(count, 1, block), x[:full].view(count, block, 1), out=into)
        if full < n:
            torch.dot(v[full:], x[full:], out=parts[j, count])
    return parts.sum(1, dtype=torch.float64)
