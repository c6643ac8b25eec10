"""Portable kernels: the same numbers on every x86-64 CPU.

A CPU's kernels round differently (ATen's AVX2 or AVX-512 paths, MKL's and oneDNN's own dispatch, the thread count).
A trained zoo and a worst case found by a solver are chaotic in those last bits: the same command on two machines
trained different weights, or ended at two stationary points 6.7 % apart. So the embedded default (the zoo's training
and ``geosharp demo``'s measurements) runs on the portable baseline below, in a process whose environment sets it
before torch loads: the same bits whatever the caller's instruction set and threads.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence

#: ATen's scalar baseline instead of its AVX2/AVX-512 kernels, MKL's conditional numerical reproducibility (identical
#: results whatever instructions the CPU has), oneDNN capped at SSE4.1 (which every x86-64 CPU of the last 15 years
#: has), one thread. Each of the four changes the trained zoo's weights when left out (measured on zoo-06); the
#: process also turns oneDNN off (:func:`portable_torch`), so convolutions run on ATen's own kernel and MKL.
PORTABLE_KERNELS = {
    "ATEN_CPU_CAPABILITY": "default",
    "MKL_CBWR": "COMPATIBLE",
    "ONEDNN_MAX_CPU_ISA": "SSE41",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
}


def on_portable_kernels() -> bool:
    """Whether this process started with :data:`PORTABLE_KERNELS` (torch reads them when it loads)."""
    return all(os.environ.get(name) == value for name, value in PORTABLE_KERNELS.items())


@contextlib.contextmanager
def portable_torch() -> Iterator[None]:
    """Inside the block, the torch setting of the portable baseline that no environment variable sets: oneDNN off
    (its convolution blocks by the CPU's cache sizes, whatever its instruction set); restored after."""
    import torch

    enabled = torch.backends.mkldnn.enabled
    torch.backends.mkldnn.enabled = False
    try:
        yield
    finally:
        torch.backends.mkldnn.enabled = enabled


def rerun_portably(argv: Sequence[str], own_process: bool = False) -> int:
    """Run ``geosharp argv`` again on :data:`PORTABLE_KERNELS` and return its exit code.

    In a process of its own (``own_process``: the ``geosharp`` script), the process becomes that command (``exec``):
    the same process, signals and children, with the kernels chosen before torch loads. Called from Python (a test,
    a notebook), it runs in a child process instead, whose standard output is printed here line by line (so that it
    reaches whatever reads this process's ``sys.stdout``) and whose standard error is this process's own; Ctrl-C
    reaches the child too (the same process group), which stops as the command does.

    Args:
        argv: the command line after ``geosharp``.
        own_process: whether this process runs nothing but this command.

    Returns:
        The child's exit code (``exec`` does not return).
    """
    env = {**os.environ, **PORTABLE_KERNELS}
    command = [sys.executable, "-m", "hf_geosharp", *argv]
    if own_process:
        sys.stdout.flush()
        sys.stderr.flush()
        os.execve(sys.executable, command, env)
    with subprocess.Popen(command, stdout=subprocess.PIPE, text=True, env=env) as child:
        assert child.stdout is not None
        try:
            for line in child.stdout:
                print(line, end="", flush=True)
        except KeyboardInterrupt:
            for line in child.stdout:  # the child handles its own Ctrl-C and says what it kept
                print(line, end="", flush=True)
        return child.wait()
