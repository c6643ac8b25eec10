"""Memory suite: peak memory of a solver run / peak of a plain forward+backward on the same model and batch.

Target (docs/benchmarks.md): <= 1.5. Each case runs in a fresh subprocess so that no allocator cache or old peak leaks
from one case into the next. On CUDA the peak is ``torch.cuda.max_memory_allocated``; on the CPU it is the process's
peak resident set size (``VmHWM``, reset right before the measured call), with glibc's ``mmap`` threshold fixed
(:data:`benchmarks.common.LIVE_MMAP_THRESHOLD`) so that it follows the live tensors like CUDA's counter, rather than
what glibc's heap keeps after tensors are freed (that part depends on the batch and on allocation order, not on the
solver: at MiniLM 16 x 128 it was 40-90 MiB per case).
Two numbers per case:

* ``footprint``: peak minus the process's memory before the model was built, i.e. model, batch, symmetry map and the
  workload together (what a user needs to run it);
* ``workload``: peak minus the memory right before the measured call (model, batch and map already there).

The ratio against the target is taken on footprints, like for like: a plain forward+backward needs the model too.
``solver_bytes_per_param`` (target <= 16) is (peak of the solve - peak of a plain forward+backward on the same batch) /
perturbed parameters, the peaks taken as footprints so that each process's own baseline (imports) cancels; the
measurement perturbs every parameter of these models (none is zero or frozen), so the count is the model's.
``solver_bytes_per_held_coordinate`` divides by what the solver's vectors hold instead: the zero-start solvers leave
out the embedding rows that no batch looks up (their perturbation is exactly zero, see ``docs/scaling.md``), AS23's
holds every parameter.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from typing import Any

import torch

from .common import live_memory_env
from .config import RunConfig, Workload

TARGET = 1.5
#: Target for ``solver_bytes_per_param``.
BYTES_TARGET = 16.0
#: ``pipeline_mix``: geodesic mix through the pipeline under the CLI, the evaluate module and the Trainer callback
#: (``prepare`` maps the model for its report and note, then the measure runs), which must hold no map of its own.
CASES = ("forward_backward", "adaptive_clean", "adaptive_as23", "geodesic_inv", "geodesic_mix", "pipeline_mix")


def workloads(cfg: RunConfig) -> list[Workload]:
    return cfg.pick(
        [Workload("minilm", 16, 128, 20), Workload("minilm", 64, 128, 20), Workload("base", 16, 128, 20)],
        [Workload("minilm", 8, 64, 6), Workload("base", 8, 64, 6)],
    )


def _measure(case: str, w: Workload, device: str, rho: float) -> dict[str, int]:
    """One case in this (fresh) process; returns bytes."""
    import hf_geosharp as gs

    from .common import forward_backward, peak_rss_bytes, reset_peak_rss, rss_bytes
    from .models import SIZES, bert_batches, bert_classifier

    cuda = device.startswith("cuda")
    now = (lambda: torch.cuda.memory_allocated()) if cuda else rss_bytes
    baseline = now()
    model = bert_classifier(SIZES[w.size], device=device)
    batches = bert_batches(model, n_batches=w.n_batches, batch_size=w.batch_size, seq_len=w.seq_len)
    before = now()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    else:
        reset_peak_rss()
    kw = dict(rho=rho, steps=w.steps, progress=False)
    if case == "forward_backward":
        forward_backward(model, batches[0])
    elif case.startswith("adaptive"):
        gs.adaptive_sharpness(model, batches, variant=case.split("_")[1], **kw)
    elif case == "pipeline_mix":
        from hf_geosharp.measures import Settings
        from hf_geosharp.pipeline import Request, prepare

        prepare(Request(model, batches, ["mix"], Settings(rho=rho, steps=w.steps), map_always=True)).measure()
    else:
        # the default call: the symmetry map is built inside and dropped once the space has read it
        gs.geodesic_sharpness(model, batches, metric=case.split("_")[1], **kw)
    peak = torch.cuda.max_memory_allocated() if cuda else peak_rss_bytes()
    n_params = sum(p.numel() for p in model.parameters())
    return {"baseline": baseline, "before_call": before, "peak": peak,
            "footprint": peak - baseline, "workload": peak - before, "n_params": n_params,
            "held": n_params - _left_out(model, batches) if case == "forward_backward" else None}


def _left_out(model: torch.nn.Module, batches: list) -> int:
    """Embedding entries that the zero-start solvers do not hold (rows no batch looks up), counted after the peak."""
    from hf_geosharp.engine.model_function.embedding_rows import scan_used_rows
    from hf_geosharp.engine.model_function.objective import default_loss

    params = list(model.parameters())
    used = scan_used_rows(dict(enumerate(params)), lambda: [default_loss(model, b) for b in batches])
    return sum((params[i].shape[0] - u.rows.numel()) * params[i].shape[1] for i, u in used.items())


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    for w in cfg.chosen(workloads(cfg)):
        cases = {}
        for case in CASES:
            args = [sys.executable, "-m", "benchmarks.memory", "--case", case, "--device", cfg.device,
                    "--rho", str(cfg.rho), "--threads", str(torch.get_num_threads()), "--workload", json.dumps(vars(w))]
            env = {**os.environ, **live_memory_env(cfg.device)}
            out = subprocess.run(args, capture_output=True, text=True, check=True, env=env)
            cases[case] = json.loads(out.stdout.strip().splitlines()[-1])
        plain = cases["forward_backward"]
        n_params, held = plain["n_params"], plain["held"]
        extra = {c: cases[c]["footprint"] - plain["footprint"] for c in CASES[1:]}
        rows.append({
            "model": w.size,
            "workload": vars(w),
            "perturbed_params": n_params,
            "held_coordinates": held,
            "bytes": cases,
            "solver_bytes_per_param": {c: extra[c] / n_params for c in CASES[1:]},
            "solver_bytes_per_held_coordinate": {c: extra[c] / (n_params if c == "adaptive_as23" else held)
                                                 for c in CASES[1:]},
            "ratio_footprint": {c: cases[c]["footprint"] / plain["footprint"] for c in CASES[1:]},
            "ratio_workload": {c: cases[c]["workload"] / plain["workload"] for c in CASES[1:]},
        })
    return {"suite": "memory", "target": {"footprint_ratio": TARGET, "solver_bytes_per_param": BYTES_TARGET},
            "rows": rows}


def table(result: dict[str, Any]) -> str:
    mib = 2.0**20
    lines = [
        "| model | batch x seq | case | footprint MiB | workload MiB | footprint / plain | workload / plain "
        "| solver bytes / param | per held coordinate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in result["rows"]:
        w = r["workload"]
        for case, b in r["bytes"].items():
            ratio, wr = r["ratio_footprint"].get(case), r["ratio_workload"].get(case)
            per_param = r["solver_bytes_per_param"].get(case)
            extra = "" if per_param is None else _mark(per_param, BYTES_TARGET, 1)
            held = r["solver_bytes_per_held_coordinate"].get(case)
            lines.append(
                f"| {r['model']} | {w['batch_size']}x{w['seq_len']} | {case} | {b['footprint'] / mib:.0f} | "
                f"{b['workload'] / mib:.0f} | {'1 (reference)' if ratio is None else _mark(ratio, TARGET, 2)} | "
                f"{'' if wr is None else f'{wr:.2f}'} | {extra} | {'' if held is None else f'{held:.1f}'} |"
            )
        lines.append(f"| {r['model']} | | held coordinates: {r['held_coordinates']:,} of {r['perturbed_params']:,} "
                     "(AS23: all) | | | | | | |")
    lines.append(f"\nEach case in a fresh process; targets: footprint / plain forward+backward <= {TARGET}, "
                 f"(solve peak - plain peak) / perturbed parameters <= {BYTES_TARGET:.0f} bytes.")
    return "\n".join(lines)


def _mark(value: float, target: float, digits: int) -> str:
    return f"{value:.{digits}f} {'ok' if value <= target else 'MISS'}"


def main() -> None:
    parser = argparse.ArgumentParser(description="Measure one memory case (internal to `python -m benchmarks`).")
    parser.add_argument("--case", choices=CASES, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rho", type=float, default=0.1)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--workload", required=True)
    args = parser.parse_args()
    env = live_memory_env(args.device)
    if any(os.environ.get(k) != v for k, v in env.items()):  # glibc reads it at start: run again with it
        os.execve(sys.executable, [sys.executable, "-m", "benchmarks.memory", *sys.argv[1:]], {**os.environ, **env})
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps(_measure(args.case, Workload(**json.loads(args.workload)), args.device, args.rho)))


if __name__ == "__main__":
    main()
