"""Capture suite: the worst case's step eager against captured (``compile=``), as shares of the floor.

Per measure, the first captured solve of the process is timed alone (it traces and compiles the step's graphs: the
cost a call pays once), then eager and captured solves alternate in rounds, each right after its floor passes, as in
the floor suite (:func:`.floor.paired_rounds`; medians of the paired shares). On a CPU the capture is inductor's
(``compile="default"``), on CUDA its CUDA graphs (``"reduce-overhead"``). Run it on a CPU with
``OMP_WAIT_POLICY=PASSIVE`` and one thread (``--threads 1``) for CPU times that do not count waiting.
"""

from __future__ import annotations

from typing import Any

import torch

import hf_geosharp as gs

from .common import forward_backward, load_average, time_once
from .config import RunConfig, Workload
from .floor import TARGET, paired_rounds, shares_of, workload_row
from .models import workload_inputs

MEASURES = ("adaptive_clean", "geodesic_inv", "geodesic_mix")


def workloads(cfg: RunConfig) -> list[Workload]:
    return cfg.pick([Workload("minilm", 8, 128, 20)], [Workload("minilm", 8, 64, 10)])


def capture_choice(device: str) -> str:
    """What a user would pick there: CUDA graphs on CUDA, inductor's kernels elsewhere."""
    return "reduce-overhead" if device.startswith("cuda") else "default"


def run(cfg: RunConfig) -> dict[str, Any]:
    rows = []
    choice = capture_choice(cfg.device)
    for w in cfg.chosen(workloads(cfg)):
        model, batches, smap, source = workload_inputs(w, cfg.device)

        def solve(measure: str, compile: str) -> float:
            kw = dict(rho=cfg.rho, steps=w.steps, progress=False, compile=compile)
            if measure == "adaptive_clean":
                return gs.adaptive_sharpness(model, batches, variant="clean", **kw).value
            return gs.geodesic_sharpness(model, batches, metric=measure.split("_")[1], symmetry_map=smap, **kw).value

        load = load_average()
        first, values, cases = {}, {}, {}
        torch._dynamo.reset()  # each measure's first captured solve compiles its graphs
        for measure in MEASURES:
            values[measure], wall, cpu = time_once(lambda m=measure: solve(m, choice), cfg.device)
            first[measure] = {"wall": wall, "cpu": cpu}
            cases[f"{measure}/off"] = lambda m=measure: solve(m, "off")
            cases[f"{measure}/{choice}"] = lambda m=measure: solve(m, choice)
        # Every measure's graphs are compiled above; the rounds reuse them (dynamo caches one entry per space).
        timings, paired = paired_rounds(cases, cfg.repeats, cfg.device, lambda: forward_backward(model, batches[0]))
        eager = {m: solve(m, "off") for m in MEASURES}
        rows.append({
            **workload_row(w, model, source),
            "compile": choice,
            "first_captured_solve": first,
            "values": {m: {"off": eager[m], choice: values[m],
                           "relative_difference": abs(values[m] - eager[m]) / abs(eager[m])} for m in MEASURES},
            "timings": {k: t.to_dict() for k, t in timings.items()},
            "shares": shares_of(timings, paired, (w.steps + 1) * w.n_batches),
            "load_average": {"start": load, "end": load_average()},
        })
        del model, batches
    return {"suite": "capture", "target": {"non_model_share": TARGET}, "rows": rows}


def table(result: dict[str, Any]) -> str:
    lines = ["| model | batch x seq | steps | measure | compile | first solve s (cpu) | total s | "
             "non-model share (cpu) | (wall) | extra ms/step (cpu) | value rel. diff |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        w = r["workload"]
        for case, s in r["shares"].items():
            measure, compile = case.split("/")
            first = r["first_captured_solve"][measure]["cpu"] if compile != "off" else float("nan")
            diff = r["values"][measure]["relative_difference"] if compile != "off" else 0.0
            lines.append(
                f"| {r['model']} | {w['batch_size']}x{w['seq_len']} | {w['steps']} | {measure} | {compile} | "
                f"{'-' if compile == 'off' else f'{first:.0f}'} | {s['total_s']:.2f} | "
                f"{100 * s['non_model_share_cpu']:.1f} % | {100 * s['non_model_share_wall']:.1f} % | "
                f"{s['per_step_extra_cpu_ms']:.0f} | {diff:.1e} |"
            )
    lines.append("\nfirst solve: the process's first captured solve of the measure (traces and compiles); the other "
                 "columns: medians over rounds that alternate eager and captured, each against its own floor passes.")
    return "\n".join(lines)
