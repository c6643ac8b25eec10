"""The solvers' parameter-sized vectors: a fixed pool of rows, updated in place."""

from __future__ import annotations

import torch
from torch import Tensor


class Pool:
    """``size`` parameter-sized buffers, the rows of one matrix, handed out by identity so that no live vector is
    overwritten.

    One matrix rather than separate tensors, so that the inner products of a gradient with several buffers are one
    matrix-vector product and a combination of buffers is one ``addmv``: each reads every row once. Rows are never
    initialised (a row is written before it is read), so untouched ones cost no memory."""

    def __init__(self, like: Tensor, size: int) -> None:
        self.matrix = like.new_empty((size, like.numel()))
        self.rows = list(self.matrix.unbind(0))
        self._coefs = like.new_empty(2)  # combine_into's coefficients, filled on the device (no upload, no wait)

    def free(self, *live: Tensor | None) -> Tensor:
        """The first row that is none of ``live`` (a row in use must be named, or it may be handed out)."""
        for row in self.rows:
            if all(row is not x for x in live):
                return row
        raise RuntimeError(f"all {len(self.rows)} solver buffers are live; this is a bug in the solver")

    def position(self, row: Tensor) -> int:
        """Where ``row`` sits in the pool's matrix (combinations and stacked views run in this order)."""
        return next(i for i, r in enumerate(self.rows) if r is row)

    def stacked(self, rows: list[Tensor]) -> Tensor:
        """Up to two distinct rows, in pool order, as one ``[r, N]`` matrix: a strided view of the pool, no copy."""
        positions = sorted({self.position(row) for row in rows})
        if not positions:
            return self.matrix[:0]
        if len(positions) > 2:
            raise ValueError("stacked() takes at most two distinct rows")
        step = positions[1] - positions[0] if len(positions) == 2 else 1
        return self.matrix[positions[0]::step][: len(positions)]

    def combine_into(self, out: Tensor, scale: float, terms: list[tuple[float, Tensor]]) -> None:
        """``out <- scale * out + sum coef * row`` in place, in one pass (``addmv``); ``out`` must not be a term."""
        merged: dict[int, float] = {}
        for coef, row in terms:
            i = self.position(row)
            merged[i] = merged.get(i, 0.0) + coef
        merged = {i: c for i, c in merged.items() if c != 0.0}
        if not merged:
            out.zero_() if scale == 0 else out.mul_(scale)  # (0 * an uninitialised row could be NaN)
            return
        order = sorted(merged)  # the order of stacked()'s rows
        first, rest = order[:2], order[2:]  # stacked() views at most two rows; a third is added in another pass
        rows = self.stacked([self.rows[i] for i in first])
        coefs = self._coefs[: len(first)]
        for j, i in enumerate(first):
            coefs[j].fill_(merged[i])
        out.addmv_(rows.t(), coefs, beta=scale)
        for i in rest:
            out.add_(self.rows[i], alpha=merged[i])

    def combine_on_device(self, out: Tensor, scale: Tensor | None, terms: list[tuple[Tensor, Tensor]]) -> None:
        """:meth:`combine_into` with coefficients that stay on the device (0-dim tensors; ``scale`` None for 0):
        ``out <- scale * out + sum coef * row``, rounded as ``combine_into`` rounds it (``scale * out`` first, the
        first two rows in pool order by one ``addmv``, a third by one more pass); ``out`` must not be a term."""
        merged: dict[int, Tensor] = {}
        for coef, row in terms:
            i = self.position(row)
            merged[i] = merged[i] + coef if i in merged else coef
        order = sorted(merged)  # the order of stacked()'s rows
        first, rest = order[:2], order[2:]
        coefs = self._coefs[: len(first)]
        coefs.copy_(torch.stack([merged[i] for i in first]))
        if scale is not None:
            out.mul_(scale)
        out.addmv_(self.stacked([self.rows[i] for i in first]).t(), coefs, beta=0.0 if scale is None else 1.0)
        for i in rest:
            out.addcmul_(self.rows[i], merged[i].to(out.dtype))
