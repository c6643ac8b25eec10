"""Auto-PGD's step size: Croce & Hein's halving rule at AS23's checkpoints."""

from __future__ import annotations

import math


def as23_checkpoints(n_iters: int) -> list[int]:
    """AS23's step-size checkpoints (``[5, 9, 12, 15, 16, 18, 19, 20]`` for 20 iterations)."""
    p = [0.0, 0.22]
    w = [0, math.ceil(n_iters * 0.22)]
    while w[-1] < n_iters and w[-1] != w[-2]:
        p.append(p[-1] + max(p[-1] - p[-2] - 0.03, 0.06))
        w.append(math.ceil(p[-1] * n_iters))
    return w[1:]


class StepSchedule:
    """Croce & Hein's halving rule at the checkpoints, with AS23's conditions."""

    def __init__(self, eta: float, steps: int, min_update_ratio: float, clean_loss: float) -> None:
        self.eta = eta
        self.checkpoints = set(as23_checkpoints(steps))
        self.min_update_ratio = min_update_ratio
        self.prev_eta, self.prev_best, self.prev_checkpoint, self.n_updates = eta, clean_loss, 0, 0

    def extend(self, start: int, block: int, eta: float | None = None) -> None:
        """Continue for ``block`` more iterations after ``start``, with AS23's checkpoints of a ``block``-step run
        (and the step size back at ``eta`` when given: a small step cannot climb away from a slow region)."""
        self.checkpoints |= {start + c for c in as23_checkpoints(block)}
        if eta is not None:
            self.eta = self.prev_eta = eta

    def halve(self, k: int, best_loss: float) -> bool:
        """Record iteration ``k`` and say whether to halve the step and restart from the best point."""
        if k not in self.checkpoints:
            return False
        cond1 = self.n_updates < self.min_update_ratio * (k - self.prev_checkpoint)
        cond2 = self.prev_eta == self.eta and self.prev_best == best_loss
        self.prev_eta, self.prev_best, self.prev_checkpoint, self.n_updates = self.eta, best_loss, k, 0
        if cond1 or cond2:
            self.eta *= 0.5
            return True
        return False
