"""Timing, memory and machine-description helpers shared by the suites.

Why the care: the benchmarks run on shared 2-core CPUs as well as on GPUs. Every timing is repeated and the variants
are interleaved round-robin, so that a burst of load from a neighbour hits all of them alike. The reported time is the
*minimum* over the repeats: load from other processes only ever adds time, so the minimum is the best estimate of
the cost itself (every sample is kept in the JSON). On the CPU both wall time and process CPU time are recorded; CPU
time does not count the time a thread waits for a core, but it does count OpenMP threads spinning while they wait
for each other, so on a busy machine neither is clean, and the tables say which basis they use.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch

import hf_geosharp as gs
from hf_geosharp import __version__


@dataclass
class Timing:
    """Minimum wall-clock and process-CPU seconds over ``repeats`` runs, plus every sample."""

    wall: float
    cpu: float
    walls: list[float]
    cpus: list[float]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def synchronize(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def time_once(fn: Callable[[], Any], device: str) -> tuple[Any, float, float]:
    """Run ``fn`` once; return its result, wall seconds and process CPU seconds (device work included via sync)."""
    synchronize(device)
    w0, c0 = time.perf_counter(), time.process_time()
    result = fn()
    synchronize(device)
    return result, time.perf_counter() - w0, time.process_time() - c0


def interleaved(
    cases: dict[str, Callable[[], Any]], repeats: int, device: str, warmup: Callable[[], Any] | None = None
) -> tuple[dict[str, Timing], dict[str, Any]]:
    """Time every case ``repeats`` times, round-robin, after ``warmup`` (lazy init, kernel selection); minima per case.

    A solver run allocates its buffers afresh on every call, so one cheap warm-up call is enough; the cases are not
    warmed up individually, which would double the cost of the slow ones."""
    if warmup is not None:
        warmup()
    results: dict[str, Any] = {}
    walls: dict[str, list[float]] = {name: [] for name in cases}
    cpus: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(repeats):
        for name, fn in cases.items():
            results[name], wall, cpu = time_once(fn, device)
            walls[name].append(wall)
            cpus[name].append(cpu)
    timings = {
        name: Timing(min(walls[name]), min(cpus[name]), walls[name], cpus[name])
        for name in cases
    }
    return timings, results


def forward_backward(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> float:
    """One plain training-style forward+backward (the physical floor of a solver step); grads are dropped."""
    loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return float(loss.detach())


def solve(measure: str, model: torch.nn.Module, batches: list, smap: Any, steps: int | str,
          rho: float) -> gs.SharpnessResult:
    """One worst-case solve of ``measure`` (``adaptive_clean``, ``geodesic_inv``, ``geodesic_mix``), no progress bar."""
    kw = dict(rho=rho, steps=steps, progress=False)
    if measure == "adaptive_clean":
        return gs.adaptive_sharpness(model, batches, variant="clean", **kw)
    return gs.geodesic_sharpness(model, batches, metric=measure.split("_")[1], symmetry_map=smap, **kw)


def machine(device: str) -> dict[str, Any]:
    """What the numbers were measured on, written into every JSON file."""
    info: dict[str, Any] = {
        "device": device,
        "hf_geosharp": __version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
    }
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover - transformers is a dependency
        pass
    if device.startswith("cuda"):
        props = torch.cuda.get_device_properties(torch.device(device))
        info["gpu"] = props.name
        info["gpu_memory_gib"] = round(props.total_memory / 2**30, 1)
        info["cuda"] = torch.version.cuda
    return info


def load_average() -> list[float] | None:
    """The machine's 1, 5 and 15 minute load averages (None where the platform has none)."""
    return list(os.getloadavg()) if hasattr(os, "getloadavg") else None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


#: glibc's ``mmap`` threshold for the memory suites' CPU processes (bytes). With it fixed, every block of 128 KiB or
#: more is mapped on its own and unmapped when freed, so the resident set follows the live tensors, as
#: ``torch.cuda.max_memory_allocated`` does on CUDA. glibc's default threshold grows up to 32 MiB as large blocks
#: are freed, after which freed tensors stay in the heap and the peak also counts what the allocator kept.
LIVE_MMAP_THRESHOLD = 128 * 1024


def live_memory_env(device: str) -> dict[str, str]:
    """Environment for a measured subprocess: on the CPU, resident memory that follows the live tensors."""
    return {} if device.startswith("cuda") else {"MALLOC_MMAP_THRESHOLD_": str(LIVE_MMAP_THRESHOLD)}


def rss_bytes() -> int:
    """Current resident set size of this process (Linux ``/proc``)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def reset_peak_rss() -> None:
    """Start a new peak: writing 5 to ``clear_refs`` resets the kernel's high-water mark ``VmHWM`` (Linux >= 4.0).

    Without it the peak would be that of the imports (transformers, evaluate), which can exceed a small workload's."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def peak_rss_bytes() -> int:
    """Peak resident set size since the last :func:`reset_peak_rss` (``VmHWM`` of ``/proc/self/status``)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc/self/status")
