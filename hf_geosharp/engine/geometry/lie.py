"""Lie algebras of the groups that act on a GL(h) pair, and random elements of those groups.

Pure torch. A subgroup of GL(h) is described by a Frobenius-orthonormal basis ``[b, h, h]`` of its Lie algebra
(``PairBlock.lie_basis``); ``None`` means the full group GL(h). The geometry engine projects onto the vertical space
spanned by that basis, :func:`random_group_element` draws elements of the group for the reparametrisation probe, and
the group search (:mod:`hf_geosharp.engine.symmetry_search`) moves along the algebra in the coordinates of
:func:`algebra_basis`.
"""

from __future__ import annotations

import math

import torch


def rope_commutant_basis(
    head_dim: int, rotary_dim: int, *, interleaved: bool = False, dtype: torch.dtype = torch.float64
) -> torch.Tensor:
    """Orthonormal basis of the Lie algebra of the matrices that commute with every RoPE rotation of one head.

    Rotary embeddings rotate frequency pair ``j`` of the first ``rotary_dim`` head coordinates by an angle that
    depends on the position, so the attention score ``q R_{t-s} k^T`` stays invariant under ``(W_q, W_k) ->
    (W_q A^{-1}, W_k A^T)`` only if ``A`` commutes with all rotations: on each frequency pair a rotation-scaling
    ``a I_2 + b J`` (a complex scalar), on the non-rotary coordinates (partial rotary) any matrix, and no coupling
    between the two parts (frequencies are distinct, so pairs cannot mix).

    Args:
        head_dim: h, the head dimension.
        rotary_dim: r, how many leading head coordinates are rotated (even, ``0 < r <= h``).
        interleaved: pair coordinates ``(2j, 2j+1)`` (GPT-J's ``rotate_every_two``) instead of HF's ``rotate_half``
            pairing ``(j, j + r/2)``.
        dtype: dtype of the basis.

    Returns:
        ``[r + (h - r)^2, h, h]``: for each pair ``I_2/sqrt 2`` and ``J/sqrt 2`` embedded at the pair's coordinates,
        then the unit matrices ``E_ab`` of the non-rotary block.
    """
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise ValueError(f"rotary_dim must be even and in (0, head_dim={head_dim}]; got {rotary_dim}.")
    half = rotary_dim // 2
    c = 1.0 / math.sqrt(2.0)
    mats = []
    for j in range(half):
        a, b = (2 * j, 2 * j + 1) if interleaved else (j, j + half)
        scaling = torch.zeros(head_dim, head_dim, dtype=dtype)
        scaling[a, a] = scaling[b, b] = c
        rotation = torch.zeros(head_dim, head_dim, dtype=dtype)
        rotation[a, b], rotation[b, a] = -c, c
        mats += [scaling, rotation]
    for a in range(rotary_dim, head_dim):
        for b in range(rotary_dim, head_dim):
            unit = torch.zeros(head_dim, head_dim, dtype=dtype)
            unit[a, b] = 1.0
            mats.append(unit)
    return torch.stack(mats)


def algebra_basis(head_dim: int, lie_basis: torch.Tensor | None = None) -> torch.Tensor:
    """The float64 basis ``[b, h, h]`` of the Lie algebra that acts on a pair: ``lie_basis`` (a subgroup's), or the
    unit matrices ``E_ij`` of gl(h) when it is ``None``."""
    if lie_basis is None:
        return torch.eye(head_dim * head_dim, dtype=torch.float64).view(head_dim * head_dim, head_dim, head_dim)
    return lie_basis.to(torch.float64)


def algebra_elements(coeffs: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """``[k, h, h]``: the algebra elements with coordinates ``coeffs [k, b]`` in ``basis [b, h, h]``."""
    return torch.einsum("kb,bij->kij", coeffs, basis)


def _project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Frobenius-orthogonal projection of ``x [..., h, h]`` onto the span of an orthonormal ``basis [b, h, h]``."""
    coeffs = torch.einsum("...ij,bij->...b", x, basis)
    return torch.einsum("...b,bij->...ij", coeffs, basis)


def random_group_element(
    k: int,
    h: int,
    *,
    lie_basis: torch.Tensor | None = None,
    scale: float = 1.0,
    condition: float = 10.0,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``k`` random elements of GL(h) (or of the subgroup with Lie algebra ``lie_basis``), float64 ``[k, h, h]``.

    Each element is ``scale * exp(K) exp(S)`` with ``K`` skew and ``S`` symmetric, both in the Lie algebra, and
    ``S`` rescaled so that the element's condition number is exactly ``condition`` (singular values
    ``scale * condition^{-1/2} ... scale * condition^{1/2}``). A bounded condition number keeps the probe
    meaningful (weights move a lot) without turning it into a test of floating-point round-off.

    The algebra must be closed under transposition and contain the identity (true for GL(h) and for the RoPE
    commutant); otherwise the polar split leaves the subgroup and a ``ValueError`` says so.
    """
    if condition < 1.0:
        raise ValueError(f"condition must be >= 1; got {condition}.")
    if scale <= 0.0:
        raise ValueError(f"scale must be > 0; got {scale}.")
    if lie_basis is None:
        x = torch.randn(k, h, h, generator=generator, dtype=torch.float64)
    else:
        basis = lie_basis.to(torch.float64)
        coeffs = torch.randn(k, basis.shape[0], generator=generator, dtype=torch.float64)
        x = algebra_elements(coeffs, basis)
    sym, skew = (x + x.mT) / 2, (x - x.mT) / 2
    eye = torch.eye(h, dtype=torch.float64)
    if lie_basis is not None:
        for what, m in (("symmetric part", sym), ("skew part", skew), ("identity", eye)):
            if (m - _project(m, basis)).abs().max() > 1e-10:
                raise ValueError(
                    f"lie_basis: the {what} of an algebra element is not in the algebra; random_group_element "
                    "needs an algebra closed under transposition that contains the identity."
                )
    evals = torch.linalg.eigvalsh(sym)
    spread = evals[:, -1] - evals[:, 0]
    # alpha * (S - mid I) has eigenvalues spanning exactly log(condition), centred on 0: its exponential has
    # singular values from condition^{-1/2} to condition^{1/2}, so ``scale`` alone sets the size
    alpha = torch.where(spread > 1e-12, math.log(condition) / spread.clamp_min(1e-12), torch.zeros_like(spread))
    mid = (evals[:, -1] + evals[:, 0]) / 2
    stretched = alpha[:, None, None] * (sym - mid[:, None, None] * eye)
    return scale * torch.linalg.matrix_exp(skew) @ torch.linalg.matrix_exp(stretched)
