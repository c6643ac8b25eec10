"""Which form a step's device-side operations take on a device.

A GPU's step stays on the device in a fixed number of kernels: the host never reads a value inside it, and one
batched operation serves every block of a vector. Where the host is the device (a CPU), a read is a load from
memory and a kernel costs no launch, so a few operations take a cheaper form there: a mask read on the host
(:class:`~hf_geosharp.engine.solvers.device_climb.HostMasks`), products with the solver's rows as one
matrix-vector product per block (:func:`~hf_geosharp.engine.geometry.elementwise.blocked_products`). Within
:func:`gpu_paths` every device takes the GPU's forms: how a CPU counts the kernels and syncs of a GPU's step (the
launch suite, the tests of the device step).
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator

import torch

#: The device types whose host is the device: there a step may read values and issue a kernel per block.
HOST_DEVICES = frozenset({"cpu"})
_gpu_paths_only: contextvars.ContextVar[bool] = contextvars.ContextVar("gpu_paths_only", default=False)


def host_paths(device: torch.device) -> bool:
    """Whether a step on ``device`` takes the host's forms (a CPU, outside :func:`gpu_paths`)."""
    return device.type in HOST_DEVICES and not _gpu_paths_only.get()


@contextlib.contextmanager
def gpu_paths() -> Iterator[None]:
    """Within it, every device takes the GPU's forms of a step's operations (per context: thread-safe)."""
    token = _gpu_paths_only.set(True)
    try:
        yield
    finally:
        _gpu_paths_only.reset(token)
