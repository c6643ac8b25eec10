r"""Quotient geometry of GL(h)-symmetric pairs ``(G, H) -> G H^T``, batched over heads.

Points and tangent vectors are pairs of tensors ``G: [k, n, h]`` and ``H: [k, m, h]`` (``k`` heads stacked). The group
acts as :math:`(G, H) \mapsto (G A^{-1}, H A^T)`; tangent vectors transform the same way. Formulas follow da Silva,
Dangel & Oore (ICML 2025), Eqs. (9)-(12), with the corrections written up in ``docs/method.md``:

* inv metric  :math:`\langle\eta,\zeta\rangle = tr(P^{-1}\eta_G^T\zeta_G) + tr(Q^{-1}\eta_H^T\zeta_H)`,
* mix metric  :math:`\langle\eta,\zeta\rangle = tr(Q\,\eta_G^T\zeta_G) + tr(P\,\eta_H^T\zeta_H)`,

with :math:`P`, :math:`Q` the relaxed Gram matrices of :meth:`GLQuotient.relaxed_grams` (they transform like
:math:`G^TG`, :math:`H^TH`, so the relaxation keeps the invariance), evaluated once at the base point and used
everywhere the metric appears. The vertical vectors :math:`(G\Lambda, -H\Lambda^T)` use the unrelaxed factors, so the
exact g-orthogonal projection solves a two-sided Sylvester equation :math:`\mathcal A\Lambda + \Lambda\mathcal B = C`
(inv: :math:`\mathcal A = Q G^TG`, :math:`\mathcal B = H^TH P`; mix: :math:`\mathcal A = P^{-1}G^TG`,
:math:`\mathcal B = H^TH Q^{-1}`), both sides diagonalised once per base point (Cholesky + eigh). A reduced group
(e.g. the commutant of RoPE rotations) is given by a Lie-algebra basis; its projection is a small cached linear solve
over that basis. Every ``h x h`` factor is computed in float64; products with the ``n x h`` blocks run in the working
dtype. One class per metric (:class:`InvQuotient`, :class:`MixQuotient`, made by :func:`gl_quotient`) on a common
base; the sums over the factors' rows, the only thing a sharded run changes, are one injected :class:`RowSums`.

The vocabulary follows pymanopt's manifolds: ``inner_product``, ``norm``, ``projection``,
``euclidean_to_riemannian_gradient``, ``exp2_correction`` (the second-order geodesic term ``-1/2 Gamma(xi, xi)``)
and ``random_tangent_vector``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from ..defaults import EPSILON, METRIC

Metric = Literal["inv", "mix"]
Pair = tuple[Tensor, Tensor]
Reduce = Callable[[Tensor], Tensor]
#: A pullback of the geodesic correction: ``(cotangent, xi, out=None, base=None) -> d/dxi``.
Pullback = Callable[..., Pair]
#: Tensors with one entry per head: what :meth:`GLQuotient.heads` slices.
_PER_HEAD = ("G", "H", "_P64", "_Q64", "_P_inv64", "_Q_inv64", "_VA",
             "_VA_inv", "_VB", "_VB_inv", "_sylvester_inv", "_K_pinv")
#: Eigenvalue floor (relative to the largest) of the Gram matrices inverted inside the relaxation: a numerical guard
#: for singular factors only. It is independent of ``epsilon`` so that the relaxation stays exactly covariant for
#: every head whose Gram matrices are resolvable in float64 (condition <= 1e10), also after a badly conditioned
#: group element (a floor at ``epsilon * lambda_max`` broke invariance for condition-1000 elements).
GRAM_FLOOR = 1e-10


def _identity(t: Tensor) -> Tensor:
    return t


def cache_bytes(heads: int, h: int, dtype: torch.dtype) -> int:
    """What a full-group geometry of ``heads`` pairs of width ``h`` holds besides its base point: nine float64
    ``h x h`` factors per head (``P``, ``Q``, their inverses, the Sylvester eigen-factors and divisor) and four in the
    working ``dtype`` (:meth:`GLQuotient._lowered`)."""
    return heads * h * h * (9 * 8 + 4 * dtype.itemsize)


@dataclass(frozen=True)
class RowSums:
    """Sums over the rows of a pair's factors, the one thing a sharded run changes in the geometry.

    In one process (the default) every row of ``G`` and ``H`` is here and nothing is reduced. On a shard, the factors
    hold this rank's rows; ``counted`` leading rows of each factor are summed here (rows shared with other ranks come
    last and are counted by one rank only), ``reduce`` sums over the ranks in place, and ``index``/``whole`` place
    each local row in the whole factor, so that every layout draws the same random directions.

    Attributes:
        counted: rows of ``G`` and ``H`` this rank counts in sums (None: all).
        reduce: in-place sum over the ranks.
        index: the row of the whole factor that each local row of ``G`` and ``H`` is (None: the identity).
        whole: the whole factors' row counts ``(n, m)`` (with ``index``).
    """

    counted: tuple[int, int] | None = None
    reduce: Reduce = _identity
    index: tuple[Tensor, Tensor] | None = None
    whole: tuple[int, int] | None = None

    def gram(self, a: Tensor, b: Tensor, factor: int) -> Tensor:
        """``a^T b`` over the rows of factor ``factor`` (0: G, 1: H), summed over the ranks that share them."""
        n = a.shape[1] if self.counted is None else self.counted[factor]
        if n == a.shape[1] == b.shape[1]:  # every row counted here: no slices
            return self.reduce(a.mT @ b)
        return self.reduce(a[:, :n].mT @ b[:, :n])

    def frobenius(self, a: Pair, b: Pair) -> Tensor:
        """``<a, b>`` (Frobenius, both factors) over the rows this rank counts, not reduced over ranks; float64."""
        total = None
        for factor in (0, 1):
            x, y = a[factor], b[factor]
            n = x.shape[1] if self.counted is None else self.counted[factor]
            x, y = (x, y) if n == x.shape[1] else (x[:, :n], y[:, :n])
            part = torch.dot(x.reshape(-1), y.reshape(-1)).double()
            total = part if total is None else total + part
        return total

    def draw(self, like: Tensor, factor: int, generator: torch.Generator | None) -> Tensor:
        """Standard normal draws shaped like the whole factor (CPU, float64: the same on every device), cut to this
        rank's rows of ``like``."""
        if self.index is None:
            return torch.randn(like.shape, generator=generator, dtype=torch.float64, device="cpu").to(like.device)
        Z = torch.randn((like.shape[0], self.whole[factor], like.shape[2]), generator=generator,
                        dtype=torch.float64, device="cpu")
        return Z[:, self.index[factor].cpu()].to(like.device)


