"""The perturbation space: where the solver moves, in the model's own parameter coordinates.

A tangent vector ``xi`` is a flat tensor laid out like the model's flat parameter vector ``theta0`` (see
:mod:`hf_geosharp.symmetry.base`). Coordinates that belong to a GL(h) pair are handled by :class:`GLQuotient`; all
other coordinates by :class:`ElementwiseGeometry`. Adaptive sharpness is the same space with no pairs and first-order
steps, so one solver serves both measures.

Performance: a solver step must cost one forward and one backward plus little else, and the
parameter vector is large (1e8 entries), so

* pair blocks of equal shape (every layer of a BERT) are stacked into one group, so each geometric operation is one
  batched matmul per group; a group's coordinates are moved through strided views of the flat vector (a few boxes
  per layer, found once from the index maps), or through index operations where the layout has no such structure;
* the perturbed point is written into a caller-owned buffer without autograd (:meth:`PerturbationSpace.exp_point`);
  the derivative of the second-order geodesic term is a closed-form, pair-sized vector-Jacobian product applied
  afterwards, so no parameter-sized zero fill or scatter ever enters a backward pass;
* :meth:`PerturbationSpace.ascent_direction` uses the defining identity of the Riemannian gradient,
  ``<grad f, x>_g = <df, x>`` for horizontal ``x``, so the solver's norms cost one matrix-vector product per step,
  and it may write the direction over the gradient it comes from, which saves the solver a parameter-sized buffer.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from .geometry.elementwise import Curvature, ElementwiseGeometry
from .geometry.gl_quotient import GLQuotient, Metric
from .symmetry.base import PairBlock

Pullback = Callable[..., None]


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
    """

    metric: Metric | None = "inv"
    epsilon: float = 1e-6
    second_order: bool = True
    riemannian_norm: bool = True
    horizontal_projection: bool = True
    elementwise_curvature: Curvature = "none"


@dataclass(frozen=True)
class _Piece:
    """A box ``[k, r, :]`` of a factor whose flat indices are ``offset + k s_k + r s_r + c s_c``: a strided view."""

    k: slice
    r: slice
    size: tuple[int, int, int]
    stride: tuple[int, int, int]
    offset: int


def _strided_pieces(index: Tensor, min_elements: int = 256) -> list[_Piece] | None:
    """Cover an index map ``[K, n, m]`` by strided boxes, or ``None`` if it has no such structure.

    Attention factors are slices of weight matrices (transposed or not) plus a bias row, so a handful of boxes per
    layer describe them. Copying through ``as_strided`` views is 2-4x faster than ``index_select``/``index_copy_`` on
    a CPU (no index reads, no scattered read-modify-writes). Rows are split where the pattern of head 0 changes;
    every head is then checked against that split, and heads whose offsets step evenly are merged into one box."""
    K, n, m = index.shape
    I = index.cpu()
    step_c = I[:, :, 1:2] - I[:, :, :1] if m > 1 else torch.ones_like(I[:, :, :1])
    if m > 1 and not bool((I[:, :, 1:] - I[:, :, :-1] == step_c).all()):
        return None
    base = I[:, :, 0]
    first, steps = base[0].tolist(), step_c[0, :, 0].tolist()  # head 0, as Python ints: the loops are per row
    runs, r0 = [], 0  # row runs of head 0 with one column step and one row step
    for r in range(1, n + 1):
        if r == n or steps[r] != steps[r0] or (r - r0 >= 2 and first[r] - first[r - 1] != first[r0 + 1] - first[r0]):
            runs.append((r0, r))
            r0 = r
    pieces = []
    for r0, r1 in runs:
        s_c, s_r = steps[r0], first[r0 + 1] - first[r0] if r1 - r0 > 1 else 1
        rows = torch.arange(r1 - r0)
        expected = base[:, r0, None, None] + rows[None, :, None] * s_r + torch.arange(m)[None, None, :] * s_c
        if s_c < 0 or s_r < 0 or not bool((I[:, r0:r1] == expected).all()):
            return None
        offsets, k0 = base[:, r0].tolist(), 0
        for k in range(1, K + 1):  # merge heads whose offsets form an arithmetic progression
            if k == K or (k - k0 >= 2 and offsets[k] - offsets[k - 1] != offsets[k0 + 1] - offsets[k0]):
                s_k = offsets[k0 + 1] - offsets[k0] if k - k0 > 1 else 1
                if s_k < 0:
                    return None
                pieces.append(_Piece(slice(k0, k), slice(r0, r1), (k - k0, r1 - r0, m), (s_k, s_r, s_c), offsets[k0]))
                k0 = k
    if index.numel() < min_elements * len(pieces):
        return None  # tiny boxes: one index operation is cheaper than many small copies
    return pieces


