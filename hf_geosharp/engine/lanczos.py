r"""The largest eigenvalue of a symmetric operator known only by its products: Lanczos with full
reorthogonalisation and thick restarts, its vectors kept on the operator's device.

The basis ``Q`` (orthonormal columns, at most :data:`KRYLOV_DIM` of them) and the projected matrix ``T = Q^T H Q``
keep ``H Q = Q T + r e_last^T`` with ``r`` orthogonal to ``Q``: each new column is the last product's residual,
orthogonalised twice against the basis, and ``T``'s new column is read off those coefficients (at most
:data:`KRYLOV_DIM` numbers and two norms are the host reads per product). A Ritz pair ``(theta, y = Q s)`` of
``T`` then has ``||H y - theta y|| = ||r|| |s_last|`` (Lanczos' residual estimate), and an eigenvalue of ``H`` lies
within it of ``theta``. ``theta`` is a Rayleigh quotient of ``H``, so never above its largest eigenvalue. A full
basis restarts thick (Wu and Simon 2000): its :data:`KEEP` largest Ritz vectors stay, and the iteration goes on
from ``r``.

A vanishing ``r`` means the Krylov space of the start is invariant: its Ritz values are eigenvalues of ``H``, and from
a random start (a component along every eigenvector, almost surely) they include the largest one.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

#: Most basis vectors held at once (memory: this many parameter-sized vectors); a full basis restarts thick.
KRYLOV_DIM = 20
#: Ritz vectors (the largest ones) a thick restart keeps.
KEEP = 6
#: ``||r||`` under this many units of round-off times the spectral radius seen: the Krylov space is invariant.
INVARIANT_ULPS = 100


@dataclass
class Ritz:
    """Where one Lanczos run stopped: its largest Ritz value, vector and residual estimate ``||H y - theta y||``;
    ``settled`` when that estimate met the threshold, ``invariant`` when the Krylov space was, ``products`` used."""

    theta: float
    vector: Tensor
    residual: float
    settled: bool
    invariant: bool
    products: int


def lanczos(product: Callable[[Tensor], Tensor], start: Tensor, budget: int, tol: float, floor: float = 0.0,
            deflate: Tensor | None = None, above: float = math.inf) -> Ritz:
    """Largest Ritz pair of ``H`` (or of ``P H P``, ``P`` the projector off the rows of ``deflate``) from ``start``.

    Args:
        product: ``v -> H v`` on flat vectors.
        start: the start vector (any norm; projected off ``deflate``).
        budget: most products.
        tol: the pair settles when its residual estimate is at most ``tol * max(|theta|, floor)``.
        floor: see ``tol`` (a scale for a ``theta`` near zero).
        deflate: orthonormal rows the iteration stays orthogonal to, or ``None``.
        above: stop as soon as the largest Ritz value exceeds this (a larger eigenvalue than a candidate exists).

    Returns:
        The run's :class:`Ritz` pair.
    """
    n = start.numel()
    cap = min(KRYLOV_DIM, n)
    basis = start.new_zeros((cap, n))
    projected = torch.zeros((cap, cap), dtype=torch.float64)
    w, k, used, radius = start, 0, 0, 0.0
    ulp = torch.finfo(start.dtype).eps
    theta, y, estimate = -math.inf, start, math.inf
    while used < budget:
        w = _orthogonal(_orthogonal(w, deflate), deflate)
        beta = float(torch.linalg.vector_norm(w))
        if k == 0 and beta == 0.0:
            raise ValueError("The start vector lies in the deflated space; draw another one.")
        basis[k] = w / beta
        w = product(basis[k])
        used += 1
        w = _orthogonal(w, deflate)
        c1 = basis[:k + 1] @ w
        w = w - c1 @ basis[:k + 1]
        c2 = basis[:k + 1] @ w
        w = w - c2 @ basis[:k + 1]
        column = (c1 + c2).to(device="cpu", dtype=torch.float64)
        projected[:k + 1, k] = column
        projected[k, :k + 1] = column
        k += 1
        values, vectors = torch.linalg.eigh(projected[:k, :k])
        beta = float(torch.linalg.vector_norm(w))
        radius = max(radius, abs(float(values[0])), abs(float(values[-1])))
        theta, s = float(values[-1]), vectors[:, -1]
        estimate = beta * abs(float(s[-1]))
        y = s.to(device=basis.device, dtype=basis.dtype) @ basis[:k]
        invariant = beta <= INVARIANT_ULPS * ulp * radius or k == n
        if invariant or theta > above or estimate <= tol * max(abs(theta), floor):
            return Ritz(theta, y, estimate, not theta > above, invariant, used)
        if k == cap:  # thick restart: the largest Ritz vectors stay, T becomes their diagonal
            keep = min(KEEP, k - 1)
            basis[:keep] = vectors[:, -keep:].T.to(device=basis.device, dtype=basis.dtype) @ basis[:k]
            projected.zero_()
            projected[torch.arange(keep), torch.arange(keep)] = values[-keep:]
            k = keep
    return Ritz(theta, y, estimate, False, False, used)


def _orthogonal(w: Tensor, rows: Tensor | None) -> Tensor:
    """``w`` less its components along the orthonormal ``rows``."""
    return w if rows is None else w - (rows @ w) @ rows
