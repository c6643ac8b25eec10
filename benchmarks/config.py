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

    @property
    def label(self) -> str:
        """``size-BxS`` (``minilm-8x128``), what ``--only`` names."""
        return f"{self.size}-{self.batch_size}x{self.seq_len}"


@dataclass(frozen=True)
class RunConfig:
    """What ``python -m benchmarks`` was asked for."""

    device: str
    quick: bool
    repeats: int
    rho: float = 0.1
    #: Workload labels (:attr:`Workload.label`) to run; empty: all of the suite's.
    only: tuple[str, ...] = ()

    def pick(self, full, quick):
        """``quick`` under ``--quick``, else ``full``: each suite states both sizes next to each other."""
        return quick if self.quick else full

    def chosen(self, workloads: list[Workload]) -> list[Workload]:
        """The ``workloads`` that ``--only`` names (all without it)."""
        return [w for w in workloads if not self.only or w.label in self.only]