@dataclass
class Factor:
    """One factor (all ``G`` or all ``H``) of a pair group: where its ``[k, n, h]`` entries sit in the flat vector.

    Either strided ``pieces`` or, for layouts without that structure, a flat ``index`` (int64: twice the memory of
    the float coordinates it addresses, so it is dropped when pieces exist)."""

    shape: torch.Size
    pieces: list[_Piece] | None
    index: Tensor | None

    @classmethod
    def of(cls, index: Tensor, device: torch.device) -> Factor:
        pieces = _strided_pieces(index)
        return cls(index.shape, pieces, None if pieces is not None else index.reshape(-1).to(device))

    def _views(self, x: Tensor) -> list[tuple[_Piece, Tensor]]:
        return [(p, x.as_strided(p.size, p.stride, x.storage_offset() + p.offset)) for p in self.pieces]

    def gather(self, x: Tensor, out: Tensor | None = None) -> Tensor:
        if self.pieces is None:
            return torch.index_select(x, 0, self.index, out=None if out is None else out.view(-1)).view(self.shape)
        out = x.new_empty(self.shape) if out is None else out
        for p, view in self._views(x):
            out[p.k, p.r].copy_(view)
        return out

    def write(self, out: Tensor, value: Tensor) -> None:
        if self.pieces is None:
            out.index_copy_(0, self.index, value.reshape(-1))
            return
        for p, view in self._views(out):
            view.copy_(value[p.k, p.r])

    def add(self, out: Tensor, value: Tensor) -> None:
        if self.pieces is None:
            out.index_add_(0, self.index, value.reshape(-1))
            return
        for p, view in self._views(out):
            view.add_(value[p.k, p.r])


@dataclass
class PairGroup:
    """Pair blocks of one shape, stacked: their ``G`` and ``H`` factors and the shared geometry."""

    g: Factor
    h: Factor
    geometry: GLQuotient

    def gather(self, x: Tensor, out: tuple[Tensor, Tensor] | None = None) -> tuple[Tensor, Tensor]:
        """``(x_G, x_H)``: this group's coordinates of the flat vector ``x``, as ``[k, n, h]`` and ``[k, m, h]``."""
        if out is None:
            return self.g.gather(x), self.h.gather(x)
        return self.g.gather(x, out[0]), self.h.gather(x, out[1])

    def buffers(self, scratch: _Scratch) -> tuple[Tensor, Tensor]:
        """Uninitialised ``(G-shaped, H-shaped)`` tensors from ``scratch``."""
        return scratch.take(self.g.shape), scratch.take(self.h.shape)

    def write(self, out: Tensor, pair: tuple[Tensor, Tensor]) -> None:
        """Put ``(x_G, x_H)`` back at this group's coordinates of ``out``."""
        self.g.write(out, pair[0])
        self.h.write(out, pair[1])

    def add(self, out: Tensor, pair: tuple[Tensor, Tensor]) -> None:
        self.g.add(out, pair[0])
        self.h.add(out, pair[1])


class _Scratch:
    """Hands out contiguous tensors carved from a borrowed flat buffer, front to back; fresh ones once it is used up.

    The geometry of a step needs a few pair-sized temporaries (1e7 entries each for BERT-base). Fresh ones would
    cost page faults at every step (the C allocator returns large freed blocks to the system), while a dedicated
    workspace would raise the run's peak memory. So they are carved from parameter-sized buffers that are idle at
    that moment: the perturbed-weights buffer between model calls, or the gradient buffer before the backward."""

    def __init__(self, buffer: Tensor | None, dtype: torch.dtype, device: torch.device) -> None:
        self.buffer, self.used, self.dtype, self.device = buffer, 0, dtype, device

    def take(self, shape: torch.Size) -> Tensor:
        n = math.prod(shape)
        if self.buffer is None or self.used + n > self.buffer.numel():
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        view = self.buffer[self.used : self.used + n].view(shape)
        self.used += n
        return view


