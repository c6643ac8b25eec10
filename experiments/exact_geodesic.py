r"""The exact geodesics of a diagonal linear net ``x -> x (u * v)`` as a perturbation space: the solver's ``Space``
protocol in ``(u, v)`` coordinates (:class:`ExactGeodesicSpace`), the training loss at a geodesic's endpoint as its
objective, and worst-case geodesic sharpness solved by the library's
:func:`hf_geosharp.engine.solvers.apgd.apgd` (a study of the solver against closed forms: docs/diagonal_networks.md).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch
from torch import Tensor

from hf_geosharp.engine.solvers.apgd import apgd

if TYPE_CHECKING:
    from .diagonal_networks import Problem

Metric = Literal["inv", "mix"]
Constraint = Literal["metric", "loose"]
DTYPE = torch.float64


class ExactGeodesicSpace:
    r"""Horizontal perturbations of one diagonal net with the exact geodesics of a diagonal net.

    Points are ``(u, v)`` with ``beta = u * v``; a tangent vector is the flat ``[2d]`` tensor ``(xi_u, xi_v)``. The
    GL(1) action ``(a u, v / a)`` per coordinate has vertical vectors ``(lam * u, -lam * v)``; the horizontal space is
    ``xi_u / u = xi_v / v =: b`` for **both** metrics (inv, Eq. 6: weights ``(1/u^2, 1/v^2)``; mix, Eq. 7: weights
    ``(v^2, u^2)``), and for both the g-orthogonal projection is ``b = (xi_u / u + xi_v / v) / 2``. Exact geodesics
    with horizontal velocity ``b``:

    * inv: ``(u e^{bt}, v e^{bt})``, so ``beta(1) = beta0 e^{2b}`` and ``||xi||_inv = sqrt(2) ||b||``;
    * mix: ``(u sqrt(1+2bt), v sqrt(1+2bt))``, so ``beta(1) = beta0 (1 + 2b)`` and ``||xi||_mix = sqrt(2) ||b beta0||``.

    The mix geodesic reaches the degenerate point ``u = v = 0`` (where the mix metric vanishes) at ``b = -1/2`` and
    cannot be continued, so the geodesic ball cannot flip the sign of any ``beta_i``; a velocity with ``b_i < -1/2``
    stops there (``beta_i = 0``). Under the metric constraint this binds on the many near-zero coordinates of a
    sparse net, which is what makes the metric and the loose constraint differ.

    ``constraint="loose"`` replaces the ball by ``||b|| <= rho`` (the form the paper's appendices write). That is the
    ball of the inv metric scaled by 1/2, so the space then uses that metric for norms and gradients: projected
    gradient ascent must measure steps in the geometry of its feasible set to converge to the constrained maximum.

    Coordinates with ``|u|`` or ``|v|`` below ``zero_tol`` are frozen (zero allowed perturbation), as the library
    does for zero weights: the horizontal space and the mix metric are undefined there.

    Args:
        u, v: ``[d]`` the trained weights (float64).
        metric: which geodesics (and, with ``constraint="metric"``, which norm).
        constraint: ``"metric"`` (``||xi||_g <= rho``) or ``"loose"`` (``||b|| <= rho``).
        zero_tol: weights smaller than this in magnitude are frozen.
    """

    def __init__(
        self, u: Tensor, v: Tensor, metric: Metric, constraint: Constraint = "metric", zero_tol: float = 1e-12
    ) -> None:
        if metric not in ("inv", "mix"):
            raise ValueError(f"metric must be 'inv' or 'mix', got {metric!r}.")
        if constraint not in ("metric", "loose"):
            raise ValueError(f"constraint must be 'metric' or 'loose', got {constraint!r}.")
        self.u, self.v = u.detach().to(DTYPE), v.detach().to(DTYPE)
        self.metric, self.constraint = metric, constraint
        self.movable = (self.u.abs() >= zero_tol) & (self.v.abs() >= zero_tol)
        one = torch.ones_like(self.u)
        self.inv_u = torch.where(self.movable, 1.0 / torch.where(self.movable, self.u, one), 0.0)
        self.inv_v = torch.where(self.movable, 1.0 / torch.where(self.movable, self.v, one), 0.0)
        if constraint == "loose":
            weights = 0.5 * torch.cat([self.inv_u, self.inv_v]).square()
        elif metric == "inv":
            weights = torch.cat([self.inv_u, self.inv_v]).square()
        else:
            weights = torch.cat([self.v, self.u]).square() * torch.cat([self.movable, self.movable])
        self.weights = weights
        positive = weights > 0
        safe = torch.where(positive, weights, torch.ones_like(weights))
        self.inverse_weights = torch.where(positive, 1.0 / safe, 0.0)

    @property
    def beta0(self) -> Tensor:
        return self.u * self.v

    def split(self, xi: Tensor) -> tuple[Tensor, Tensor]:
        d = self.u.numel()
        return xi[:d], xi[d:]

    def b_of(self, xi: Tensor) -> Tensor:
        """The horizontal coordinate ``b`` of ``xi``'s horizontal part (differentiable)."""
        xi_u, xi_v = self.split(xi)
        return 0.5 * (xi_u * self.inv_u + xi_v * self.inv_v)

    def horizontal_vector(self, b: Tensor) -> Tensor:
        """The horizontal tangent vector ``(b u, b v)`` (zero on frozen coordinates)."""
        b = b * self.movable
        return torch.cat([b * self.u, b * self.v])

    def vertical_vector(self, lam: Tensor) -> Tensor:
        """The tangent vector ``(lam u, -lam v)`` of the GL(1) orbit, along which ``u * v`` does not change."""
        return torch.cat([lam * self.u, -lam * self.v])

    # -------------------------------------------------------------------- the solver's Space protocol
    def zero(self) -> Tensor:
        return torch.zeros(2 * self.u.numel(), dtype=DTYPE)

    def inner_product(self, xi: Tensor, eta: Tensor) -> Tensor:
        return (self.weights * xi * eta).sum()

    def norm(self, xi: Tensor) -> Tensor:
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    def horizontal(self, xi: Tensor) -> Tensor:
        """g-orthogonal projection onto the horizontal space (the same map for the inv, mix and loose metrics)."""
        return self.horizontal_vector(self.b_of(xi))

    def empty(self) -> Tensor:
        return torch.empty(2 * self.u.numel(), dtype=DTYPE)

    def riemannian_gradient(self, egrad: Tensor) -> Tensor:
        """Raise the Euclidean gradient with the metric, then make it horizontal."""
        return self.horizontal(egrad * self.inverse_weights)

    def ascent_direction(self, egrad: Tensor, vectors: Tensor, out: Tensor) -> tuple[Tensor, float, list[float]]:
        """The solver's step: ``d = riemannian_gradient(egrad)`` into ``out`` (may be ``egrad``), ``<d, d>_g`` and
        ``<d, v>_g`` for the horizontal rows ``v`` of ``vectors``. The projection is g-self-adjoint, so the products
        are the Euclidean ``<egrad, v>`` and ``<d, d>_g = <egrad, d>``."""
        d = self.riemannian_gradient(egrad)
        products = torch.mv(vectors, egrad).tolist() if len(vectors) else []
        square = float(torch.dot(egrad, d))
        return out.copy_(d), max(square, 0.0), products

    def project(self, xi: Tensor, rho: float) -> Tensor:
        """Onto ``{horizontal, ||xi||_g <= rho}``: horizontal projection, then radial scaling (both g-orthogonal)."""
        xi = self.horizontal(xi)
        norm = float(self.norm(xi))
        return xi * (rho / norm) if norm > rho else xi

    def random_tangent_vector(self, generator: torch.Generator) -> Tensor:
        """A metric-isotropic Gaussian vector (covariance g^-1), made horizontal."""
        z = torch.randn(2 * self.u.numel(), generator=generator, dtype=DTYPE)
        return self.horizontal(z * self.inverse_weights.sqrt())

    # -------------------------------------------------------------------- exact geodesics
    def geodesic(self, xi: Tensor, t: float = 1.0) -> tuple[Tensor, Tensor]:
        """``(u(t), v(t))`` on the exact geodesic with initial velocity ``horizontal(xi)``."""
        b = self.b_of(xi)
        scale = torch.exp(b * t) if self.metric == "inv" else torch.clamp(1.0 + 2.0 * b * t, min=0.0).sqrt()
        return self.u * scale, self.v * scale

    def endpoint_beta(self, xi: Tensor) -> Tensor:
        """``u(1) * v(1)`` in closed form; unlike the product of :meth:`geodesic` it has a finite gradient where the
        mix geodesic stops at ``beta_i = 0``."""
        b = self.b_of(xi)
        factor = torch.exp(2.0 * b) if self.metric == "inv" else torch.clamp(1.0 + 2.0 * b, min=0.0)
        return self.beta0 * factor


class ExactGeodesicObjective:
    """``(xi, need_grad) -> (train MSE at the geodesic endpoint, d loss / d xi)``, the solver's objective.

    It remembers the worst point it has seen (the solver's best point), so that a caller can ask how many mix
    coordinates ended at the end of their geodesic."""

    def __init__(self, space: ExactGeodesicSpace, problem: Problem) -> None:
        self.space, self.problem = space, problem
        self.worst_loss, self.worst_xi = -float("inf"), space.zero()

    def __call__(self, xi: Tensor, need_grad: bool, out: Tensor | None = None) -> tuple[float, Tensor | None]:
        xi = xi.detach().requires_grad_(need_grad)
        with torch.set_grad_enabled(need_grad):
            loss = self.problem.train_loss(self.space.endpoint_beta(xi))
            grad = torch.autograd.grad(loss, xi)[0] if need_grad else None
        if grad is not None and out is not None:
            grad = out.copy_(grad)
        value = float(loss.detach())
        if not math.isfinite(value):
            raise FloatingPointError(f"The loss is {value} on the geodesic ball; lower rho.")
        if value > self.worst_loss:
            self.worst_loss, self.worst_xi = value, xi.detach().clone()
        return value, grad


def geodesic_sharpness(
    u: Tensor, v: Tensor, problem: Problem, *, metric: Metric, constraint: Constraint, rho: float, steps: int
) -> tuple[float, int]:
    """Worst-case geodesic sharpness of one net and the number of coordinates whose (mix) geodesic was cut at
    ``beta_i = 0`` at the worst point found."""
    space = ExactGeodesicSpace(u, v, metric, constraint)
    objective = ExactGeodesicObjective(space, problem)
    result = apgd(space, objective, rho=rho, steps=steps)
    cut = int((1.0 + 2.0 * space.b_of(objective.worst_xi) <= 0).sum()) if metric == "mix" else 0
    return result.sharpness, cut
