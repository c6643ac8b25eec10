r"""Elementwise GL(1)+ rescaling geometry: the metric behind adaptive sharpness.

Points and tangent vectors are flat tensors. The metric is :math:`g(\xi, \eta) = \sum_i \xi_i\eta_i / w_i^2`, i.e.
:math:`\|\xi\|_g = \|\xi \oslash |w|\|_2` (da Silva et al., App. F, Eq. 37). Its exact geodesic is
:math:`w_i \exp(\xi_i / w_i)`; dropping the curvature term gives AS23's adaptive sharpness with ``c = |w|``
(App. F, Eqs. 38-39). Coordinates with ``|w_i| < zero_tol`` (and coordinates excluded by ``mask``) get zero allowed
perturbation instead of a division by zero (spec §2.4).
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Curvature = Literal["none", "second_order", "exact_exp"]


class ElementwiseGeometry:
    """GL(1)+ metric on a flat parameter vector.

    Args:
        w: ``[N]`` base point.
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
        movable = w.abs() >= zero_tol
        if mask is not None:
            movable &= mask
        self.curvature = curvature
        self.w = w
        self.scale = torch.where(movable, w.abs(), torch.zeros_like(w))  # |w| on movable coordinates, else 0
        self.scale_sq = self.scale.square()
        self.inv_scale = torch.where(movable, 1.0 / torch.where(movable, w.abs(), torch.ones_like(w)), 0.0)
        self.movable = movable

    def inner_product(self, a: Tensor, b: Tensor) -> Tensor:
        return (a * self.inv_scale).double().mul((b * self.inv_scale).double()).sum()

    def norm(self, xi: Tensor) -> Tensor:
        return (xi * self.inv_scale).double().norm()

    def euclidean_to_riemannian_gradient(self, egrad: Tensor) -> Tensor:
        return egrad * self.scale_sq

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
        """``Z |w|`` with ``Z ~ N(0, I)``: AS23's adaptive Gaussian direction (metric-isotropic)."""
        Z = torch.randn(self.w.shape, generator=generator, dtype=torch.float64, device="cpu")
        return Z.to(device=self.w.device, dtype=self.w.dtype) * self.scale