def _sym_inv_sqrt(S: Tensor) -> Tensor:
    """Symmetric inverse square root of a batch of SPD matrices (float64)."""
    d, U = torch.linalg.eigh(S)
    return (U * d.clamp_min(torch.finfo(S.dtype).tiny).rsqrt().unsqueeze(-2)) @ U.mT


def _sylvester_factors(L: Tensor, X: Tensor, side: str) -> tuple[Tensor, Tensor, Tensor]:
    """Eigen-factors ``(V, d, V^{-1})`` of one side of a two-sided Sylvester operator, from ``S = L L^T`` (SPD,
    Cholesky factor ``L``) and a PSD ``X``, all ``[k, h, h]`` float64.

    ``side`` names the product: ``"SX"``, ``"XS"``, ``"S^-1X"`` or ``"XS^-1"``. Each is similar to a symmetric PSD
    matrix (``L^T X L`` or ``L^{-1} X L^{-T}``), so it is diagonalisable with real eigenvalues ``d >= 0``."""
    eye = torch.eye(L.shape[-1], dtype=L.dtype, device=L.device).expand_as(L)
    L_inv = torch.linalg.solve_triangular(L, eye, upper=False)
    if side in ("SX", "XS"):
        d, U = torch.linalg.eigh(L.mT @ X @ L)  # S X = L (L^T X L) L^-1,  X S = L^-T (L^T X L) L^T
        return (L @ U, d, U.mT @ L_inv) if side == "SX" else (L_inv.mT @ U, d, U.mT @ L.mT)
    d, U = torch.linalg.eigh(L_inv @ X @ L_inv.mT)  # S^-1 X = L^-T (.) L^T,  X S^-1 = L (.) L^-1
    return (L_inv.mT @ U, d, U.mT @ L.mT) if side == "S^-1X" else (L @ U, d, U.mT @ L_inv)


