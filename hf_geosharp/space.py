"""The perturbation space: where the solver moves, in the model's own parameter coordinates.

A tangent vector ``xi`` is a flat tensor laid out like the model's flat parameter vector ``theta0`` (see
:mod:`hf_geosharp.symmetry.base`). Coordinates that belong to a GL(h) pair are handled by :class:`GLQuotient` (gathered
through the pair's index map, ``[k, n, h]`` at a time); all other coordinates by :class:`ElementwiseGeometry`.
Adaptive sharpness is the same space with no pairs and first-order steps, so one solver serves both measures.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .geometry.elementwise import Curvature, ElementwiseGeometry
from .geometry.gl_quotient import GLQuotient, Metric
from .symmetry.base import PairBlock


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


class PerturbationSpace:
    """Norms, gradients, projections and geodesic displacements for flat tangent vectors at ``theta0``.

    Args:
        theta0: ``[N]`` the trained weights, flattened (working dtype).
        blocks: GL(h) pair blocks (ignored when ``options.metric`` is None).
        options: see :class:`SpaceOptions`.
        movable: ``[N]`` bool, the coordinates that may be perturbed (default: all).
        probe_seed: seed of the fixed probe used by the equivariant Gaussian sampler.
    """

    def __init__(
        self,
        theta0: Tensor,
        blocks: list[PairBlock],
        options: SpaceOptions = SpaceOptions(),
        movable: Tensor | None = None,
        probe_seed: int = 0,
    ) -> None:
        self.theta0 = theta0.detach()
        self.options = options
        movable = torch.ones_like(self.theta0, dtype=torch.bool) if movable is None else movable.to(torch.bool)
        device = self.theta0.device
        self.blocks = [
            b for b in (blocks if options.metric is not None else [])
            if bool(movable[b.G_index.to(device)].all() and movable[b.H_index.to(device)].all())
        ]
        pair_mask = torch.zeros_like(movable)
        probe = torch.Generator().manual_seed(probe_seed)
        self.pairs: list[tuple[Tensor, Tensor, GLQuotient]] = []
        for block in self.blocks:
            gi, hi = block.G_index.to(device), block.H_index.to(device)
            pair_mask[gi] = True
            pair_mask[hi] = True
            geometry = GLQuotient(
                self.theta0[gi], self.theta0[hi], options.metric, options.epsilon, block.lie_basis, probe
            )
            self.pairs.append((gi, hi, geometry))
        self.elementwise = ElementwiseGeometry(self.theta0, movable & ~pair_mask, options.elementwise_curvature)
        self._movable = self.elementwise.movable | pair_mask  # frozen and zero-weight coordinates never move
        # Ablation "riemannian_norm=False": pair coordinates are measured like adaptive sharpness measures them.
        self.pair_elementwise = (
            None if options.riemannian_norm or not self.pairs else ElementwiseGeometry(self.theta0, pair_mask)
        )
        self._pair_index = (
            torch.cat([torch.cat([gi.reshape(-1), hi.reshape(-1)]) for gi, hi, _ in self.pairs])
            if self.pairs
            else None
        )

    # ------------------------------------------------------------------ helpers
    def zero(self) -> Tensor:
        return torch.zeros_like(self.theta0)

    @property
    def n_pairs(self) -> int:
        return sum(g.G.shape[0] for _, _, g in self.pairs)

    def _map_pairs(self, xi: Tensor, fn) -> Tensor:
        """Apply ``fn((xi_G, xi_H)) -> (G', H')`` per block and write the results into a copy of ``xi``."""
        out = xi.clone()
        for gi, hi, geometry in self.pairs:
            out[gi], out[hi] = fn(geometry, (xi[gi], xi[hi]))
        return out

    # ------------------------------------------------------------------ metric
    def norm(self, xi: Tensor) -> Tensor:
        """Riemannian norm at ``theta0`` (float64 scalar)."""
        sq = self.elementwise.norm(xi).square()
        if self.pair_elementwise is not None:
            return (sq + self.pair_elementwise.norm(xi).square()).sqrt()
        for gi, hi, geometry in self.pairs:
            sq = sq + geometry.inner_product((xi[gi], xi[hi]), (xi[gi], xi[hi])).sum()
        return sq.clamp_min(0).sqrt()

    def riemannian_gradient(self, egrad: Tensor) -> Tensor:
        """Raise the Euclidean gradient with the metric, then make it horizontal (a valid ascent direction)."""
        r = self.elementwise.euclidean_to_riemannian_gradient(egrad)
        if self.pair_elementwise is not None:
            r = r + self.pair_elementwise.euclidean_to_riemannian_gradient(egrad)
        else:
            for gi, hi, geometry in self.pairs:
                r[gi], r[hi] = geometry.euclidean_to_riemannian_gradient((egrad[gi], egrad[hi]))
        return self.horizontal(r)

    def horizontal(self, xi: Tensor) -> Tensor:
        """g-orthogonal projection onto the horizontal space (identity on elementwise coordinates)."""
        xi = xi * self._movable
        if not self.options.horizontal_projection or not self.pairs:
            return xi
        return self._map_pairs(xi, lambda g, x: g.projection(x))

    def project(self, xi: Tensor, rho: float) -> Tensor:
        """Onto the feasible set ``{horizontal, ||xi||_g <= rho}``: horizontal projection, then radial scaling.

        Both steps are g-orthogonal, so their composition is the g-orthogonal projection onto the set (spec §4.2)."""
        xi = self.horizontal(xi)
        norm = float(self.norm(xi))
        return xi * (rho / norm) if norm > rho else xi

    # ------------------------------------------------------------------ geodesics
    def displacement(self, xi: Tensor) -> Tensor:
        """``Exp(theta0; xi) - theta0``, differentiable in ``xi``: Exp2 on pairs, the chosen curvature elsewhere."""
        delta = xi
        elementwise = self.elementwise.exp_correction(xi)
        if elementwise is not None:
            delta = delta + elementwise
        if self.options.second_order and self.pairs:
            values = []
            for gi, hi, geometry in self.pairs:
                cG, cH = geometry.exp2_correction((xi[gi], xi[hi]))
                values += [cG.reshape(-1), cH.reshape(-1)]
            delta = delta + torch.zeros_like(xi).index_put((self._pair_index,), torch.cat(values))
        return delta

    # ------------------------------------------------------------------ sampling
    def random_tangent_vector(self, generator: torch.Generator) -> Tensor:
        """A metric-isotropic Gaussian horizontal vector; equivariant under the pairs' group actions."""
        z = self.elementwise.random_tangent_vector(generator)
        if self.pair_elementwise is not None:
            z = z + self.pair_elementwise.random_tangent_vector(generator)
        else:
            for gi, hi, geometry in self.pairs:
                z[gi], z[hi] = geometry.random_tangent_vector(generator)
        return self.horizontal(z)