def _stack_alike(blocks: list[PairBlock]) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """Stack the index maps of blocks with equal pair shapes and group into one ``[sum k, n, h]`` block.

    Every formula of :class:`GLQuotient` is batched over the leading (head) dimension, so the twelve layers of a BERT
    become two geometry objects (QK, VO) instead of 24: one batched matmul per operation instead of one per layer."""
    groups: dict[tuple, list[PairBlock]] = {}
    for b in blocks:
        basis = None if b.lie_basis is None else (tuple(b.lie_basis.shape), tuple(b.lie_basis.flatten().tolist()))
        groups.setdefault((tuple(b.G_index.shape[1:]), tuple(b.H_index.shape[1:]), basis), []).append(b)
    return [
        (torch.cat([b.G_index for b in members]), torch.cat([b.H_index for b in members]), members[0].lie_basis)
        for members in groups.values()
    ]


class PerturbationSpace:
    """Norms, gradients, projections and geodesic points for flat tangent vectors at ``theta0``.

    Args:
        theta0: ``[N]`` the trained weights, flattened (working dtype). Read while the space is built.
        blocks: GL(h) pair blocks (ignored when ``options.metric`` is None).
        options: see :class:`SpaceOptions`.
        movable: ``[N]`` bool, the coordinates that may be perturbed (default: all).
        probe_seed: seed of the fixed probe used by the equivariant Gaussian sampler.
        base: the same weights as the tensors whose concatenation is ``theta0`` (e.g. the model's parameters).
            When given, geodesic points are computed from them and the space keeps no reference to ``theta0`` (but
            for the ablation ``elementwise_curvature``), so the caller can free it: one parameter-sized vector less
            for the whole run.
    """

    def __init__(
        self,
        theta0: Tensor,
        blocks: list[PairBlock],
        options: SpaceOptions = SpaceOptions(),
        movable: Tensor | None = None,
        probe_seed: int = 0,
        base: list[Tensor] | None = None,
    ) -> None:
        theta0 = theta0.detach()
        self.options = options
        self.numel, self.dtype, self.device = theta0.numel(), theta0.dtype, theta0.device
        self.base = [theta0] if base is None else [b.detach().reshape(-1) for b in base]
        self._base_sizes = [b.numel() for b in self.base]
        self._idle: Tensor | None = None  # see lend()
        if sum(self._base_sizes) != self.numel:
            raise ValueError("base must hold exactly the weights of theta0.")
        movable = None if movable is None else movable.to(torch.bool)
        device = self.device
        self.blocks = [
            b for b in (blocks if options.metric is not None else [])
            if movable is None or bool(movable[b.G_index.to(device)].all() and movable[b.H_index.to(device)].all())
        ]
        probe = torch.Generator().manual_seed(probe_seed)
        self.pairs: list[PairGroup] = []
        for gi, hi, basis in _stack_alike(self.blocks):
            g, h = Factor.of(gi, device), Factor.of(hi, device)
            G, H = g.gather(theta0), h.gather(theta0)
            geometry = GLQuotient(G, H, options.metric, options.epsilon, basis, probe)
            self.pairs.append(PairGroup(g, h, geometry))
        # Parameter-sized masks only while building: each costs a pass (and fresh pages) over 1e8 entries.
        pair_mask = self._pair_mask()
        mask = movable
        if pair_mask is not None:
            mask = pair_mask.logical_not_()
            if movable is not None:
                mask &= movable
        self.elementwise = ElementwiseGeometry(theta0, mask, options.elementwise_curvature)
        del mask, pair_mask
        # Ablation "riemannian_norm=False": pair coordinates are measured like adaptive sharpness measures them.
        self.pair_elementwise = (
            None if options.riemannian_norm or not self.pairs else ElementwiseGeometry(theta0, self._pair_mask())
        )

    # ------------------------------------------------------------------ helpers
    def zero(self) -> Tensor:
        return torch.zeros(self.numel, dtype=self.dtype, device=self.device)

    def empty(self) -> Tensor:
        """An uninitialised flat vector (its pages cost memory only once written)."""
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def _pair_mask(self) -> Tensor | None:
        """``[N]`` bool, the coordinates of GL(h) pairs (``None`` without pairs); built on demand."""
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

    def segments_move(self, sizes: list[int]) -> list[bool]:
        """For consecutive segments of the flat vector (e.g. the parameters), whether any coordinate can move."""
        return [bool(part.any()) for part in self.movable.split(sizes)]

    @property
    def n_pairs(self) -> int:
        return sum(g.geometry.G.shape[0] for g in self.pairs)

    def _map_pairs(self, x: Tensor, fn: Callable[[GLQuotient, tuple[Tensor, Tensor]], tuple[Tensor, Tensor]]) -> None:
        """Replace, in place, the pair coordinates of ``x`` by ``fn(geometry, (x_G, x_H))`` group by group."""
        for group in self.pairs:
            group.write(x, fn(group.geometry, group.gather(x)))

    # ------------------------------------------------------------------ metric
    def inner_product(self, a: Tensor, b: Tensor) -> Tensor:
        """Riemannian inner product at ``theta0`` (float64 scalar)."""
        total = self.elementwise.inner_product(a, b)
        if self.pair_elementwise is not None:
            return total + self.pair_elementwise.inner_product(a, b)
        for group in self.pairs:
            total = total + group.geometry.inner_product(group.gather(a), group.gather(b)).sum()
        return total

    def norm(self, xi: Tensor) -> Tensor:
        """Riemannian norm at ``theta0`` (float64 scalar)."""
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    def riemannian_gradient(self, egrad: Tensor, out: Tensor | None = None) -> Tensor:
        """Raise the Euclidean gradient with the metric, then make it horizontal (a valid ascent direction).

        Zero on frozen coordinates (their metric factor is 0). Written into ``out`` when given (not ``egrad``)."""
        r = self.elementwise.euclidean_to_riemannian_gradient(egrad, out=out)
        if not self.pairs:
            return r
        if self.pair_elementwise is not None:
            r.addcmul_(egrad, self.pair_elementwise.scale_sq)
            if self.options.horizontal_projection:
                self._map_pairs(r, lambda g, x: g.projection(x))
            return r
        for group in self.pairs:
            group.write(r, self._pair_gradient(group, group.gather(egrad)))
        return r

    def _pair_gradient(self, group: PairGroup, egrad: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        rp = group.geometry.euclidean_to_riemannian_gradient(egrad)
        return group.geometry.projection(rp) if self.options.horizontal_projection else rp

    def ascent_direction(self, egrad: Tensor, vectors: Tensor, out: Tensor) -> tuple[Tensor, float, list[float]]:
        """The solver's step direction ``d = riemannian_gradient(egrad)``, written into ``out``, with ``<d, d>_g``
        and ``<d, v>_g`` for every horizontal row ``v`` of ``vectors`` (``[r, N]``, ``r`` may be 0).

        ``out`` may be ``egrad`` itself: the gradient is then consumed, which spares the solver a parameter-sized
        buffer. Everything that needs ``egrad`` is read first: each pair group's direction and its share of
        ``<d, d>_g = <e, d>``, then, block by block with the elementwise part of ``d``, the rest of that sum and the
        products ``<e, v>`` (for horizontal ``v`` and a g-self-adjoint projection, the defining identity of the
        Riemannian gradient gives ``<R e, v>_g = <e, v>``). The pair directions are written last, over the zeros
        that the elementwise factor leaves at pair coordinates. Pair temporaries come from the buffer given to
        :meth:`lend`."""
        if self.pair_elementwise is not None:  # ablation: the projection is not orthogonal in the measuring metric
            d = self.riemannian_gradient(egrad)
            products = [float(self.inner_product(d, v)) for v in vectors]
            square = float(self.inner_product(d, d))
            return out.copy_(d), max(square, 0.0), products
        scratch, directions, square = self._scratch(self._idle), [], 0.0
        for group in self.pairs:
            e = group.gather(egrad, group.buffers(scratch))
            r = group.geometry.euclidean_to_riemannian_gradient(e, out=group.buffers(scratch))
            if self.options.horizontal_projection:
                group.geometry.projection(r, in_place=True)
            square += sum(float(torch.dot(a.reshape(-1), b.reshape(-1))) for a, b in zip(e, r))
            directions.append((group, r))
        elementwise_square, products = self.elementwise.riemannian_gradient_pass(egrad, out, vectors)
        for group, r in directions:
            group.write(out, r)
        return out, max(square + elementwise_square, 0.0), products

    def lend(self, buffer: Tensor | None) -> None:
        """A parameter-sized buffer that is idle whenever :meth:`ascent_direction` runs (the objective's perturbed
        weights, which are rewritten at every model call): the direction's pair temporaries are carved from it."""
        self._idle = buffer

    def _scratch(self, buffer: Tensor | None) -> _Scratch:
        return _Scratch(buffer, self.dtype, self.device)

    def horizontal(self, xi: Tensor) -> Tensor:
        """g-orthogonal projection onto the horizontal space (identity on movable elementwise coordinates, zero on
        frozen ones). A new tensor; one pass over ``xi`` besides the pairs (no parameter-sized mask is built)."""
        pairs = [(group, group.gather(xi)) for group in self.pairs]
        out = torch.where(self.elementwise.scale_sq > 0, xi, 0.0)  # zero on frozen and (for now) pair coordinates
        for group, x in pairs:
            group.write(out, group.geometry.projection(x) if self.options.horizontal_projection else x)
        return out

    def project(self, xi: Tensor, rho: float) -> Tensor:
        """Onto the feasible set ``{horizontal, ||xi||_g <= rho}``: horizontal projection, then radial scaling.

        Both steps are g-orthogonal, so their composition is the g-orthogonal projection onto the set."""
        xi = self.horizontal(xi)
        norm = float(self.norm(xi))
        return xi.mul_(rho / norm) if norm > rho else xi

    # ------------------------------------------------------------------ geodesics
    def exp_point(self, xi: Tensor, out: Tensor, need_grad: bool, idle: Tensor | None = None) -> Pullback | None:
        """Write ``Exp(theta0; xi)`` into ``out``: ``Exp2`` on pairs, the chosen curvature elsewhere.

        ``out`` is filled without autograd. With ``need_grad`` the return value is the pullback
        ``pullback(grad, idle=None)`` that turns ``dL/dtheta`` (a flat tensor, modified in place) into ``dL/dxi``; it
        reads ``xi`` again, which must not change in between; it is ``None`` for a first-order space, where the two
        coincide. Pairs use the closed-form pullback of :meth:`GLQuotient.exp2_correction_with_pullback`; the
        (ablation-only) elementwise curvature is differentiated by autograd. ``idle``, here and in the pullback: a
        flat buffer whose contents do not matter, from which pair temporaries are carved (see :class:`_Scratch`)."""
        if len(self.base) == 1:
            torch.add(self.base[0], xi, out=out)
        else:  # one add per parameter (the parameters are not one tensor)
            for w, x, o in zip(self.base, xi.split(self._base_sizes), out.split(self._base_sizes)):
                torch.add(w, x, out=o)
        # (vector-Jacobian product of dL/dtheta, how to add it to dL/dtheta) per curvature term
        stages: list[tuple[Callable[[Tensor, _Scratch], Any], Callable[[Tensor, Any], Any]]] = []
        if self.options.elementwise_curvature != "none":
            leaf = xi.detach().requires_grad_(need_grad)
            with torch.set_grad_enabled(need_grad):
                correction = self.elementwise.exp_correction(leaf)
            out.add_(correction.detach())
            stages.append((lambda g, _, c=correction, x=leaf: torch.autograd.grad(c, x, g)[0], Tensor.add_))
        if self.options.second_order:
            scratch = self._scratch(idle)
            for group in self.pairs:
                x = group.gather(xi, group.buffers(scratch))
                correction, pullback = group.geometry.exp2_correction_with_pullback(x, out=group.buffers(scratch))
                group.add(out, correction)
                # xi is gathered again for the pullback rather than kept: no pair-sized tensor outlives this call
                stages.append((
                    lambda g, scratch, group=group, pull=pullback: pull(
                        group.gather(g, group.buffers(scratch)), group.gather(xi, group.buffers(scratch)),
                        group.buffers(scratch),
                    ),
                    group.add,
                ))
        if not need_grad or not stages:
            return None

        def pullback_all(grad: Tensor, idle: Tensor | None = None) -> None:
            # Every product reads dL/dtheta before any of them is added to it.
            scratch = self._scratch(idle)
            products = [vjp(grad, scratch) for vjp, _ in stages]
            for (_, add), product in zip(stages, products):
                add(grad, product)

        return pullback_all

    # ------------------------------------------------------------------ sampling
    def random_tangent_vector(self, generator: torch.Generator) -> Tensor:
        """A metric-isotropic Gaussian horizontal vector; equivariant under the pairs' group actions."""
        z = self.elementwise.random_tangent_vector(generator)
        if self.pair_elementwise is not None:
            z = z + self.pair_elementwise.random_tangent_vector(generator)
        else:
            for group in self.pairs:
                group.write(z, group.geometry.random_tangent_vector(generator))
        return self.horizontal(z)
