"""The processes of one measurement under a launcher: data parallel through ``accelerate``, or FSDP2-sharded
(``--fsdp``, ``fsdp=True``); and what the launcher was asked for.

Data parallel: every process holds the whole model and the engine shares the batches out. Sharded (``torchrun ...
-m hf_geosharp run --fsdp``, or ``accelerate launch`` with an FSDP config such as ``examples/accelerate_fsdp2.yaml``):
every rank loads the model and all batches, maps the symmetries on the unsharded model, shards it with
:func:`hf_geosharp.engine.placement.sharding.shard_model` and solves every batch together with the other ranks, each
holding its shard of the weights and of the solver's state. Rank 0 prints and writes; every rank exits with the same
code.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from ..data import DataError, launch_accelerator
from ..engine.placement.sharding import init_distributed

logger = logging.getLogger(__name__)

FSDP_LAUNCH = "torchrun --nproc_per_node N -m hf_geosharp run --fsdp ..."


@dataclass(frozen=True)
class Launch:
    """The processes of one run. ``accelerator``: data parallel (else ``None``); ``fsdp``: the model is sharded over
    ``world`` ranks on ``device`` (this rank's)."""

    accelerator: Any = None
    fsdp: bool = False
    rank: int = 0
    world: int = 1
    device: torch.device | None = None

    @property
    def main(self) -> bool:
        """Whether this is the process that prints and writes (rank 0)."""
        return self.rank == 0

    @contextlib.contextmanager
    def main_first(self) -> Iterator[None]:
        """Rank 0 runs the body first (it fills the datasets cache), the others then read what it left."""
        if self.accelerator is not None:
            with self.accelerator.main_process_first():
                yield
            return
        if self.fsdp and not self.main:
            dist.barrier()
        yield
        if self.fsdp and self.main:
            dist.barrier()

    def agree(self, code: int) -> int:
        """Under FSDP, the highest of every rank's exit codes, on every rank: one rank that cannot go on (an
        unwritable results file on rank 0) stops them all, instead of leaving the others waiting in a collective."""
        if not self.fsdp:
            return code
        codes: list[Any] = [None] * self.world
        dist.all_gather_object(codes, code)
        return max(codes)

    def close(self) -> None:
        """Leave the process group this launch joined (a clean exit; gloo's threads can abort a shutdown that
        finds them still running)."""
        if self.fsdp and dist.is_initialized():
            dist.barrier()
            dist.destroy_process_group()

    def exit(self, code: int) -> int:
        """``code``, returned; under FSDP the process ends here, with ``code``, after flushing the logs and the
        console. gloo's worker threads can still abort the interpreter's own shutdown (SIGABRT, "terminate called
        without an active exception", under load) after every result is written; skipping that shutdown keeps the
        exit code the one the run earned. Files are already durable (fsync, atomic rename)."""
        if self.fsdp:
            logging.shutdown()
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
        return code


def accelerate_fsdp() -> bool:
    """Whether ``accelerate launch`` was given an FSDP config (it says so in the environment of every process)."""
    return os.environ.get("ACCELERATE_USE_FSDP", "").lower() in ("1", "true")


def start(fsdp: bool) -> Launch:
    """The launch this process belongs to; with ``fsdp`` a ``DataError`` when no distributed launcher started it."""
    if not (fsdp or accelerate_fsdp()):
        accelerator = launch_accelerator()
        if accelerator is None:
            return Launch()
        return Launch(accelerator, rank=accelerator.process_index, world=accelerator.num_processes)
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        raise DataError(f"--fsdp shards the model over the processes of a distributed launch, and none was found "
                        f"(RANK/WORLD_SIZE are not set); start it with {FSDP_LAUNCH}")  # fmt: skip
    device = init_distributed()
    if not fsdp:
        logger.info("accelerate launch with an FSDP config: the model is sharded as with --fsdp")
    return Launch(fsdp=True, rank=dist.get_rank(), world=dist.get_world_size(), device=device)


def asked_processes(environ: dict[str, str], parent_cmdline: list[str] | None) -> int | None:
    """How many processes the launcher was asked for: ``WORLD_SIZE``, or ``accelerate launch --num_processes N``
    read from the parent's command line (accelerate's single-process launcher does not export it)."""
    if "WORLD_SIZE" in environ:
        return int(environ["WORLD_SIZE"])
    if not any(k.startswith("ACCELERATE_") for k in environ) or not parent_cmdline:
        return None
    for i, arg in enumerate(parent_cmdline):
        flag, _, value = arg.partition("=")
        if flag in ("--num_processes", "--num-processes") and (value or i + 1 < len(parent_cmdline)):
            text = value or parent_cmdline[i + 1]
            return int(text) if text.isdigit() else None
    return None


def parent_cmdline() -> list[str] | None:
    """The parent process's command line (the launcher's), or ``None`` where it cannot be read (not Linux)."""
    try:
        raw = Path(f"/proc/{os.getppid()}/cmdline").read_bytes()
    except OSError:  # not Linux, or not readable: no check
        return None
    return [a.decode(errors="replace") for a in raw.split(b"\0") if a]


def launch_warning(started: int) -> str | None:
    """A warning when a launcher was asked for more processes than started (e.g. ``accelerate launch --cpu
    --num_processes 2`` starts one)."""
    asked = asked_processes(dict(os.environ), parent_cmdline())
    if asked is None or asked <= started:
        return None
    return (
        f"the launcher was asked for {asked} processes but {started} started, so the batches are not shared out. "
        "accelerate starts several CPU processes only with --multi_gpu (accelerate launch --multi_gpu "
        f"--num_processes {asked} ...), or use torchrun --nproc_per_node {asked}."
    )
