r"""Elementwise GL(1)+ rescaling geometry: the metric behind adaptive sharpness.

Points and tangent vectors are flat tensors. The metric is :math:`g(\xi, \eta) = \sum_i \xi_i\eta_i / w_i^2`, i.e.
:math:`\|\xi\|_g = \|\xi \oslash |w|\|_2` (da Silva et al., App. F, Eq. 37). Its exact geodesic is
:math:`w_i \exp(\xi_i / w_i)`; dropping the curvature term gives AS23's adaptive sharpness with ``c = |w|``
(App. F, Eqs. 38-39). Coordinates with ``|w_i| < zero_tol`` (and coordinates excluded by ``mask``) get zero allowed
perturbation instead of a division by zero (spec §2.4).

Only ``w^2`` (masked) is stored besides the base point: it is the one factor the solver's hot path needs (the Riemannian
gradient). ``scale = |w|`` and ``inv_scale = 1/|w|`` are derived on demand, because every stored parameter-sized vector
counts against the memory budget of a run (spec §4.4).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Curvature = Literal["none", "second_order", "exact_exp"]


class ElementwiseGeometry:
    """GL(1)+ metric on a flat parameter vector.

    Args:
        w: ``[N]`` base point (kept by reference, not copied).
        mask: ``[N]`` bool, coordinates that may move (default: all).
        curvature: ``"none"`` (first order, ``w + xi``: adaptive sharpness), ``"second_order"``
            (``w + xi + xi^2 / (2w)``) or ``"exact_exp"`` (``w exp(xi / w)``).
        zero_tol: weights smaller than this in magnitude are frozen.
    """

    def __init__(
        self, w: Tensor, mask: Tensor | None = None, curvature: Curvature = "none", zero_tol: float = 1e-12
    ) -> None:
        if curvature not in ("none", "second_order", "exact_exp"):
            raise ValueError(f"elementwise_curvature must be 'none', 'second_order' or 'exact_exp', got {curvature!r}.")
        w = w.detach()
        scale_sq = w.square()  # each pass over w costs ~1 % of a solver step on a CPU: three here, no more
        movable = scale_sq >= zero_tol**2
        if mask is not None:
            movable &= mask
        self.curvature = curvature
        self.w = w
        self.movable = movable
        zero = torch.zeros((), dtype=w.dtype, device=w.device)
        self.scale_sq = torch.where(movable, scale_sq, zero, out=scale_sq)  # in place: no float copy of the mask

    @property
    def scale(self) -> Tensor:
        """``|w|`` on movable coordinates, else 0 (a new tensor: not for per-step use)."""
        return torch.where(self.movable, self.w.abs(), torch.zeros((), dtype=self.w.dtype, device=self.w.device))

    @property
    def inv_scale(self) -> Tensor:
        """``1/|w|`` on movable coordinates, else 0 (a new tensor: not for per-step use)."""
        safe = torch.where(self.movable, self.w.abs(), torch.ones((), dtype=self.w.dtype, device=self.w.device))
        return torch.where(self.movable, safe.reciprocal(), torch.zeros((), dtype=self.w.dtype, device=self.w.device))

    def inner_product(self, a: Tensor, b: Tensor) -> Tensor:
        """``sum a b / w^2`` over movable coordinates (float64 scalar; cascade-summed, so accurate for 1e8 terms)."""
        ratio = (a * b).div_(self.scale_sq)  # inf or nan off the movable set, dropped by the mask
        return torch.where(self.movable, ratio, 0.0).sum().double()

    def norm(self, xi: Tensor) -> Tensor:
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    def euclidean_to_riemannian_gradient(self, egrad: Tensor, out: Tensor | None = None) -> Tensor:
        """``egrad * w^2`` (zero on frozen coordinates), optionally written into ``out``."""
        return torch.mul(egrad, self.scale_sq, out=out) if out is not None else egrad * self.scale_sq

    def projection(self, xi: Tensor) -> Tensor:
        """No symmetry is quotiented out; only frozen coordinates are zeroed."""
        return xi * self.movable

    def exp_correction(self, xi: Tensor) -> Tensor | None:
        """What the chosen geodesic adds to ``w + xi`` (``None`` for first order); differentiable."""
        if self.curvature == "none":
            return None
        ratio = xi * self.inv_scale * torch.sign(self.w)  # xi / w on movable coordinates
        if self.curvature == "second_order":
            return 0.5 * xi * ratio
        return self.w * (torch.expm1(ratio) - ratio)

    def random_tangent_vector(self, generator: torch.Generator | None = None) -> Tensor:
        """``Z |w|`` with ``Z ~ N(0, I)``: AS23's adaptive Gaussian direction (metric-isotropic).

        ``Z`` is drawn on the CPU in float64 so that a seed gives the same direction on every device and dtype."""
        Z = torch.randn(self.w.shape, generator=generator, dtype=torch.float64, device="cpu")
        return Z.to(device=self.w.device, dtype=self.w.dtype).mul_(self.scale)
