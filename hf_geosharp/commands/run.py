"""``geosharp run``: geodesic (and adaptive) sharpness of a saved model on a dataset, from the shell.

Under ``accelerate launch --multi_gpu --num_processes N -m hf_geosharp run ...`` or ``torchrun`` (``WORLD_SIZE`` > 1)
every process loads the same model and builds the same batches; the engine shares the batches out, gathers the
per-batch values, and only rank 0 prints and writes files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import logging
import math
import sys
import time
from pathlib import Path
from typing import Any

from .. import __version__
from ..api import adaptive_sharpness, geodesic_sharpness
from ..data import DataError, DataSpec, launch_accelerator, load_batches, load_model, load_processor, require_task
from ..symmetry import SymmetryMap, map_symmetries

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2
METRICS = ("inv", "mix")

EPILOG = """\
examples are the first --n-examples rows of the split after a shuffle seeded by --seed (--no-shuffle: file order).
exit codes: 0 success; 1 the run failed or a value is not finite; 2 bad usage or input (model, dataset, columns).
"""


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def _metrics(text: str) -> list[str]:
    metrics = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        raise argparse.ArgumentTypeError(f"{text!r}: use a comma-separated list of {', '.join(METRICS)}")
    return metrics


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "run",
        help="measure geodesic (and adaptive) sharpness of a model on a dataset",
        description="Measure geodesic sharpness, and adaptive sharpness as a baseline, of a model on batches of a\n"
        "dataset; print a table and optionally write JSON.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", required=True, help="saved model folder or Hub id, with its task head and tokenizer")
    p.add_argument(
        "--dataset",
        required=True,
        help="Hub dataset (name or name:config) or local csv/tsv/json/jsonl/parquet file, save_to_disk folder, "
        "folder of data files or imagefolder",
    )
    p.add_argument("--config", help="Hub dataset configuration")
    p.add_argument("--split", default="train", help="dataset split (default: train)")
    p.add_argument("--n-examples", type=_positive(int), default=1024, help="examples to use (default: 1024)")
    p.add_argument("--batch-size", type=_positive(int), default=128, help="examples per batch (default: 128)")
    p.add_argument("--metric", type=_metrics, default=["inv", "mix"], help="geodesic metrics (default: inv,mix)")
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also measure adaptive sharpness, the baseline (default: on)",
    )
    p.add_argument("--mode", choices=("worst", "average"), default="worst", help="worst or average case")
    p.add_argument("--rho", type=_positive(float), default=0.1, help="perturbation radius (default: 0.1)")
    p.add_argument("--steps", type=_positive(int), default=20, help="solver steps per batch, worst case")
    p.add_argument("--n-samples", type=_positive(int), default=20, help="random directions per batch, average case")
    p.add_argument("--epsilon", type=_positive(float), default=1e-6, help="regulariser of the metric (default: 1e-6)")
    p.add_argument("--seed", type=int, default=0, help="seed of the example shuffle and of the solver")
    p.add_argument("--no-shuffle", action="store_true", help="take the first --n-examples rows in file order")
    p.add_argument("--max-length", type=_positive(int), default=128, help="tokenizer truncation length")
    p.add_argument("--text-column", help="text column (default: found by name)")
    p.add_argument("--text-pair-column", help="second text column for sentence pairs")
    p.add_argument("--label-column", help="label column (default: a ClassLabel column or 'label', 'labels', ...)")
    p.add_argument("--image-column", help="image column of a vision dataset")
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    p.add_argument("--quiet", action="store_true", help="no progress bars and no table")
    p.set_defaults(func=run)


def _default_device() -> Any:
    """A single process uses the GPU when there is one (under a launcher the Accelerator picks each rank's device)."""
    import torch

    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def _measure(
    args: argparse.Namespace, model: Any, smap: SymmetryMap, batches: list, accelerator: Any, progress: bool
) -> list[tuple]:
    common = dict(
        rho=args.rho, mode=args.mode, steps=args.steps, seed=args.seed, n_samples=args.n_samples,
        accelerator=accelerator, progress=progress,
    )  # fmt: skip
    calls = [(geodesic_sharpness, dict(metric=m, epsilon=args.epsilon, symmetry_map=smap)) for m in args.metric]
    if args.baseline:
        calls.append((adaptive_sharpness, {}))
    timed = []
    for fn, extra in calls:
        start = time.perf_counter()
        res = fn(model, batches, **common, **extra)
        timed.append((res, time.perf_counter() - start))
    return timed


def _quiet_libraries() -> None:
    """The loading bars of transformers and datasets would bury ours (batches and solver steps)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()


def run(args: argparse.Namespace) -> int:
    _quiet_libraries()
    accelerator = launch_accelerator()
    main = accelerator is None or accelerator.is_main_process
    if args.quiet or not main:
        logging.getLogger("hf_geosharp").setLevel(logging.WARNING)

    def fail(code: int, message: str) -> int:
        if main:
            print(f"error: {message}", file=sys.stderr)
        return code

    spec = DataSpec(
        dataset=args.dataset, config=args.config, split=args.split, n_examples=args.n_examples,
        batch_size=args.batch_size, seed=args.seed, shuffle=not args.no_shuffle, max_length=args.max_length,
        text_column=args.text_column, text_pair_column=args.text_pair_column, label_column=args.label_column,
        image_column=args.image_column,
    )  # fmt: skip
    try:
        model = load_model(args.model)
        require_task(model)  # before any data work: a model without a loss cannot be measured
        model.to(accelerator.device if accelerator is not None else _default_device())
        processor = load_processor(args.model, model)
        first = accelerator.main_process_first() if accelerator is not None else contextlib.nullcontext()
        with first:  # rank 0 fills the datasets cache, the others then read it
            batches = load_batches(model, processor, spec)
    except DataError as err:
        return fail(EXIT_BAD_INPUT, str(err))

    try:
        smap = map_symmetries(model)
        timed = _measure(args, model, smap, batches, accelerator, progress=main and not args.quiet)
    except ValueError as err:  # the engine refuses inputs it cannot measure (dtype, parameters, ...)
        return fail(EXIT_BAD_INPUT, str(err))
    except Exception as err:  # noqa: BLE001 - any other failure is a failed run: exit 1, traceback with -v
        logger.debug("run failed", exc_info=True)
        return fail(EXIT_FAILED, f"the measurement failed: {type(err).__name__}: {err}")

    world_size = accelerator.num_processes if accelerator is not None else 1
    symmetry = smap.summary()
    if main:
        for fallback in symmetry["fallbacks"]:  # warnings go to stderr even with --quiet
            print(
                f"warning: attention module {fallback['module']!r} could not be mapped ({fallback['reason']}); its "
                "parameters are perturbed elementwise, so the geodesic numbers are not symmetry-invariant there.",
                file=sys.stderr,
            )
        if not args.quiet:
            _report(args, model, spec, batches, world_size, symmetry, timed)
        if args.json:
            _write_json(args.json, args, model, spec, batches, world_size, symmetry, timed)
    bad = [res.measure for res, _ in timed if not math.isfinite(res.value)]
    if bad:
        return fail(EXIT_FAILED, f"non-finite sharpness for {', '.join(bad)}; try a smaller --rho or check the model.")
    return EXIT_OK


def _report(
    args: Any, model: Any, spec: DataSpec, batches: list, world_size: int, symmetry: dict, timed: list
) -> None:
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{spec.dataset}" + (f":{spec.config}" if spec.config else "") + f" [{spec.split}]"
    print(f"model    {args.model} ({type(model).__name__}, {n_params:,} parameters)")
    print(f"data     {where}: {spec.n_examples} examples in {len(batches)} batches of up to {spec.batch_size}")
    print(
        f"symmetry {symmetry['n_pairs_qk']} QK and {symmetry['n_pairs_vo']} VO head pairs, head dims "
        f"{symmetry['head_dims']}; {len(symmetry['fallbacks'])} unmapped attention module(s)"
    )
    print(f"settings rho={args.rho} mode={args.mode} steps={args.steps} seed={args.seed} processes={world_size}")
    rows = [["measure", "sharpness", "clean loss", "batches", "seconds"]]
    for res, seconds in timed:
        n_batches = str(len(res.per_batch))
        rows.append([res.measure, f"{res.value:.6g}", f"{res.clean_loss:.6g}", n_batches, f"{seconds:.1f}"])
    print()
    print(_table(rows))


def _write_json(
    path: Path, args: Any, model: Any, spec: DataSpec, batches: list, world_size: int, symmetry: dict, timed: list
) -> None:
    payload = {
        "hf_geosharp_version": __version__,
        "model": args.model,
        "model_class": type(model).__name__,
        "data": dataclasses.asdict(spec),
        "n_batches": len(batches),
        "world_size": world_size,
        "symmetry": symmetry,
        "results": {res.measure: {**res.to_dict(), "seconds": seconds} for res, seconds in timed},
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
    logger.info("wrote %s", path)

