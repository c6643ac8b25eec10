"""Run settings shared by the suites, and the workload sizes of a full and a ``--quick`` run."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    """One measured configuration: model size key (``benchmarks.models.SIZES``), batch shape, solver steps."""

    size: str
    batch_size: int
    seq_len: int
    steps: int
    n_batches: int = 1


@dataclass(frozen=True)
class RunConfig:
    """What ``python -m benchmarks`` was asked for."""

    device: str
    quick: bool
    repeats: int
    rho: float = 0.1

    def pick(self, full, quick):
        """``quick`` under ``--quick``, else ``full``: each suite states both sizes next to each other."""
        return quick if self.quick else full
