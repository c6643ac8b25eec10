"""The two batches of the demo zoo where two agreeing starts missed a higher maximum, and the step cost of
``steps="auto"`` on the zoo members they come from (docs/method.md, "Random starts where the starts found several
maxima").

Batch 0 of the demo's data (256 training digits in batches of 64, seed 0), float32 as the demo loads them:
zoo-04, geodesic mix at rho 0.02 (two starts agreed on 5.2602; an independent random start reached 5.9278) and
zoo-03, geodesic inv at rho 0.1 (two starts agreed on 0.3115; independent ascents reached 0.3120). Only these two
members are trained (about a minute; cached like the demo's zoo).

    python -m experiments.certificate_misses            # the two cases: value, certificate, steps, each start
    python -m experiments.certificate_misses --cost     # also: steps of auto on all 4 batches, 3 measures, rho 0.1
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from hf_geosharp.data import DataSpec, load_batches, load_model, load_processor
from hf_geosharp.engine.builder import build
from hf_geosharp.engine.model_function.objective import default_loss, preserved_model_state
from hf_geosharp.engine.placement.single import SingleProcess
from hf_geosharp.engine.runner import batch_seed, solve
from hf_geosharp.engine.settings import RunSettings
from hf_geosharp.engine.space.perturbation_space import SpaceOptions
from hf_geosharp.zoo import build_zoo

MEMBERS = ("zoo-03", "zoo-04")
CASES = (("zoo-04", "mix", 0.02), ("zoo-03", "inv", 0.1))


def demo_batches(cache: Path | None) -> dict[str, tuple[torch.nn.Module, list[dict]]]:
    """The two members and the demo's batches for each."""
    zoo = build_zoo("full", cache, progress=False, names=list(MEMBERS))
    data = DataSpec(dataset=str(zoo.data_dir), split="train", n_examples=256, batch_size=64, seed=0)
    out = {}
    for name in MEMBERS:
        model = load_model(str(zoo.root / name))
        out[name] = model, load_batches(model, load_processor(str(zoo.root / name), model), data)
    return out


def solved(model: torch.nn.Module, batch: dict, measure: str, rho: float, index: int = 0):
    """One auto solve of ``batch`` as batch ``index`` of a run with seed 0 (its settings and its solve result)."""
    # the paper's ball, under which the two misses were found (docs/method.md, "Radius convention")
    options = SpaceOptions(measure, ball="paper") if measure != "adaptive" else None
    settings = RunSettings(rho, steps="auto", options=options)
    with preserved_model_state(model):
        space, objective = build(model, settings, SingleProcess(model), default_loss, {index: batch})
        objective.batch = batch
        generator = torch.Generator().manual_seed(batch_seed(0, index))
        return settings, solve(settings, space, objective, generator, lambda k, s: None)


def starts(model: torch.nn.Module, batch: dict, metric: str, rho: float) -> str:
    """Value, certificate, steps and each start of the auto solve of ``batch`` (as batch 0)."""
    settings, out = solved(model, batch, metric, rho)
    state, note = out.verdict(settings.tol, settings.starts)
    found = ", ".join(f"{k} {v:.5g} (gap {g:.1e})" for k, v, g in zip(out.start_kinds, out.start_values,
                                                                        out.start_gaps))
    return f"{out.sharpness:.5g}, {state}, {out.steps_used} steps; starts: {found}" + (f"; {note}" if note else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cache", type=Path, help="zoo cache (default: the demo's)")
    parser.add_argument("--cost", action="store_true", help="also count auto's steps on all batches")
    parser.add_argument("--cost-only", action="store_true", help="only count auto's steps on all batches")
    args = parser.parse_args()
    torch.set_num_threads(1)
    members = demo_batches(args.cache)
    for name, metric, rho in CASES if not args.cost_only else ():
        model, batches = members[name]
        print(f"{name} {metric} rho={rho} batch 0: {starts(model, batches[0], metric, rho)}", flush=True)
    if not (args.cost or args.cost_only):
        return
    total = 0
    for name in MEMBERS:
        model, batches = members[name]
        for measure in ("inv", "mix", "adaptive"):
            start, steps, certified = time.perf_counter(), 0, 0
            for i, batch in enumerate(batches):
                settings, out = solved(model, batch, measure, 0.1, i)
                steps += out.steps_used
                certified += out.certificate(settings.tol, settings.starts) is None
            total += steps
            print(f"{name} {measure} rho=0.1: {steps} steps over {len(batches)} batches, {certified} certified, "
                  f"{time.perf_counter() - start:.0f} s", flush=True)
    print(f"total: {total} steps")


if __name__ == "__main__":
    sys.exit(main())
