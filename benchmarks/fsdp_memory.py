"""FSDP memory suite: per-rank solver memory of an FSDP2-sharded model against the single-process solver / ranks.

Per model size and number of ranks ``N`` (1, 2, 4; ``N = 1`` also through FSDP) one ``torchrun --standalone`` launch;
every rank builds the same seeded model, maps its symmetries unsharded, shards it with ``shard_model`` and, with its own
share of one batch (what a sharded data loader gives it), measures in turn the peak memory of

* a plain forward+backward of the sharded model on that share (the floor);
* ``geodesic_sharpness`` (inv, worst case) and ``adaptive_sharpness`` (clean, worst case) on the same share.

``solver bytes = peak(solve) - peak(plain)`` is what the measurement adds on that rank: its share of the four solver
vectors, of the perturbed weights and of the pairs' state. The target's reference is the same worker in one plain
process without FSDP: per-rank solver bytes <= 1.2 x (that process's solver bytes / N)
(``ratio_to_single_over_ranks``). The same worker in one process through FSDP (``N = 1``) is reported next to it
(``ratio_to_one_fsdp_rank_over_ranks``): it holds what N ranks hold together, and a little more than the plain
process, since only the unsharded path reads the pairs' base point from the weights (``docs/scaling.md``). The solves
run the default 20 steps, so that all four solver vectors are written (pages never written are not resident).
The placement is ``Shard(1)`` on the q/k/v weights (every attention row owned by one rank, no replicated "shared
rows"); one case also runs FSDP's default ``Shard(0)``, where heads cut by a shard boundary are assembled on every rank.

The peak is ``VmHWM`` (reset right before each call) on the CPU, ``torch.cuda.max_memory_allocated`` on CUDA (NCCL,
one device per rank, as ``shard_model`` picks). Every rank runs one thread. On the CPU the workers run with glibc's
``MALLOC_MMAP_THRESHOLD_`` fixed at 128 KiB: every tensor's pages go back to the operating system when it is freed, so
the resident set follows the live tensors and the three calls, taken one after the other in one process, do not
inherit each other's allocator cache. With glibc's default (a threshold that grows up to 32 MiB) two ranks holding
identical shards differed by 70 MiB of solver bytes at MiniLM 8 x 64; with it they agree to 1 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from .common import live_memory_env
from .config import RunConfig, Workload

TARGET = 1.2
RANKS = (1, 2, 4)
MEASURES = ("geodesic_inv_worst", "adaptive_clean_worst")
ROOT = Path(__file__).resolve().parent.parent


def workloads(cfg: RunConfig) -> list[Workload]:
    return cfg.pick(
        [Workload("minilm", 16, 128, 20), Workload("base", 16, 128, 20)],
        [Workload("minilm", 8, 64, 20), Workload("base", 8, 64, 20)],
    )


def _cases(w: Workload, device: str) -> list[tuple[int, str]]:
    """(ranks, placement) per launch; ranks 0 is the plain single process without FSDP. On CUDA every rank needs a
    device of its own (NCCL), so launches with more ranks than devices are left out."""
    cases = [(0, "none")] + [(n, "shard1-qkv") for n in RANKS]
    if w.size == "minilm":
        cases.append((4, "default"))
    if device.startswith("cuda"):
        cases = [(n, p) for n, p in cases if n <= torch.cuda.device_count()]
    return cases


def _launch(w: Workload, ranks: int, placement: str, cfg: RunConfig) -> list[dict[str, Any]]:
    """One launch (plain process or ``torchrun``); returns every rank's numbers."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": str(ROOT),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **live_memory_env(cfg.device)}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ranks.json"
        args = ["-m", "benchmarks.fsdp_memory", "--device", cfg.device, "--rho", str(cfg.rho),
                "--placement", placement, "--workload", json.dumps(vars(w)), "--out", str(out)]
        if ranks:
            launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(ranks)]
            args = [*launch, *args]
        else:
            args = [sys.executable, *args]
        proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=3600)
        if proc.returncode != 0 or not out.exists():
            raise RuntimeError(f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
        return json.loads(out.read_text())


def _derive(rank: dict[str, Any], plain: dict[str, Any], one_rank: dict[str, Any], ranks: int) -> dict[str, Any]:
    """Solver bytes, bytes per perturbed parameter of the rank's share, ratios to one process's solver bytes / ranks
    (``plain``: without FSDP, the target's reference; ``one_rank``: through FSDP)."""
    share = rank["perturbed"] / ranks
    solver = {m: rank["peak"][m] - rank["peak"]["plain"] for m in MEASURES}

    def ratio(ref: dict[str, Any]) -> dict[str, float]:
        return {m: solver[m] / ((ref["peak"][m] - ref["peak"]["plain"]) / ranks) for m in MEASURES}

    return {**rank, "solver_bytes": solver, "solver_bytes_per_param": {m: solver[m] / share for m in MEASURES},
            "ratio_to_single_over_ranks": ratio(plain), "ratio_to_one_fsdp_rank_over_ranks": ratio(one_rank)}


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    for w in workloads(cfg):
        launched = []
        for ranks, placement in _cases(w, cfg.device):
            print(f"[fsdp_memory: {w.size} {w.batch_size}x{w.seq_len}, "
                  f"{f'{ranks} rank(s), {placement}' if ranks else 'single process'}]", flush=True)
            launched.append((ranks, placement, _launch(w, ranks, placement, cfg)))
        plain = next(found[0] for ranks, _, found in launched if ranks == 0)
        one_rank = next((found[0] for ranks, _, found in launched if ranks == 1), plain)  # none without a device
        for ranks, placement, found in launched:
            rows.append({"model": w.size, "workload": vars(w), "ranks": ranks, "placement": placement,
                         "per_rank": [_derive(r, plain, one_rank, max(ranks, 1)) for r in found]})
    return {"suite": "fsdp_memory", "target": {"ratio_to_single_over_ranks": TARGET}, "rows": rows}


def table(result: dict[str, Any]) -> str:
    mib = 2.0**20
    lines = [
        "| model | batch x seq | ranks | placement | rank | local rows | plain peak MiB | solver MiB (geo / ada) | "
        "bytes / local param (geo / ada) | ratio to plain process / N (geo / ada) | to one FSDP rank / N |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        w = row["workload"]
        for r in row["per_rank"]:
            geo, ada = (r["ratio_to_single_over_ranks"][m] for m in MEASURES)
            marks = "reference" if not row["ranks"] else " / ".join(
                f"{x:.2f} {'ok' if x <= TARGET else 'MISS'}" for x in (geo, ada))
            to_one = {0: "-", 1: "reference"}.get(row["ranks"]) or " / ".join(
                f"{r['ratio_to_one_fsdp_rank_over_ranks'][m]:.2f}" for m in MEASURES)
            lines.append(
                f"| {row['model']} | {w['batch_size']}x{w['seq_len']} | {row['ranks'] or 'no FSDP'} | "
                f"{row['placement']} | {r['rank']} | {r['rows']} | {r['peak']['plain'] / mib:.0f} | "
                + " / ".join(f"{r['solver_bytes'][m] / mib:.0f}" for m in MEASURES) + " | "
                + " / ".join(f"{r['solver_bytes_per_param'][m]:.1f}" for m in MEASURES) + f" | {marks} | {to_one} |"
            )
    lines.append(f"\nSolver bytes = peak(solve) - peak(plain forward+backward), per rank, on the rank's share of the "
                 f"batch; shard1-qkv = Shard(1) on the q/k/v weights. Target ratio <= {TARGET}.")
    return "\n".join(lines)


def _peak(fn: Callable[[], Any], cuda: bool) -> tuple[int, int, Any]:
    """(memory right before, peak during, result) of ``fn``; the peak is reset right before the call."""
    from .common import peak_rss_bytes, reset_peak_rss, rss_bytes

    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    else:
        before = rss_bytes()
        reset_peak_rss()
    result = fn()
    if cuda:
        torch.cuda.synchronize()
        return before, torch.cuda.max_memory_allocated(), result
    return before, peak_rss_bytes(), result


def _worker(w: Workload, device: str, rho: float, placement: str) -> dict[str, Any]:
    """This rank's (or the plain process's) numbers; the process group is set up by ``shard_model``."""
    import torch.distributed as dist

    import hf_geosharp as gs
    from hf_geosharp.engine.placement.fsdp_layout import fsdp_state
    from hf_geosharp.engine.placement.sharding import shard_model

    from .common import forward_backward
    from .models import SIZES, bert_batches, bert_classifier, symmetry_map

    cuda = device.startswith("cuda")
    if cuda and placement != "none":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        torch.cuda.set_device(device)
    model = bert_classifier(SIZES[w.size], device=device)
    batch = bert_batches(model, n_batches=1, batch_size=w.batch_size, seq_len=w.seq_len)[0]
    smap = symmetry_map(model)[0]  # mapped on the unsharded structure
    perturbed = sum(p.numel() for p in model.parameters())  # params="all": every parameter moves
    rank, world, local = 0, 1, perturbed
    if placement != "none":
        shard_model(model, placement=_shard1_qkv(model) if placement == "shard1-qkv" else None)
        local = fsdp_state(model).numel  # also FSDP's lazy init (re-pads the shards), before any peak is taken
        rank, world = dist.get_rank(), dist.get_world_size()
        rows = torch.arange(w.batch_size).tensor_split(world)[rank]
        batch = {k: v[rows.to(v.device)] for k, v in batch.items()}
    kw = dict(rho=rho, steps=w.steps, progress=False)
    calls = {
        "plain": lambda: forward_backward(model, batch),
        "geodesic_inv_worst": lambda: gs.geodesic_sharpness(model, [batch], metric="inv", symmetry_map=smap,
                                                             **kw).value,
        "adaptive_clean_worst": lambda: gs.adaptive_sharpness(model, [batch], variant="clean", **kw).value,
    }
    before, peak, values = {}, {}, {}
    for name, fn in calls.items():
        if world > 1:
            dist.barrier()
        before[name], peak[name], values[name] = _peak(fn, cuda)
    return {"rank": rank, "world": world, "rows": int(batch["labels"].shape[0]), "perturbed": perturbed,
            "local_numel": local,
            "before": before, "peak": peak, "values": values, "threads": torch.get_num_threads()}


def _shard1_qkv(model: torch.nn.Module) -> Callable[[torch.nn.Parameter], Any]:
    """``Shard(1)`` for the query/key/value weights, FSDP's default ``Shard(0)`` for everything else."""
    from torch.distributed.tensor import Shard

    ids = {id(m.weight) for n, m in model.named_modules() if n.endswith(("query", "key", "value"))}
    return lambda p: Shard(1) if id(p) in ids else None


def main() -> None:
    parser = argparse.ArgumentParser(description="One rank of the fsdp_memory suite (internal).")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--rho", type=float, default=0.1)
    parser.add_argument("--placement", choices=("none", "shard1-qkv", "default"), required=True)
    parser.add_argument("--workload", required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.set_num_threads(1)
    mine = _worker(Workload(**json.loads(args.workload)), args.device, args.rho, args.placement)
    if args.placement == "none":
        args.out.write_text(json.dumps([mine]))
        return
    import torch.distributed as dist

    everyone: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine)
    if dist.get_rank() == 0:
        args.out.write_text(json.dumps(everyone))
    dist.barrier()
    # Leave without C++ destructors: under load gloo's threads sometimes abort interpreter shutdown after the work.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
