"""Portable kernels: the same numbers on every x86-64 CPU.

A CPU's kernels round differently (ATen's AVX2 or AVX-512 paths, MKL's and oneDNN's own dispatch, the thread count).
A trained zoo and a worst case found by a solver are chaotic in those last bits: the same command on two machines
trained different weights, or ended at two stationary points 6.7 % apart. So the embedded default (the zoo's training
and ``geosharp demo``'s measurements) runs on the portable baseline below, in a process whose environment sets it
before torch loads: the same bits whatever the caller's instruction set and threads. :func:`run_portably` calls one
function so (the zoos' training), :func:`rerun_portably` a whole ``geosharp`` command.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import subprocess
import sys
import tempfile
from collections.abc import Generator, Iterator, Sequence
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

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


def kernels() -> dict[str, object]:
    """Which kernels this process computes with (recorded beside trained weights): torch's version, ATen's CPU
    capability and the thread count."""
    import torch

    return {"torch": torch.__version__, "cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "threads": torch.get_num_threads()}


def weights_digest(state: dict[str, Any]) -> str:
    """A short SHA-256 of the tensors' names, dtypes, shapes and bytes, in name order."""
    import torch

    h = hashlib.sha256()
    for name in sorted(state):
        t = state[name].detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()[:16]


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


def run_portably(target: str, payload: Any, *, path: tuple[str, ...] = ()) -> Generator[dict, None, None]:
    """Call ``target`` (``"module:function"``, given ``payload``) in a child process on :data:`PORTABLE_KERNELS`
    with one torch thread and oneDNN off, and yield what it passes to :func:`portable_result`. The environment is read
    by torch, MKL and oneDNN when they load, hence the child; it imports this very copy of the package, plus ``path``.
    An error or Ctrl-C of the consumer kills the child; a failed child raises with its last error lines."""
    module, function = target.split(":")
    roots = list(dict.fromkeys([str(Path(__file__).resolve().parents[1]), *path]))
    child_code = (f"import json, sys; sys.path[:0] = {roots!r}; import torch; torch.set_num_threads(1); "
                  "torch.backends.mkldnn.enabled = False; "  # oneDNN blocks by the CPU's cache sizes: other sums
                  f"from hf_geosharp.portable import _follow_parent; _follow_parent({os.getpid()}); "
                  f"from {module} import {function}; {function}(json.loads(sys.stdin.read()))")
    env = {**os.environ, **PORTABLE_KERNELS}
    with tempfile.TemporaryFile("w+") as errors, subprocess.Popen(
        [sys.executable, "-c", child_code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=errors, text=True,
        env=env,
    ) as child:
        assert child.stdin is not None and child.stdout is not None
        try:
            child.stdin.write(json.dumps(payload))
            child.stdin.close()
            for line in child.stdout:
                if line.startswith(_RESULT_LINE):
                    yield json.loads(line[len(_RESULT_LINE):])
                elif line.strip():
                    logger.debug("%s: %s", target, line.rstrip())
        except BaseException:  # the consumer stopped early (an error, Ctrl-C, a closed generator): no orphan
            _stop(child)
            raise
        if child.wait() != 0:
            errors.seek(0)
            raise RuntimeError(f"{target} failed in its portable child process (exit {child.returncode}):\n"
                               f"{errors.read().strip()[-4000:]}")


CHILD_GRACE_S = 10.0  # how long a child may take to clean up after SIGTERM before it is killed
_PARENT_POLL_S = 0.2


def _stop(child: subprocess.Popen) -> None:
    """End ``child``: SIGTERM (it exits through its ``finally`` blocks, removing its staging folder), SIGKILL after
    :data:`CHILD_GRACE_S`."""
    child.terminate()
    try:
        child.wait(CHILD_GRACE_S)
    except subprocess.TimeoutExpired:
        child.kill()
        child.wait()


def _follow_parent(parent: int) -> None:
    """The child's side of :func:`run_portably`: SIGTERM exits through the ``finally`` blocks (``SystemExit``), and
    a watcher thread sends it when the parent is gone (killed, even with SIGKILL: the child is then re-parented), so
    the child never outlives the process that waits for its results; if the exit hangs, it is forced."""
    import signal
    import threading
    import time

    def exit_cleanly(signum: int, frame: Any) -> None:
        raise SystemExit(128 + signum)

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(CHILD_GRACE_S)
        os._exit(128 + signal.SIGTERM)

    signal.signal(signal.SIGTERM, exit_cleanly)
    threading.Thread(target=watch, name="follow-parent", daemon=True).start()


_RESULT_LINE = "portable-result "  # marks the child's result lines among anything a library prints


def portable_result(result: dict) -> None:
    """Hand ``result`` to the parent of :func:`run_portably` (the child's side)."""
    print(_RESULT_LINE + json.dumps(result), flush=True)
