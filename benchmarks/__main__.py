"""``python -m benchmarks``: run the suites, write ``benchmarks/results/<suite>-<device>.json``, print the tables."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import torch

from hf_geosharp.commands.common import Parser, folder_path, non_negative, positive
from hf_geosharp.durable import write_json

from . import capture, default_call, floor, fsdp_memory, launch, memory, overhead, peer, scaling, step_profile
from .common import load_average, machine
from .config import RunConfig

SUITES = {"default_call": default_call, "overhead": overhead, "floor": floor, "memory": memory, "scaling": scaling,
          "peer": peer, "fsdp_memory": fsdp_memory, "step_profile": step_profile,
          "launch": launch, "capture": capture}
#: The suites that ``--only`` filters (the others run all their workloads).
ONLY_SUITES = ("floor", "overhead", "memory", "capture", "step_profile")
RESULTS = Path(__file__).parent / "results"
NOT_RERUN_NOTE = ("rows of this suite not rerun with the installed version: the version, machine and date they were "
                  "measured on")


def row_label(row: dict[str, Any]) -> str | None:
    """The ``--only`` label of a result row's workload (None for a row without one)."""
    w = row.get("workload")
    return f"{w['size']}-{w['batch_size']}x{w['seq_len']}" if isinstance(w, dict) else None


def keep_not_rerun(previous: dict[str, Any], result: dict[str, Any], rerun: set[str]) -> None:
    """Carry into ``result`` (a run of the workloads ``rerun``) the rows of ``previous`` (the file it replaces) that
    it did not rerun, under ``not_rerun`` with the version, machine and date they were measured on: one block per
    earlier run (a dict, or a list where there are several)."""
    blocks = previous.get("not_rerun") or []
    blocks = [blocks] if isinstance(blocks, dict) else list(blocks)
    blocks.append({"hf_geosharp": previous.get("machine", {}).get("hf_geosharp"), "date": previous.get("date"),
                   "machine": previous.get("machine"), "rows": previous.get("rows", [])})
    kept = []
    for block in blocks:
        rows = [r for r in block.get("rows", []) if row_label(r) not in rerun | {None}]
        if rows:
            kept.append({"note": NOT_RERUN_NOTE, **{k: v for k, v in block.items() if k != "note"}, "rows": rows})
    if kept:
        result["not_rerun"] = kept[0] if len(kept) == 1 else kept


def main(argv: list[str] | None = None) -> None:
    parser = Parser(prog="python -m benchmarks", description=__doc__)
    parser.add_argument("--suite", default=",".join(SUITES), help=f"comma-separated, from {','.join(SUITES)}")
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer steps (~10 min on 2 CPU cores)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda (cuda:N)")
    parser.add_argument("--repeats", type=positive(int), default=None,
                        help="timed repeats per case (default 2, quick 1)")
    parser.add_argument("--threads", type=non_negative(int), default=0,
                        help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--only", default="",
                        help="comma-separated workloads of the floor, overhead, memory, capture and step_profile suites"
                        " to run, e.g. minilm-8x128 (default: all)")
    parser.add_argument("--out", type=folder_path, default=RESULTS, help="folder for the JSON results")
    args = parser.parse_args(argv)
    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        parser.error(f"unknown suite(s) {unknown}; choose from {list(SUITES)}")
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        parser.error("--device cuda was asked for but torch sees no CUDA device")
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    cfg = RunConfig(device=args.device, quick=args.quick, repeats=args.repeats or (1 if args.quick else 2),
                    only=tuple(s.strip() for s in args.only.split(",") if s.strip()))
    known = {w.label for name in suites if name in ONLY_SUITES for w in SUITES[name].workloads(cfg)}
    missing = [label for label in cfg.only if label not in known]
    if missing:
        parser.error(f"--only names no workload of the chosen suites: {missing}; choose from {sorted(known)}")
    args.out.mkdir(parents=True, exist_ok=True)
    for name in suites:
        start, load = time.time(), load_average()
        print(f"\n## {name} ({'quick' if cfg.quick else 'full'}, {cfg.device})\n", flush=True)
        result = SUITES[name].run(cfg)
        result.update(machine={**machine(cfg.device), "load_average_at_start": load,
                               "load_average_at_end": load_average()}, quick=cfg.quick, repeats=cfg.repeats,
                      seconds=round(time.time() - start, 1), date=time.strftime("%Y-%m-%d %H:%M:%S"))
        device = cfg.device.split(":")[0]
        path = args.out / f"{name}-{device}.json"
        if cfg.only and path.exists():
            keep_not_rerun(json.loads(path.read_text()), result, set(cfg.only))
        write_json(path, result, indent=1)  # durable: an interrupted write keeps the previous results
        print(SUITES[name].table(result))
        print(f"\n[{name}: {result['seconds']} s -> {path}]", flush=True)


if __name__ == "__main__":
    main()
