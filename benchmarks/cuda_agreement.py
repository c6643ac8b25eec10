"""CPU against CUDA: the same worst-case numbers on both devices, and the model left as it was on each.

``python -m benchmarks.cuda_agreement [--out PATH]`` builds the same random MiniLM-shaped classifier and batches
(2 batches of 4 x 32 tokens) on the CPU and on the GPU, measures clean adaptive, geodesic inv and geodesic mix at
rho 0.1 with 10 steps and with ``steps="auto"``, and writes each value, ``converged``, ``steps_used``, the relative
difference between the devices and whether the model's state is bit-equal after the calls
(``benchmarks/results/cuda_agreement.json``). A check of the GPU path, not a timing: the seconds are one run each.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

import hf_geosharp as gs
from hf_geosharp.durable import write_json
from hf_geosharp.symmetry import map_symmetries

from .common import solve
from .models import MINILM, bert_batches, bert_classifier

MEASURES = ("adaptive_clean", "geodesic_inv", "geodesic_mix")


def run() -> dict[str, Any]:
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda, "gs": gs.__version__}
    for steps in (10, "auto"):
        for device in ("cpu", "cuda"):
            model = bert_classifier(MINILM, device=device)
            batches = bert_batches(model, n_batches=2, batch_size=4, seq_len=32)
            smap = map_symmetries(model)
            before = {k: v.clone() for k, v in model.state_dict().items()}
            for name in MEASURES:
                start = time.perf_counter()
                r = solve(name, model, batches, smap, steps, rho=0.1)
                if device == "cuda":
                    torch.cuda.synchronize()
                out.setdefault(f"{name} steps={steps}", {})[device] = {
                    "value": r.value, "per_batch": r.per_batch, "gap": r.stationarity_gap, "converged": r.converged,
                    "steps_used": r.steps_used, "seconds": time.perf_counter() - start}
            after = model.state_dict()
            out[f"state_unchanged {device} steps={steps}"] = all(torch.equal(before[k], after[k]) for k in before)
    for key, v in out.items():
        if isinstance(v, dict) and "cpu" in v and "cuda" in v:
            cpu, cuda = v["cpu"]["value"], v["cuda"]["value"]
            v["relative_difference"] = abs(cpu - cuda) / abs(cpu)
            print(f"{key}: cpu {cpu:.6g} cuda {cuda:.6g} relative difference {v['relative_difference']:.2e}")
    return out


def main(argv: list[str] | None = None) -> None:
    from hf_geosharp.commands.common import Parser, file_path

    parser = Parser(prog="python -m benchmarks.cuda_agreement", description=__doc__)
    parser.add_argument("--out", type=file_path, default=Path(__file__).parent / "results" / "cuda_agreement.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("torch sees no CUDA device: this check compares the CPU with one")
    write_json(args.out, run(), indent=1)  # durable: an interrupted write keeps the previous results


if __name__ == "__main__":
    main()
