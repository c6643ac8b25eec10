"""A plain, slow perturbation space: the oracle that
:class:`~hf_geosharp.engine.space.perturbation_space.PerturbationSpace` is tested against.

:class:`ReferenceSpace` has the fast space's protocol and is built from the same inputs, but spells every formula out
densely and shares none of the fast paths (no strided factors, no workspace, no head chunks, no closed-form pullback,
no ``<R e, v>_g = <e, v>`` shortcut):

* each head of a GL(h) pair block is gathered by fancy indexing into one vector of its ``(n + m) h`` coordinates
  (the rows of ``G``, then the rows of ``H``);
* the metric of that head at the base point is an explicit matrix (``kron(I_n, P_eps^-1) (+) kron(I_m, Q_eps^-1)``
  for inv, ``kron(I_n, Q_eps) (+) kron(I_m, P_eps)`` for mix, with ``GLQuotient.relaxed_grams``), times the head's
  calibration weight under ``ball="calibrated"`` (:func:`calibration_weight`, computed from the dense factors; a
  constant held at its base-point value, like the relaxation terms);
* the vertical space is spanned by explicit vectors ``(G E, -H E^T)`` for a basis ``E`` of ``R^{h x h}`` (or of the
  block's Lie algebra), and the horizontal projection removes the g-orthogonal projection onto it, a dense
  least-squares solve in the metric;
* the Riemannian gradient is a linear solve with the metric matrix, then projected;
* ``Exp2`` is ``w + xi - 1/2 Gamma(xi, xi)`` with the Christoffel symbols of the metric *field*,
  ``Gamma(xi, xi) = M^-1 [(D_xi M) xi - 1/2 grad_w (xi^T M(w) xi)]``, differentiated by autograd; the relaxation terms
  are held at their base-point values (the geometry leaves their derivative out, see docs/method.md), so this is an
  independent derivation of the formulas of docs/spec.md §2.2-2.3, and the pullback is autograd through it.

Everything is float64 on the CPU, whatever the base point's dtype and device. :func:`projection_defects` checks the
precondition of the fast ascent direction: the horizontal projection must be g-self-adjoint and idempotent.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from ...symmetry.base import PairBlock
from ..defaults import EPSILON, ZERO_TOL
from ..geometry.gl_quotient import GLQuotient
from ..geometry.lie import algebra_basis
from .perturbation_space import Pullback, SpaceOptions

_F64, _CPU = torch.float64, torch.device("cpu")


def _f64(x: Tensor) -> Tensor:
    return x.detach().to(device=_CPU, dtype=_F64)


def metric_matrix(G: Tensor, H: Tensor, relax: tuple[Tensor, Tensor], metric: str) -> Tensor:
    """The metric on one head's coordinates ``(vec G, vec H)`` at the point ``(G, H)``, with the relaxation terms
    ``relax = (P_eps - G^T G, Q_eps - H^T H)`` held fixed; a dense ``[(n + m) h, (n + m) h]`` matrix."""
    P, Q = G.mT @ G + relax[0], H.mT @ H + relax[1]
    fG, fH = (torch.linalg.inv(P), torch.linalg.inv(Q)) if metric == "inv" else (Q, P)
    eye = lambda k: torch.eye(k, dtype=G.dtype, device=G.device)  # noqa: E731
    return torch.block_diag(torch.kron(eye(G.shape[0]), fG.contiguous()), torch.kron(eye(H.shape[0]), fH.contiguous()))


@dataclass
class _Head:
    """One pair head: where its coordinates sit, its base point, metric (with Cholesky factor) and vertical basis."""

    index: Tensor
    shapes: tuple[int, int, int]
    w: Tensor
    relax: tuple[Tensor, Tensor]
    metric: Tensor
    chol: Tensor
    vertical: Tensor
    weight: float

    def split(self, x: Tensor) -> tuple[Tensor, Tensor]:
        n, m, h = self.shapes
        return x[: n * h].reshape(n, h), x[n * h :].reshape(m, h)


def calibration_weight(G: Tensor, H: Tensor, metric: str, epsilon: float = EPSILON) -> float:
    """The head's metric weight under ``ball="calibrated"``, from the dense factors. inv: ``(n + m) / 2``, what makes
    ``||(t G, t H)||_g^2 = t^2 (n + m) h``, the adaptive norm of scaling every entry of the pair by ``1 + t``
    (``tr(P^-1 G^T G) + tr(Q^-1 H^T H) = 2 h`` at ``epsilon = 0``). mix: ``(n + m) / (2 lambda_min(P Q))`` with the
    relaxed ``P``, ``Q``, read off the general (non-symmetric) eigenvalues of the product ``P Q`` itself."""
    n, m = G.shape[0], H.shape[0]
    if metric == "inv":
        return (n + m) / 2
    G64, H64 = G.double(), H.double()
    P, Q = GLQuotient.relaxed_grams((G64.mT @ G64)[None], (H64.mT @ H64)[None], epsilon)
    eigenvalues = torch.linalg.eigvals(P[0] @ Q[0]).real
    return (n + m) / 2 / max(float(eigenvalues.min()), 2.220446049250313e-16 * float(eigenvalues.max()))


def _build_head(theta: Tensor, G_index: Tensor, H_index: Tensor, basis: Tensor, options: SpaceOptions) -> _Head:
    """The dense geometry of one head at the base point ``theta``."""
    G, H = theta[G_index], theta[H_index]
    GtG, HtH = G.mT @ G, H.mT @ H
    P, Q = GLQuotient.relaxed_grams(GtG[None], HtH[None], options.epsilon)
    relax = (P[0] - GtG, Q[0] - HtH)
    weight = calibration_weight(G, H, options.metric, options.epsilon) if options.ball == "calibrated" else 1.0
    M = weight * metric_matrix(G, H, relax, options.metric)
    M = 0.5 * (M + M.mT)
    VG, VH = G @ basis, -H @ basis.mT  # [b, n, h], [b, m, h]: the vertical vectors of the basis
    vertical = torch.cat([VG.flatten(1), VH.flatten(1)], 1).mT
    index = torch.cat([G_index.reshape(-1), H_index.reshape(-1)])
    return _Head(index, (G.shape[0], H.shape[0], G.shape[1]), theta[index], relax, M, torch.linalg.cholesky(M),
                 vertical, weight)


class ReferenceSpace:
    """Norms, gradients, projections and geodesic points of the perturbation space, computed densely.

    Args:
        base: the weights, one flat tensor or the parameters being measured (as for ``PerturbationSpace``).
        blocks: GL(h) pair blocks indexing the concatenation of ``base`` (ignored when ``options.metric`` is None).
        options: the same :class:`~hf_geosharp.engine.space.perturbation_space.SpaceOptions` as the space under test
        (default: the defaults). movable: ``[N]`` bool, the coordinates that may be perturbed (default: all); a block
        with a frozen
            coordinate is measured elementwise, as in the fast space.

    There is no sampler: the tests check the fast space's samples with :meth:`horizontal` instead.
    """

    def __init__(
        self,
        base: Tensor | Sequence[Tensor],
        blocks: list[PairBlock],
        options: SpaceOptions | None = None,
        movable: Tensor | None = None,
    ) -> None:
        parts = [base] if isinstance(base, Tensor) else list(base)
        self.base = torch.cat([_f64(p).reshape(-1) for p in parts])
        options = options or SpaceOptions()
        self.options, self.numel = options, self.base.numel()
        movable = torch.ones(self.numel, dtype=torch.bool) if movable is None else movable.to(_CPU, torch.bool)
        kept = [b for b in (blocks if options.metric is not None else [])
                if bool(movable[b.G_index].all() and movable[b.H_index].all())]
        self.heads = [
            _build_head(self.base, b.G_index[k], b.H_index[k],
                        _f64(algebra_basis(b.head_dim, b.lie_basis)), options)
            for b in kept for k in range(b.n_pairs)
        ]
        in_pair = torch.zeros(self.numel, dtype=torch.bool)
        for head in self.heads:
            in_pair[head.index] = True
        w2 = self.base.square()
        w2 = torch.where(w2 < ZERO_TOL**2, 0.0, w2)
        # ``w^2`` where the elementwise metric measures (zero: frozen), and on pair coordinates for the ablation
        # "riemannian_norm=False", which measures pairs elementwise
        self.scale_sq = torch.where(in_pair.logical_not() & movable, w2, 0.0)
        self.pair_scale_sq = None if options.riemannian_norm or not self.heads else torch.where(in_pair, w2, 0.0)

    # ------------------------------------------------------------------ helpers
    def zero(self) -> Tensor:
        """The zero tangent vector (float64)."""
        return torch.zeros(self.numel, dtype=_F64)

    def empty(self) -> Tensor:
        """An uninitialised tangent vector (float64)."""
        return torch.empty(self.numel, dtype=_F64)

    @staticmethod
    def _weighted(ab: Tensor, w2: Tensor) -> Tensor:
        """``sum ab / w^2`` where ``w^2 > 0``."""
        return torch.where(w2 > 0, ab / torch.where(w2 > 0, w2, 1.0), 0.0).sum()

    # ------------------------------------------------------------------ metric
    def inner_product(self, a: Tensor, b: Tensor) -> Tensor:
        """Riemannian inner product at the base point (float64 scalar)."""
        a, b = _f64(a), _f64(b)
        total = self._weighted(a * b, self.scale_sq)
        if self.pair_scale_sq is not None:
            return total + self._weighted(a * b, self.pair_scale_sq)
        for head in self.heads:
            total = total + a[head.index] @ head.metric @ b[head.index]
        return total

    def norm(self, xi: Tensor) -> Tensor:
        """The Riemannian norm ``||xi||_g`` (float64 scalar)."""
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    # ------------------------------------------------------------------ horizontal space
    @staticmethod
    def _project_head(head: _Head, x: Tensor) -> Tensor:
        """``x`` minus its g-orthogonal projection onto the vertical space: ``min_c ||L^T (x - V c)||`` with
        ``M = L L^T``, solved by least squares (rank-deficient vertical bases allowed)."""
        A, y = head.chol.mT @ head.vertical, head.chol.mT @ x
        c = torch.linalg.lstsq(A, y[:, None], driver="gelsd").solution[:, 0]
        return x - head.vertical @ c

    def _pairs_horizontal(self, x: Tensor, out: Tensor) -> Tensor:
        """``out``'s pair coordinates <- those of ``x``, projected if the options say so."""
        for head in self.heads:
            part = x[head.index]
            out[head.index] = self._project_head(head, part) if self.options.horizontal_projection else part
        return out

    def horizontal(self, xi: Tensor) -> Tensor:
        """Horizontal projection: identity on movable elementwise coordinates, zero on frozen ones."""
        xi = _f64(xi)
        return self._pairs_horizontal(xi, torch.where(self.scale_sq > 0, xi, 0.0))

    def project(self, xi: Tensor, rho: float) -> Tensor:
        """Onto ``{horizontal, ||xi||_g <= rho}``."""
        xi = self.horizontal(xi)
        norm = float(self.norm(xi))
        return xi * (rho / norm) if norm > rho else xi

    def riemannian_gradient(self, egrad: Tensor) -> Tensor:
        """``M^-1 egrad``, then horizontal."""
        egrad = _f64(egrad)
        out = egrad * self.scale_sq
        if self.pair_scale_sq is not None:
            return self._pairs_horizontal(egrad * self.pair_scale_sq, out)
        raised = torch.zeros_like(egrad)
        for head in self.heads:
            raised[head.index] = torch.cholesky_solve(egrad[head.index][:, None], head.chol)[:, 0]
        return self._pairs_horizontal(raised, out)

    def ascent_direction(self, egrad: Tensor, vectors: Tensor, out: Tensor) -> tuple[Tensor, float, list[float]]:
        """``d = riemannian_gradient(egrad)`` into ``out``, with ``<d, d>_g`` and ``<d, v>_g`` as inner products."""
        d = self.riemannian_gradient(egrad)
        products = [float(self.inner_product(d, v)) for v in vectors]
        return out.copy_(d), max(float(self.inner_product(d, d)), 0.0), products

    # ------------------------------------------------------------------ geodesics
    def _christoffel(self, head: _Head, xi: Tensor) -> Tensor:
        """``Gamma(xi, xi)`` of one head at the base point, from the metric field by autograd; differentiable in
        ``xi``. ``(D_xi M) xi`` is a Jacobian-vector product made of two vector-Jacobian products."""
        with torch.enable_grad():
            w = head.w.clone().requires_grad_(True)
            M = head.weight * metric_matrix(*head.split(w), head.relax, self.options.metric)
            (grad_quadratic,) = torch.autograd.grad(xi @ M @ xi, w, create_graph=True)
            u = torch.zeros_like(xi, requires_grad=True)
            (jt_u,) = torch.autograd.grad(M @ xi, w, u, create_graph=True)
            (j_xi,) = torch.autograd.grad(jt_u, u, xi, create_graph=True)
        return torch.cholesky_solve((j_xi - 0.5 * grad_quadratic)[:, None], head.chol)[:, 0]

    def _elementwise_correction(self, xi: Tensor) -> Tensor | None:
        curvature = self.options.elementwise_curvature
        if curvature == "none":
            return None
        moves = self.scale_sq > 0
        w = torch.where(moves, self.base, 1.0)
        ratio = torch.where(moves, xi / w, 0.0)
        if curvature == "second_order":
            return 0.5 * xi * ratio
        return w * (torch.expm1(ratio) - ratio)

    def point(self, xi: Tensor) -> Tensor:
        """``Exp(w; xi)``: ``Exp2`` on pairs (``w + xi`` without ``second_order``), the elementwise curvature
        elsewhere; differentiable in ``xi``."""
        point = self.base + xi
        correction = self._elementwise_correction(xi)
        if correction is not None:
            point = point + correction
        if self.options.second_order:
            for head in self.heads:
                point = point.index_add(0, head.index, -0.5 * self._christoffel(head, xi[head.index]))
        return point

    def exp_point(self, xi: Tensor, out: Tensor, need_grad: bool) -> Pullback | None:
        """Write ``Exp(w; xi)`` into ``out``; with ``need_grad`` return the pullback ``dL/dtheta -> dL/dxi`` (in
        place), by autograd through :meth:`point` (``None`` where the point is ``w + xi``)."""
        leaf = _f64(xi).requires_grad_(need_grad)
        point = self.point(leaf)
        out.copy_(point.detach())
        nonlinear = self.options.elementwise_curvature != "none" or (self.options.second_order and self.heads)
        if not need_grad or not nonlinear:
            return None

        def pullback(grad: Tensor) -> None:
            (pulled,) = torch.autograd.grad(point, leaf, _f64(grad), retain_graph=True)
            grad.copy_(pulled)

        return pullback


def projection_defects(
    inner: Callable[[Tensor, Tensor], Tensor], project: Callable[[Tensor], Tensor], a: Tensor, b: Tensor
) -> tuple[float, float]:
    """How far ``project`` is from a g-orthogonal projection in the metric ``inner``, on the vectors ``a`` and ``b``.

    Returns ``(|<P a, b>_g - <a, P b>_g| / (||a||_g ||b||_g), ||P P a - P a||_g / ||a||_g)``. Both are zero, up to
    rounding, exactly when ``P`` is g-self-adjoint and idempotent on these vectors: the precondition under which the
    fast ascent direction's ``<R e, v>_g = <e, v>`` (for horizontal ``v``) holds. A debugging check; the tests assert
    it for the perturbation space and show that it fails for an oblique projection."""
    Pa, Pb = project(a), project(b)
    scale = math.sqrt(float(inner(a, a)) * float(inner(b, b)))
    self_adjoint = abs(float(inner(Pa, b)) - float(inner(a, Pb))) / scale
    drift = project(Pa) - Pa
    return self_adjoint, math.sqrt(max(float(inner(drift, drift)), 0.0) / float(inner(a, a)))
