"""``python -m benchmarks.gpu``: the GPU run, at most 8 minutes: the launch, floor and overhead suites on the device,
and a Llama-shaped decoder of 1.24 B parameters in bfloat16.

Each part runs in a subprocess under a wall-clock cap (:data:`CAPS`, each cut to what the total budget has left), so
that a slow part costs its cap and the rest still run; a part that runs out is recorded as such. The suites write
``<suite>-<device>.json`` as ``python -m benchmarks`` does; the decoder writes ``llama-<device>.json`` and the run
``gpu-<device>.json`` (what ran, its exit status and seconds).

The decoder has Llama 3.2 1B's shape (hidden 2048, 16 layers, 32 query and 8 key-value heads, MLP 8192, vocabulary
128256, tied embeddings), random init, in bfloat16, with the causal-LM loss on 4 x 512 random tokens. Per measure
(clean adaptive, geodesic inv): the step time (a ``LONG``-step solve minus a ``SHORT``-step one, per step, so that
building the space cancels), against the floor, one forward+backward; the whole ``LONG``-step solve against
``(LONG + 1)`` forward+backward passes; and the solver's bytes per parameter, ``(peak of the solve - peak of a plain
forward+backward) / parameters`` (``torch.cuda.max_memory_allocated``; on the CPU not measured).

``--parts capture`` runs the capture suite (eager against CUDA graphs) on its own: its first captured solves compile
for longer than the default run leaves (:data:`EXTRA_CAPS`).

``--tiny`` runs the same path on tiny shapes (2-layer models, a few tokens) on the CPU in seconds per part.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from hf_geosharp.commands.common import Parser, folder_path, positive
from hf_geosharp.durable import write_json

RESULTS = Path(__file__).parent / "results"
#: Wall-clock cap of each part in seconds (a fresh process each: imports, model build and warm-up included).
#: In order of what the run is for: the overhead suite holds the targets' workloads (MiniLM 32 x 128, BERT-base
#: 16 x 128), then the decoder; the launch suite counts (the same on every machine) come last.
CAPS = {"overhead": 100.0, "llama": 150.0, "floor": 100.0, "launch": 110.0}
#: Parts run only when named (``--parts capture``, e.g. as a second call on the same machine): the capture suite's
#: first captured solves compile their graphs, minutes that the default run's budget has no room for.
EXTRA_CAPS = {"capture": 240.0}
#: The whole run's budget (seconds), and what is kept back from it for starting each part.
BUDGET, RESERVE = 480.0, 5.0
#: The decoder's steps: the per-step time is (LONG-step solve - SHORT-step solve) / (LONG - SHORT).
SHORT, LONG = 2, 8
MEASURES = ("adaptive_clean", "geodesic_inv")


def llama_config(tiny: bool) -> Any:
    """Llama 3.2 1B's shape (``tiny``: 2 layers of 64)."""
    from transformers import LlamaConfig

    if tiny:
        return LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=64,
                           tie_word_embeddings=True)
    return LlamaConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                       num_key_value_heads=8, vocab_size=128256, max_position_embeddings=4096,
                       tie_word_embeddings=True, rope_theta=500000.0)


def llama_inputs(tiny: bool, device: str) -> tuple[torch.nn.Module, list[dict[str, torch.Tensor]]]:
    """The decoder (random init, bfloat16, eval mode) and one batch of random tokens, its labels the tokens."""
    from transformers import LlamaForCausalLM

    config = llama_config(tiny)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(torch.bfloat16).eval()
    rows, length = (2, 16) if tiny else (4, 512)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, config.vocab_size, (rows, length), generator=g).to(device)
    return model, [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}]


def _peak(fn: Any, device: str) -> tuple[Any, float, int | None]:
    """``fn()``, its wall seconds (device work included) and the peak of allocated device memory during it."""
    from .common import time_once

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    result, wall, _ = time_once(fn, device)
    return result, wall, torch.cuda.max_memory_allocated() if cuda else None


