r"""Elementwise GL(1)+ rescaling geometry: the metric behind adaptive sharpness.

Points and tangent vectors are flat tensors. The metric is :math:`g(\xi, \eta) = \sum_i \xi_i\eta_i / w_i^2`, i.e.
:math:`\|\xi\|_g = \|\xi \oslash |w|\|_2` (da Silva et al., App. F, Eq. 37). Its exact geodesic is
:math:`w_i \exp(\xi_i / w_i)`; dropping the curvature term gives AS23's adaptive sharpness with ``c = |w|``
(App. F, Eqs. 38-39). Coordinates with ``|w_i| < zero_tol`` (and coordinates excluded by ``mask``) get zero allowed
perturbation instead of a division by zero.

Only ``w^2`` (zero where frozen) is stored: it is the one factor the solver's hot path needs (the Riemannian gradient),
and it also says which coordinates move (``w^2 > 0``), so no mask is kept. ``scale = |w|`` is derived from it on demand;
the weights themselves are kept only for a curved geodesic (the ablation ``curvature != "none"``), because every
stored parameter-sized vector counts against the memory budget of a run.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor

Curvature = Literal["none", "second_order", "exact_exp"]


class ElementwiseGeometry:
    """GL(1)+ metric on a flat parameter vector.

    Args:
        w: ``[N]`` base point (read once; kept by reference only for a curved geodesic).
        mask: ``[N]`` bool, coordinates that may move (default: all).
        curvature: ``"none"`` (first order, ``w + xi``: adaptive sharpness), ``"second_order"``
            (``w + xi + xi^2 / (2w)``) or ``"exact_exp"`` (``w exp(xi / w)``).
        zero_tol: weights smaller than this in magnitude are frozen.
    """

    #: Coordinates per block of :meth:`riemannian_gradient_pass`: a few MiB, so a block stays in cache.
    CHUNK = 1 << 20

    def __init__(
        self, w: Tensor, mask: Tensor | None = None, curvature: Curvature = "none", zero_tol: float = 1e-12
    ) -> None:
        if curvature not in ("none", "second_order", "exact_exp"):
            raise ValueError(f"elementwise_curvature must be 'none', 'second_order' or 'exact_exp', got {curvature!r}.")
        w = w.detach()
        scale_sq = w.square()  # each pass over w costs ~1 % of a solver step on a CPU: few here
        frozen = scale_sq < zero_tol**2
        if mask is not None:
            frozen |= ~mask
        self.curvature = curvature
        self.w = w if curvature != "none" else None
        self.scale_sq = scale_sq.masked_fill_(frozen, 0.0)  # in place: no float copy of the mask

    @property
    def movable(self) -> Tensor:
        """``[N]`` bool, the coordinates that move (a new tensor: not for per-step use)."""
        return self.scale_sq > 0

    @property
    def scale(self) -> Tensor:
        """``|w|`` on movable coordinates, else 0 (a new tensor: not for per-step use).

        ``sqrt(w^2)``: exactly ``|w|`` in float32, whose square root is correctly rounded; within an ulp in float64."""
        return self.scale_sq.sqrt()

    @property
    def inv_scale(self) -> Tensor:
        """``1/|w|`` on movable coordinates, else 0 (a new tensor: not for per-step use)."""
        return torch.where(self.scale_sq > 0, self.scale_sq.rsqrt(), 0.0)

    def inner_product(self, a: Tensor, b: Tensor) -> Tensor:
        """``sum a b / w^2`` over movable coordinates (float64 scalar; cascade-summed, so accurate for 1e8 terms)."""
        ratio = (a * b).div_(self.scale_sq)  # inf or nan off the movable set, dropped by the mask
        return torch.where(self.scale_sq > 0, ratio, 0.0).sum().double()

    def norm(self, xi: Tensor) -> Tensor:
        return self.inner_product(xi, xi).clamp_min(0).sqrt()

    def euclidean_to_riemannian_gradient(self, egrad: Tensor, out: Tensor | None = None) -> Tensor:
        """``egrad * w^2`` (zero on frozen coordinates), optionally written into ``out``."""
        return torch.mul(egrad, self.scale_sq, out=out) if out is not None else egrad * self.scale_sq

    def riemannian_gradient_pass(self, egrad: Tensor, out: Tensor, vectors: Tensor) -> tuple[float, list[float]]:
        """``out <- egrad * w^2`` (``out`` may be ``egrad`` itself), with ``sum egrad^2 w^2`` and ``vectors @ egrad``
        (``vectors``: ``[r, N]``), in one pass over the data.

        The sum is ``<r, r>_g`` for ``r = egrad * w^2``. Block by block, everything that reads a block of ``egrad``
        runs before it is overwritten and while it is in cache; sums accumulate across blocks in float64."""
        scratch = egrad.new_empty(min(self.CHUNK, egrad.numel()))
        sums = torch.zeros(len(vectors) + 1, dtype=torch.float64, device=egrad.device)  # on the device: no syncs
        for start in range(0, egrad.numel(), self.CHUNK):
            block = slice(start, start + self.CHUNK)
            e = egrad[block]
            if len(vectors):
                sums[1:] += torch.mv(vectors[:, block], e)
            r = torch.mul(e, self.scale_sq[block], out=scratch[: e.numel()])
            sums[0] += torch.dot(e, r)
            out[block].copy_(r)
        square, *products = sums.tolist()
        return square, products

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
        Z = torch.randn(self.scale_sq.shape, generator=generator, dtype=torch.float64, device="cpu")
        return Z.to(device=self.scale_sq.device, dtype=self.scale_sq.dtype).mul_(self.scale)