class GLQuotient:
    """Riemannian geometry of ``k`` stacked GL(h) pairs at a fixed base point ``(G, H)``; one subclass per metric
    (:class:`InvQuotient`, :class:`MixQuotient`; :func:`gl_quotient` picks it by name).

    Both metrics are ``<a, b> = tr(W_G a_G^T b_G) + tr(W_H a_H^T b_H)`` with ``h x h`` weights ``W`` built from
    ``P_eps``, ``Q_eps`` (:attr:`WEIGHTS`, their inverses :attr:`RAISE`), so the inner product, the Riemannian
    gradient, the vertical space and its projection are written once here; a subclass gives the sides of the
    projection's Sylvester equation, the geodesic correction and the sampler's square roots.

    Args:
        G: ``[k, n, h]`` base point (the trained weights, any float dtype).
        H: ``[k, m, h]`` base point.
        epsilon: relative, group-covariant rank relaxation (see :meth:`relaxed_grams`); 0 for the exact metric.
        lie_basis: ``None`` for the full group GL(h), else a ``[b, h, h]`` basis of the subgroup's Lie algebra.
        probe_generator: generator for the fixed probe used by the equivariant sampler (only its shape-dependent
            draws matter; the same seed gives the same probe for every point of an orbit).
        rows: the sums over the factors' rows (:class:`RowSums`; default: one process, every row). Every quantity
            that sums over rows (Gram matrices, ``x^T W`` products, inner products) goes through it, so the same
            code runs on a shard.
        keep_base: keep ``G`` and ``H`` (default). False: they build the ``h x h`` caches and are dropped; every
            operation then runs on :meth:`heads` given the base point.
    """

    metric: Metric
    #: Names of the metric's weights ``(W_G, W_H)`` among ``P``, ``Q``, ``P_inv``, ``Q_inv``.
    WEIGHTS: tuple[str, str]
    #: Names of their inverses, which raise a Euclidean gradient: ``r = (e_G W_G^-1, e_H W_H^-1)``.
    RAISE: tuple[str, str]

    def __init__(
        self,
        G: Tensor,
        H: Tensor,
        epsilon: float = EPSILON,
        lie_basis: Tensor | None = None,
        probe_generator: torch.Generator | None = None,
        rows: RowSums | None = None,
        keep_base: bool = True,
    ) -> None:
        if epsilon < 0:
            raise ValueError(f"epsilon must be >= 0, got {epsilon}.")
        self.epsilon, self.dtype = float(epsilon), G.dtype
        self.rows = rows or RowSums()
        G64, H64 = G.detach().double(), H.detach().double()
        # unrelaxed: the vertical vectors use G and H themselves
        self._GtG, self._HtH = self.rows.gram(G64, G64, 0), self.rows.gram(H64, H64, 1)
        P, Q = self.relaxed_grams(self._GtG, self._HtH, self.epsilon)
        try:
            L_P = torch.linalg.cholesky(P)
            L_Q = torch.linalg.cholesky(Q)
        except torch.linalg.LinAlgError as err:
            raise ValueError(
                "A head's G^T G or H^T H is singular (the paper's Assumption 5.1 of full column rank fails) and the "
                "relaxation cannot fill it (epsilon=0, or both factors of the head are zero). Pass epsilon > 0 (the "
                f"default {EPSILON:g} is relative and keeps the invariance) or check the symmetry report for dead "
                "heads."
            ) from err
        P_inv, Q_inv = torch.cholesky_inverse(L_P), torch.cholesky_inverse(L_Q)
        self._P64, self._Q64, self._P_inv64, self._Q_inv64 = P, Q, P_inv, Q_inv
        self.lie_basis = None if lie_basis is None else lie_basis.to(device=G.device, dtype=torch.float64)
        if self.lie_basis is None:
            # The projection solves A Lam + Lam B = C (module docstring); A and B are cached as V diag(d) V^-1.
            a, b = self._sylvester_sides(L_P, L_Q)
            (self._VA, dA, self._VA_inv), (self._VB, dB, self._VB_inv) = a, b
            denominator = dA.clamp_min(0).unsqueeze(-1) + dB.clamp_min(0).unsqueeze(-2)
            # zero only where G Lam = 0 and H Lam^T = 0 (a dead direction of both factors): no vertical vector there
            self._sylvester_inv = torch.where(denominator > 0, 1.0 / denominator.clamp_min(1e-300), 0.0)
        else:
            # Gram matrix K_ij = <vertical(E_i), vertical(E_j)>_g, inverted on its range (cached eigh).
            E = self.lie_basis
            AE = self._vertical_operator(E.unsqueeze(0))  # [k, b, h, h]
            K = torch.einsum("bij,kcij->kbc", E, AE)
            d, U = torch.linalg.eigh(0.5 * (K + K.mT))
            keep = d > 1e-13 * d.amax(-1, keepdim=True).clamp_min(1e-300)
            self._K_pinv = (U * torch.where(keep, 1.0 / d.clamp_min(1e-300), 0.0).unsqueeze(-2)) @ U.mT
        del self._GtG, self._HtH  # what the projection needs of them is in its cached factors
        self.G, self.H = (G.detach(), H.detach()) if keep_base else (None, None)

        # Equivariant square roots of the metric for sampling (R^T R = P, R -> R A^{-1} under the action), made on
        # first use (a worst-case run never samples, and the probe is as large as the pair itself), in a dict that
        # every whole-range copy (heads()) shares.
        self._probe_generator = probe_generator
        self._sampling: dict[str, tuple[Tensor, Tensor]] = {}

    def _sylvester_sides(self, L_P: Tensor, L_Q: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
        """Eigen-factors of ``A = W_H^-1 G^T G`` and ``B = H^T H W_G^-1`` (see :func:`_sylvester_factors`)."""
        raise NotImplementedError

    # The metric's factors in the working dtype, for the n x h products: cast once, on first use, and kept (h x h per
    # head, a small share of the pair's n x h entries); a head range (heads()) takes views of them.
    def _lowered(self, name: str) -> Tensor:
        low = self.__dict__.setdefault("_low", {})
        if name not in low:
            low[name] = getattr(self, f"_{name}64").to(self.dtype)
        return low[name]

    def _weights64(self) -> tuple[Tensor, Tensor]:
        return getattr(self, f"_{self.WEIGHTS[0]}64"), getattr(self, f"_{self.WEIGHTS[1]}64")

    def _raise64(self) -> tuple[Tensor, Tensor]:
        return getattr(self, f"_{self.RAISE[0]}64"), getattr(self, f"_{self.RAISE[1]}64")

    @property
    def P(self) -> Tensor:
        """``P_eps`` in the working dtype (``[k, h, h]``)."""
        return self._lowered("P")

    @property
    def Q(self) -> Tensor:
        """``Q_eps`` in the working dtype (``[k, h, h]``)."""
        return self._lowered("Q")

    @property
    def P_inv(self) -> Tensor:
        """``P_eps^-1`` in the working dtype (``[k, h, h]``)."""
        return self._lowered("P_inv")

    @property
    def Q_inv(self) -> Tensor:
        """``Q_eps^-1`` in the working dtype (``[k, h, h]``)."""
        return self._lowered("Q_inv")

    @staticmethod
    def relaxed_grams(GtG: Tensor, HtH: Tensor, epsilon: float) -> tuple[Tensor, Tensor]:
        r"""The metric's Gram matrices ``P_eps``, ``Q_eps`` (float64 ``[k, h, h]``), covariant under the group.

        :math:`P_\epsilon = G^TG + \epsilon\,\tau\,\lfloor H^TH\rfloor^{-1}`,
        :math:`Q_\epsilon = H^TH + \epsilon\,\tau\,\lfloor G^TG\rfloor^{-1}`, :math:`\tau = \|GH^T\|_F^2 / h`.
        Under ``(G, H) -> (G A^-1, H A^T)``, ``tau`` is invariant and ``(H^T H)^-1`` maps to ``A^-T (H^T H)^-1 A^-1``
        exactly as ``G^T G`` does, so ``P_eps`` transforms like ``G^T G`` and the metric stays invariant for every
        ``A``; the relaxation is about ``epsilon`` relative to the head's own spectrum. :math:`\lfloor S\rfloor`
        floors the eigenvalues of ``S`` at ``GRAM_FLOOR * lambda_max(S)``: inactive (so exactly covariant) while
        ``cond(S) <= 1/GRAM_FLOOR``, a guard for singular factors only. A head with ``G H^T = 0`` uses
        ``tau = ((tr G^T G + tr H^T H) / 2h)^2`` instead (its function is zero; nothing to be invariant about)."""
        if epsilon == 0:
            return GtG, HtH
        h = GtG.shape[-1]
        trP, trQ = GtG.diagonal(0, -2, -1).sum(-1), HtH.diagonal(0, -2, -1).sum(-1)
        tau = (GtG * HtH).sum((-2, -1)) / h  # tr(G^T G H^T H) / h = ||G H^T||_F^2 / h
        tau = torch.where(tau > 0, tau, ((trP + trQ) / (2 * h)).square())[:, None, None]

        def floored_inverse(S: Tensor, fallback: Tensor) -> Tensor:
            d, U = torch.linalg.eigh(S)
            top = d[..., -1:]
            floor = GRAM_FLOOR * torch.where(top > 0, top, fallback[:, None])
            return (U / torch.maximum(d, floor).clamp_min(1e-300).unsqueeze(-2)) @ U.mT

        P = GtG + epsilon * tau * floored_inverse(HtH, trP / h)
        Q = HtH + epsilon * tau * floored_inverse(GtG, trQ / h)
        return 0.5 * (P + P.mT), 0.5 * (Q + Q.mT)

    def _row_sum(self, a: Tensor, b: Tensor, factor: int) -> Tensor:
        """``a^T b`` over the rows of factor ``factor`` (0: G, 1: H), summed over the ranks that share them."""
        return self.rows.gram(a, b, factor)

    def heads(self, heads: slice, base: Pair | None = None) -> GLQuotient:
        """The same geometry restricted to a range of heads (views, no copies), at ``base`` (those heads' ``G`` and
        ``H``, e.g. read from the weights) or at views of the kept base point: heads are independent, so an operation
        can run on a few heads at a time with small temporaries. All heads and no ``base``: the geometry itself."""
        k = self._P64.shape[0]
        whole = heads.indices(k)[:2] == (0, k) and heads.indices(k)[2] == 1
        if whole and base is None:
            return self
        part = copy.copy(self)
        if not whole:
            part._low = {name: self._lowered(name)[heads] for name in ("P", "Q", "P_inv", "Q_inv")}
            for name in _PER_HEAD:
                if getattr(self, name, None) is not None:  # G and H are None when the base point is not kept
                    setattr(part, name, getattr(self, name)[heads])
            part._sampling = {key: (R[0][heads], R[1][heads]) for key, R in self._sampling.items()}
        if base is not None:
            part.G, part.H = base
        return part

    # ------------------------------------------------------------------ metric
    def inner_product(self, a: Pair, b: Pair) -> Tensor:
        """Per-pair metric inner product, ``[k]`` float64."""
        WG, WH = self._weights64()
        MG = self._row_sum(a[0], b[0], 0).double()
        MH = self._row_sum(a[1], b[1], 1).double()
        return (WG * MG).sum((-2, -1)) + (WH * MH).sum((-2, -1))

    def norm(self, xi: Pair) -> Tensor:
        """Per-pair Riemannian norm, ``[k]`` float64."""
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    def euclidean_to_riemannian_gradient(self, egrad: Pair, out: Pair | None = None) -> Pair:
        """The vector ``r`` with ``<r, eta>_g = <egrad, eta>_F`` for all ``eta``; into ``out`` if given."""
        eG, eH = egrad
        fG, fH = self._lowered(self.RAISE[0]), self._lowered(self.RAISE[1])
        if out is None:
            return eG @ fG, eH @ fH
        return torch.bmm(eG, fG, out=out[0]), torch.bmm(eH, fH, out=out[1])

    # ------------------------------------------------------------------ horizontal space
    def vertical_vector(self, Lam: Tensor) -> Pair:
        """``(G Lam, -H Lam^T)``: the orbit direction generated by ``Lam`` (``[k, h, h]``)."""
        Lam = Lam.to(self.dtype)
        return self.G @ Lam, -self.H @ Lam.mT

    def projection(self, xi: Pair, in_place: bool = False) -> Pair:
        """g-orthogonal projection onto the horizontal space: ``xi + vertical_vector(Lam)`` (fused ``baddbmm``, no
        ``n x h`` temporaries; written over ``xi`` with ``in_place``)."""
        Lam = self._projection_lambda(xi).to(self.dtype)
        if in_place:
            return xi[0].baddbmm_(self.G, Lam), xi[1].baddbmm_(self.H, Lam.mT, alpha=-1)
        return torch.baddbmm(xi[0], self.G, Lam), torch.baddbmm(xi[1], self.H, Lam.mT, alpha=-1)

    def _projection_lambda(self, xi: Pair) -> Tensor:
        xG, xH = xi
        GtX = self._row_sum(self.G, xG, 0).double()  # G^T xi_G
        XtH = self._row_sum(xH, self.H, 1).double()  # xi_H^T H
        WG, WH = self._weights64()
        Y = GtX @ WG - WH @ XtH  # <vertical(E), xi>_g = <E, Y>_F
        if self.lie_basis is not None:
            y = torch.einsum("bij,kij->kb", self.lie_basis, Y)
            c = (self._K_pinv @ -y.unsqueeze(-1)).squeeze(-1)
            return torch.einsum("kb,bij->kij", c, self.lie_basis)
        # vertical_operator(Lam) = -Y, multiplied out to A Lam + Lam B = C: C = W_H^-1 (-Y) W_G^-1
        RG, RH = self._raise64()
        C = XtH @ RG - RH @ GtX
        return self._VA @ ((self._VA_inv @ C @ self._VB) * self._sylvester_inv) @ self._VB_inv

    def _vertical_operator(self, Lam: Tensor) -> Tensor:
        """``Lam -> Y(vertical_vector(Lam))`` in float64 (the Gram operator of the vertical space): the vertical
        vectors are built from the unrelaxed ``G``, ``H``, the metric from the relaxed ``P_eps``, ``Q_eps``."""
        WG, WH = self._weights64()
        GtG, HtH, WG, WH = (t.unsqueeze(1) for t in (self._GtG, self._HtH, WG, WH))
        return GtG @ Lam @ WG + WH @ Lam @ HtH

    # ------------------------------------------------------------------ geodesics
    def exp2_correction(self, xi: Pair) -> Pair:
        r"""The second-order geodesic term :math:`-\tfrac12\Gamma(\xi,\xi)`; differentiable."""
        raise NotImplementedError

    def exp2_correction_with_pullback(self, xi: Pair, out: Pair | None = None) -> tuple[Pair, Pullback]:
        r""":meth:`exp2_correction` and its vector-Jacobian product, without autograd.

        The solver needs :math:`\partial L/\partial\xi` through the correction at every step. Autograd would record
        about ten ``n x h`` temporaries per factor; the closed form reuses the forward's ``h x h`` products and
        writes each result with fused ``baddbmm`` calls: four ``n``-sized matmuls per factor forward, five back
        (the formulas are in each metric's class). Checked against autograd of :meth:`exp2_correction` in the tests.

        The pullback is called as ``pullback(delta, xi, out=None, base=None)`` with the same ``xi``: it keeps only
        ``h x h`` factors and reads the base point when called (``base``, or the geometry's own), so no ``n x h``
        tensor stays alive through the model's forward and backward passes in between (the space may read it again
        from the weights). Both write into ``out`` buffers when given (``None``: fresh tensors), so that a caller can
        lend them memory it already has."""
        correction, saved = self.exp2_correction_saving(xi, out)

        def pullback(d: Pair, x: Pair, out: Pair | None = None, base: Pair | None = None) -> Pair:
            return self.exp2_pullback(saved, d, x, out, base)

        return correction, pullback

    def exp2_correction_saving(self, xi: Pair, out: Pair | None = None) -> tuple[Pair, tuple[Tensor, ...]]:
        """:meth:`exp2_correction_with_pullback` with the pullback's state as tensors (``h x h`` factors of the
        forward) instead of a closure, for :meth:`exp2_pullback`: what a captured graph can return."""
        raise NotImplementedError

    def exp2_pullback(self, saved: tuple[Tensor, ...], d: Pair, x: Pair, out: Pair | None = None,
                      base: Pair | None = None) -> Pair:
        """The pullback of :meth:`exp2_correction_with_pullback` from the state :meth:`exp2_correction_saving`
        returned (the same operations as the closure)."""
        raise NotImplementedError

    def exp2(self, xi: Pair) -> Pair:
        """Second-order geodesic ``Exp2(w; xi) = w + xi - 1/2 Gamma(xi, xi)`` (paper Eq. 5)."""
        cG, cH = self.exp2_correction(xi)
        return self.G + xi[0] + cG, self.H + xi[1] + cH

    # ------------------------------------------------------------------ sampling
    def _draw(self, factor: int, generator: torch.Generator | None) -> Tensor:
        return self.rows.draw(self.G if factor == 0 else self.H, factor, generator)

    def _equivariant_root(self, factor: int, W_gram_inv: Tensor, generator: torch.Generator | None) -> Tensor:
        """``R`` with ``R^T R = W^T W + eps I`` and ``R -> R A^{-1}`` when ``W -> W A^{-1}``.

        ``R = S^{-1/2} C`` with ``C = M^T W`` for a fixed Gaussian probe ``M`` and ``S = C (W^T W + eps I)^{-1} C^T``:
        ``S`` is invariant under the action, so ``R`` transforms like ``W`` (a Cholesky factor of ``W^T W`` would not).
        """
        W64 = (self.G if factor == 0 else self.H).double()
        C = self._row_sum(self._draw(factor, generator), W64, factor)
        return _sym_inv_sqrt(C @ W_gram_inv @ C.mT) @ C

    def _sampling_roots(self, R_G: Tensor, R_H: Tensor) -> tuple[Tensor, Tensor]:
        """The factors ``(root_G, root_H)`` of the sampler, ``z = Z root``, from the roots of ``P`` and ``Q``."""
        raise NotImplementedError

    def random_tangent_vector(self, generator: torch.Generator | None = None) -> Pair:
        """A metric-isotropic Gaussian tangent vector (not yet projected), equivariant for a fixed generator state.

        Rows of ``z_G`` have covariance ``W_G^-1`` (inv: ``P``; mix: ``Q^{-1}``)."""
        if "roots" not in self._sampling:
            self._sampling["roots"] = self._sampling_roots(
                self._equivariant_root(0, self._P_inv64, self._probe_generator),
                self._equivariant_root(1, self._Q_inv64, self._probe_generator),
            )
        root_G, root_H = self._sampling["roots"]
        ZG, ZH = self._draw(0, generator), self._draw(1, generator)
        return (ZG @ root_G).to(self.dtype), (ZH @ root_H).to(self.dtype)


def _inv_factor(x: Tensor, W: Tensor, P_inv: Tensor, out: Tensor | None,
                row_sum: Callable[[Tensor, Tensor], Tensor]) -> tuple[Tensor, Tensor]:
    """One factor of the inv correction ``c = (x A - W B) / 2`` and the ``h x h`` factor ``A / 2`` its pullback
    (:func:`_inv_factor_pullback`) keeps; ``row_sum(a, b)`` is ``a^T b`` over the factor's rows (summed over ranks on
    a shard)."""
    S = row_sum(x, W)
    A_half = 0.5 * P_inv @ (S + S.mT)
    c = torch.bmm(x, A_half, out=out).baddbmm_(W, 0.5 * P_inv @ row_sum(x, x), alpha=-1)
    return c, A_half


def _inv_factor_pullback(A_half: Tensor, P_inv: Tensor, row_sum: Callable[[Tensor, Tensor], Tensor], d: Tensor,
                         x: Tensor, W: Tensor, out: Tensor | None) -> Tensor:
    """The pullback of :func:`_inv_factor` (``exp2_correction_with_pullback``)."""
    M, N = row_sum(d, x) @ P_inv, row_sum(d, W) @ P_inv
    g = torch.bmm(d, A_half.mT, out=out)
    return g.baddbmm_(W, 0.5 * (M + M.mT)).baddbmm_(x, 0.5 * (N + N.mT), alpha=-1)


class InvQuotient(GLQuotient):
    r"""The inv metric (paper Eq. 9): :math:`\langle\eta,\zeta\rangle = tr(P^{-1}\eta_G^T\zeta_G) +
    tr(Q^{-1}\eta_H^T\zeta_H)`; each factor's geodesic correction involves that factor only."""

    metric = "inv"
    WEIGHTS = ("P_inv", "Q_inv")
    RAISE = ("P", "Q")

    def _sylvester_sides(self, L_P: Tensor, L_Q: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
        # A = Q_eps G^T G, B = H^T H P_eps
        return _sylvester_factors(L_Q, self._GtG, "SX"), _sylvester_factors(L_P, self._HtH, "XS")

    def exp2_correction(self, xi: Pair) -> Pair:
        r""":math:`-\tfrac12\Gamma(\xi,\xi)` factor by factor: ``c_G = (xG P^-1 (S + S^T) - G P^-1 xG^T xG) / 2``,
        ``S = xG^T G`` (H alike with ``Q``); differentiable."""
        xG, xH = xi
        G, H = self.G, self.H
        sG, sH = self._row_sum(xG, G, 0), self._row_sum(xH, H, 1)
        tG, tH = self._row_sum(xG, xG, 0), self._row_sum(xH, xH, 1)
        cG = xG @ (self.P_inv @ (sG + sG.mT)) - G @ (self.P_inv @ tG)
        cH = xH @ (self.Q_inv @ (sH + sH.mT)) - H @ (self.Q_inv @ tH)
        return 0.5 * cG, 0.5 * cH

    def exp2_correction_saving(self, xi: Pair, out: Pair | None = None) -> tuple[Pair, tuple[Tensor, ...]]:
        r"""The correction, and ``(A_G / 2, A_H / 2)`` for :meth:`exp2_pullback`.

        For the factor :math:`c = \tfrac12[x A - W B]` with :math:`A = P^{-1}(S + S^T)`, :math:`S = x^T W`,
        :math:`B = P^{-1} x^T x`, the pullback of a cotangent :math:`\delta` is
        :math:`\tfrac12[\delta A^T + W(M + M^T) - x(N + N^T)]` with :math:`M = \delta^T x P^{-1}`,
        :math:`N = \delta^T W P^{-1}`; see :meth:`GLQuotient.exp2_correction_with_pullback`."""
        (xG, xH), (oG, oH) = xi, out or (None, None)
        cG, A_G = _inv_factor(xG, self.G, self.P_inv, oG, lambda a, b: self._row_sum(a, b, 0))
        cH, A_H = _inv_factor(xH, self.H, self.Q_inv, oH, lambda a, b: self._row_sum(a, b, 1))
        return (cG, cH), (A_G, A_H)

    def exp2_pullback(self, saved: tuple[Tensor, ...], d: Pair, x: Pair, out: Pair | None = None,
                      base: Pair | None = None) -> Pair:
        """Each factor's pullback (:func:`_inv_factor_pullback`)."""
        G, H = base or (self.G, self.H)
        oG, oH = out or (None, None)
        return (_inv_factor_pullback(saved[0], self.P_inv, lambda a, b: self._row_sum(a, b, 0), d[0], x[0], G, oG),
                _inv_factor_pullback(saved[1], self.Q_inv, lambda a, b: self._row_sum(a, b, 1), d[1], x[1], H, oH))

    def _sampling_roots(self, R_G: Tensor, R_H: Tensor) -> tuple[Tensor, Tensor]:
        return R_G, R_H


class MixQuotient(GLQuotient):
    r"""The mix metric (paper Eq. 10): :math:`\langle\eta,\zeta\rangle = tr(Q\,\eta_G^T\zeta_G) +
    tr(P\,\eta_H^T\zeta_H)`; the geodesic correction of each factor involves the other."""

    metric = "mix"
    WEIGHTS = ("Q", "P")
    RAISE = ("Q_inv", "P_inv")

    def _sylvester_sides(self, L_P: Tensor, L_Q: Tensor) -> tuple[tuple[Tensor, Tensor, Tensor], ...]:
        # A = P_eps^-1 G^T G, B = H^T H Q_eps^-1
        return _sylvester_factors(L_P, self._GtG, "S^-1X"), _sylvester_factors(L_Q, self._HtH, "XS^-1")

    def exp2_correction(self, xi: Pair) -> Pair:
        r""":math:`-\tfrac12\Gamma(\xi,\xi)` with the factors coupled: ``c_G = -(xG (S_H + S_H^T) - G xH^T xH)
        Q^-1 / 2``, ``S_H = xH^T H`` (H alike with ``P``); differentiable."""
        xG, xH = xi
        G, H = self.G, self.H
        sG, sH = self._row_sum(xG, G, 0), self._row_sum(xH, H, 1)
        tG, tH = self._row_sum(xG, xG, 0), self._row_sum(xH, xH, 1)
        cG = xG @ ((sH + sH.mT) @ self.Q_inv) - G @ (tH @ self.Q_inv)
        cH = xH @ ((sG + sG.mT) @ self.P_inv) - H @ (tG @ self.P_inv)
        return -0.5 * cG, -0.5 * cH

    def exp2_correction_saving(self, xi: Pair, out: Pair | None = None) -> tuple[Pair, tuple[Tensor, ...]]:
        """The correction, and ``(half_G, half_H)`` (its ``h x h`` factors along ``xi``) for :meth:`exp2_pullback`.

        G's correction depends on ``xi_H`` and H's on ``xi_G``; the pullback couples them the same way (see
        :meth:`GLQuotient.exp2_correction_with_pullback`)."""
        (xG, xH), (oG, oH) = xi, out or (None, None)
        sG, sH = self._row_sum(xG, self.G, 0), self._row_sum(xH, self.H, 1)
        tG, tH = self._row_sum(xG, xG, 0), self._row_sum(xH, xH, 1)
        half_G = -0.5 * (sH + sH.mT) @ self.Q_inv  # cG = xG @ half_G + G @ (T_H Q^-1 / 2)
        half_H = -0.5 * (sG + sG.mT) @ self.P_inv
        cG = torch.bmm(xG, half_G, out=oG).baddbmm_(self.G, 0.5 * tH @ self.Q_inv)
        cH = torch.bmm(xH, half_H, out=oH).baddbmm_(self.H, 0.5 * tG @ self.P_inv)
        return (cG, cH), (half_G, half_H)

    def exp2_pullback(self, saved: tuple[Tensor, ...], d: Pair, x: Pair, out: Pair | None = None,
                      base: Pair | None = None) -> Pair:
        """Both factors' pullbacks, coupled as the correction is."""
        (half_G, half_H), (dG, dH), (xG, xH), (oG, oH) = saved, d, x, out or (None, None)
        G, H = base or (self.G, self.H)
        M, N = self.Q_inv @ self._row_sum(dG, xG, 0), self.Q_inv @ self._row_sum(dG, G, 0)  # cG: act on xH
        M2, N2 = self.P_inv @ self._row_sum(dH, xH, 1), self.P_inv @ self._row_sum(dH, H, 1)  # cH: on xG
        gG = torch.bmm(dG, half_G.mT, out=oG).baddbmm_(G, -0.5 * (M2 + M2.mT)).baddbmm_(xG, 0.5 * (N2 + N2.mT))
        gH = torch.bmm(dH, half_H.mT, out=oH).baddbmm_(H, -0.5 * (M + M.mT)).baddbmm_(xH, 0.5 * (N + N.mT))
        return gG, gH

    def _sampling_roots(self, R_G: Tensor, R_H: Tensor) -> tuple[Tensor, Tensor]:
        # (R_H^{-T})^T R_H^{-T} = Q^{-1}, transforms as A^{-1}
        return torch.linalg.inv(R_H).mT, torch.linalg.inv(R_G).mT


_METRICS: dict[str, type[GLQuotient]] = {"inv": InvQuotient, "mix": MixQuotient}


def gl_quotient(
    G: Tensor,
    H: Tensor,
    metric: Metric = METRIC,
    epsilon: float = EPSILON,
    lie_basis: Tensor | None = None,
    probe_generator: torch.Generator | None = None,
    rows: RowSums | None = None,
    keep_base: bool = True,
) -> GLQuotient:
    """The geometry of ``metric`` (``"inv"``, paper Eq. 9, or ``"mix"``, Eq. 10) at ``(G, H)``.

    Args:
        G, H: the base point, ``[k, n, h]`` and ``[k, m, h]``.
        metric: ``"inv"`` or ``"mix"``.
        epsilon, lie_basis, probe_generator, rows, keep_base: see :class:`GLQuotient`.

    Returns:
        An :class:`InvQuotient` or a :class:`MixQuotient`.
    """
    if metric not in _METRICS:
        raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}.")
    return _METRICS[metric](G, H, epsilon, lie_basis, probe_generator, rows, keep_base)