def run_llama(device: str, tiny: bool, out: Path | None = None) -> dict[str, Any]:
    """The decoder's step times against its floor and the solver's bytes per parameter (module docstring); written
    to ``out`` after each measure when given."""
    import hf_geosharp as gs
    from hf_geosharp.symmetry import map_symmetries

    from .common import forward_backward, machine, solve

    warnings.simplefilter("ignore", gs.NotConvergedWarning)  # each measure records its certificate
    warnings.filterwarnings("ignore", "The model computes in")  # bfloat16 at rho 0.1: the JSON says what it measures
    short_steps, long_steps = (1, 3) if tiny else (SHORT, LONG)
    start = time.time()
    model, batches = llama_inputs(tiny, device)
    n_params = sum(p.numel() for p in model.parameters())
    built = time.time() - start
    smap = map_symmetries(model)
    mapped = time.time() - start - built
    forward_backward(model, batches[0])  # warm-up: kernel selection, allocator
    fb = [_peak(lambda: forward_backward(model, batches[0]), device) for _ in range(3)]
    fb_wall, fb_peak = min(f[1] for f in fb), fb[-1][2]
    measures: dict[str, Any] = {}
    result = {
        "suite": "llama", "tiny": tiny, "dtype": "bfloat16", "n_params": n_params,
        "config": {k: v for k, v in llama_config(tiny).to_dict().items() if isinstance(v, (int, float, str, bool))},
        "tokens": list(batches[0]["input_ids"].shape), "steps": [short_steps, long_steps], "rho": 0.1,
        "symmetry_blocks": len(smap.blocks), "build_s": built, "map_s": mapped,
        "forward_backward_s": fb_wall, "forward_backward_peak_bytes": fb_peak, "measures": measures,
        "machine": machine(device),
    }
    for measure in MEASURES:
        def solved(steps: int, measure: str = measure) -> gs.SharpnessResult:
            return solve(measure, model, batches, smap, steps, 0.1)

        solved(1)  # warm-up of this measure's kernels
        short, t_short, _ = _peak(lambda: solved(short_steps), device)
        long, t_long, peak = _peak(lambda: solved(long_steps), device)
        step = (t_long - t_short) / (long_steps - short_steps)
        measures[measure] = {
            "seconds": {f"{short_steps}_steps": t_short, f"{long_steps}_steps": t_long},
            "step_s": step,
            "step_over_floor": step / fb_wall,
            "solve_over_floor": t_long / ((long_steps + 1) * fb_wall),
            "value": long.value,
            "certificate": long.certificate,
            "convergence_note": long.convergence_note,
            "peak_bytes": peak,
            "solver_bytes_per_param": None if peak is None or fb_peak is None else (peak - fb_peak) / n_params,
        }
        if out is not None:  # what is measured so far survives a part that runs past its cap
            write_json(out, result, indent=1)
    clean, inv = (measures[m]["step_s"] for m in MEASURES)
    result["inv_step_over_clean_step"] = inv / clean if clean > 0 else None
    return result


def llama_table(result: dict[str, Any]) -> str:
    lines = [f"decoder {result['n_params'] / 1e9:.2f} B parameters, bfloat16, {result['tokens'][0]} x "
             f"{result['tokens'][1]} tokens; forward+backward {1e3 * result['forward_backward_s']:.1f} ms",
             "| measure | step ms | step / floor | solve / floor | solver bytes / param |", "|---|---|---|---|---|"]
    for name, m in result["measures"].items():
        per = m["solver_bytes_per_param"]
        lines.append(f"| {name} | {1e3 * m['step_s']:.1f} | {m['step_over_floor']:.2f} | "
                     f"{m['solve_over_floor']:.2f} | {'-' if per is None else f'{per:.1f}'} |")
    return "\n".join(lines)


def _tiny_suites() -> None:
    """Shrink the suites' workloads to 2-layer models and a few tokens (``--tiny``): the same code, in seconds."""
    from . import capture, floor, launch, models, overhead
    from .config import Workload

    tiny = models.ModelSize("tiny-2x32x4", 2, 32, 4)
    models.SIZES["tiny"] = tiny
    launch.SHAPES[:] = [tiny, models.ModelSize("tiny-4x32x4", 4, 32, 4)]
    floor.workloads = overhead.workloads = capture.workloads = lambda cfg: [Workload("tiny", 2, 8, 2)]
    choice = capture.capture_choice  # on a CPU the eager kernels through the capture path: no minutes of compiling
    capture.capture_choice = lambda device: "aot_eager" if device == "cpu" else choice(device)


def run_part(part: str, device: str, out: Path, tiny: bool) -> None:
    """One part, in this process (the child's side of :func:`main`)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if part == "llama":
        start = time.time()
        path = out / f"llama-{device.split(':')[0]}.json"
        result = run_llama(device, tiny, path)
        result.update(seconds=round(time.time() - start, 1), date=time.strftime("%Y-%m-%d %H:%M:%S"))
        write_json(path, result, indent=1)
        print(llama_table(result))
        print(f"\n[llama: {result['seconds']} s -> {path}]", flush=True)
        return
    from .__main__ import main as suites

    if tiny:
        _tiny_suites()
    suites(["--suite", part, "--device", device, "--out", str(out), "--repeats", "1" if tiny else "2"])


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m benchmarks.gpu", description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (cuda:N), or cpu with --tiny")
    parser.add_argument("--out", type=folder_path, default=RESULTS, help="folder for the JSON results")
    parser.add_argument("--parts", default=",".join(CAPS),
                        help=f"comma-separated, from {','.join(CAPS)} (the default run) and {','.join(EXTRA_CAPS)}")
    parser.add_argument("--budget", type=positive(float), default=BUDGET, help="seconds for the whole run")
    parser.add_argument("--tiny", action="store_true", help="tiny shapes: the whole path on the CPU in seconds")
    parser.add_argument("--part", default=None, help=argparse_hidden())
    args = parser.parse_args(argv)
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but torch sees no CUDA device (pass --device cpu --tiny)")
    parts = [p.strip() for p in args.parts.split(",") if p.strip()]
    caps = {**CAPS, **EXTRA_CAPS}
    unknown = [p for p in parts if p not in caps]
    if unknown:
        parser.error(f"unknown part(s) {unknown}; choose from {list(caps)}")
    args.out.mkdir(parents=True, exist_ok=True)
    if args.part is not None:
        run_part(args.part, args.device, args.out, args.tiny)
        return
    began, record = time.time(), []
    for part in parts:
        left = args.budget - (time.time() - began) - RESERVE
        cap = min(caps[part], left)
        if cap <= 0:
            record.append({"part": part, "status": "skipped", "why": "the budget ran out", "seconds": 0.0})
            continue
        command = [sys.executable, "-m", "benchmarks.gpu", "--part", part, "--device", args.device,
                   "--out", str(args.out), *(["--tiny"] if args.tiny else [])]
        start = time.time()
        try:
            rc = subprocess.run(command, timeout=cap, cwd=Path(__file__).parent.parent).returncode
            status = "ok" if rc == 0 else f"failed (exit {rc})"
        except subprocess.TimeoutExpired:
            status = f"ran past its cap of {cap:.0f} s"
        record.append({"part": part, "status": status, "cap_s": round(cap, 1),
                       "seconds": round(time.time() - start, 1)})
        print(f"[{part}: {status}, {record[-1]['seconds']} s]", flush=True)
    summary = {"suite": "gpu", "tiny": args.tiny, "device": args.device, "budget_s": args.budget, "parts": record,
               "seconds": round(time.time() - began, 1), "date": time.strftime("%Y-%m-%d %H:%M:%S")}
    write_json(args.out / f"gpu-{args.device.split(':')[0]}.json", summary, indent=1)
    print(json.dumps(summary["parts"], indent=1))
    if any(r["status"] != "ok" for r in record):
        sys.exit(1)


def argparse_hidden() -> str:
    """Help text of the child's ``--part`` option: hidden from ``--help``."""
    import argparse

    return argparse.SUPPRESS


if __name__ == "__main__":
    main()
