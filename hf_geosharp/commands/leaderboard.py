"""``geosharp leaderboard``: rank many models by sharpness and correlate every measure with the generalisation gap.

Results go into ``OUT/results.jsonl`` as they are computed; rerunning the same command after a crash or a kill
computes only what is missing. Outputs: ``leaderboard.md``, ``leaderboard.csv`` and, with a gap, ``taus.json`` and
``scatter.png``.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from ..data import DataError, DataSpec
from ..leaderboard import (
    KINDS,
    STORE_FILE,
    GapSpec,
    Leaderboard,
    Measure,
    ResultStore,
    Settings,
    markdown,
    resolve_models,
    run_leaderboard,
    write_outputs,
)
from .run import _quiet_libraries

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT = 0, 1, 2

EPILOG = """\
models: model folders, folders of checkpoint folders, text files listing models (one per line) or Hub ids.
gap: --gap FILE (CSV/TSV with columns model,gap or JSON {model: gap}), or --gap-splits TRAIN,TEST to compute
     test minus train error (--gap-metric loss: loss) on two splits of --dataset.
resume: rerun the same command; finished results are read from OUT/results.jsonl, never recomputed.
"""


def _choices(allowed: tuple[str, ...]):
    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items or any(i not in allowed for i in items):
            raise argparse.ArgumentTypeError(f"{text!r}: use a comma-separated list of {', '.join(allowed)}")
        return list(dict.fromkeys(items))

    parse.__name__ = "list"
    return parse


def _splits(text: str) -> tuple[str, str]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: use TRAIN,TEST (e.g. train,test)")
    return parts[0], parts[1]


def add_data_arguments(p: argparse.ArgumentParser, n_examples: int, batch_size: int) -> None:
    """Data options shared with ``geosharp demo`` (which fills the dataset in itself)."""
    p.add_argument("--n-examples", type=int, default=n_examples, help=f"examples to measure on (default: {n_examples})")
    p.add_argument("--batch-size", type=int, default=batch_size, help=f"examples per batch (default: {batch_size})")
    p.add_argument("--measures", type=_choices(KINDS), default=list(KINDS),
                   help="inv, mix, adaptive, relative_flatness (default: all)")
    p.add_argument("--mode", type=_choices(("worst", "average")), default=["worst"], help="worst and/or average")
    p.add_argument("--rho", type=float, default=0.1, help="perturbation radius (default: 0.1)")
    p.add_argument("--steps", type=int, default=20, help="solver steps per batch, worst case (default: 20)")
    p.add_argument("--n-samples", type=int, default=20, help="random directions per batch, average case")
    p.add_argument("--epsilon", type=float, default=1e-6, help="regulariser of the geodesic metric")
    p.add_argument("--seed", type=int, default=0, help="seed of the example shuffle, solver and bootstrap")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "leaderboard",
        help="rank many models by sharpness; Kendall tau of each measure against the generalisation gap",
        description="Measure geodesic and adaptive sharpness of many models on the same batches, rank them, and "
        "correlate every measure (and the trivial predictors: parameter norm, clean training loss) with the "
        "generalisation gap. Resumable.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("models", nargs="+", help="model folders, checkpoint folders, list files or Hub ids")
    p.add_argument("--dataset", required=True, help="Hub dataset (name or name:config) or local dataset path")
    p.add_argument("--config", help="Hub dataset configuration")
    p.add_argument("--split", default="train", help="split the sharpness is measured on (default: train)")
    p.add_argument("--label-column", help="label column (default: found by name)")
    p.add_argument("--text-column", help="text column (default: found by name)")
    p.add_argument("--image-column", help="image column (default: found by name)")
    p.add_argument("--max-length", type=int, default=128, help="tokenizer truncation length")
    add_data_arguments(p, n_examples=1024, batch_size=128)
    gap = p.add_mutually_exclusive_group()
    gap.add_argument("--gap", type=Path, help="file with each model's generalisation gap")
    gap.add_argument("--gap-splits", type=_splits, help="TRAIN,TEST: compute the gap on these splits")
    p.add_argument("--gap-metric", choices=("error", "loss"), default="error",
                   help="with --gap-splits: test minus train error or loss (default: error)")
    p.add_argument("--gap-n-examples", type=int, help="examples per split for the gap (default: whole split)")
    p.add_argument("--out", type=Path, default=Path("outputs/leaderboard"), help="output folder and result store")
    p.set_defaults(func=run)


def measures_of(args: argparse.Namespace) -> list[Measure]:
    measures = [Measure(kind, mode) for mode in args.mode for kind in args.measures]
    return list({m.name: m for m in measures}.values())  # relative flatness has no mode: once


def settings_of(args: argparse.Namespace) -> Settings:
    return Settings(rho=args.rho, steps=args.steps, n_samples=args.n_samples, seed=args.seed, epsilon=args.epsilon)


def report(board: Leaderboard, paths: dict[str, Path]) -> None:
    """Print the ranked table, the taus and where the files are."""
    print(markdown(board))
    for kind, path in paths.items():
        print(f"{kind:9s}{path}")


def check_counts(args: argparse.Namespace) -> str | None:
    """The usage error in the count options, if any."""
    for name in ("n_examples", "batch_size", "steps", "n_samples"):
        if getattr(args, name) < 1:
            return f"--{name.replace('_', '-')} must be at least 1"
    return None


def execute(
    args: argparse.Namespace, model_specs: list[str], data: DataSpec, gap: GapSpec | None
) -> tuple[int, Leaderboard | None]:
    """Run (or resume) the leaderboard into ``args.out`` and write its files; the exit code and the board."""
    _quiet_libraries()
    if not getattr(args, "verbose", False):  # one line per model and measure would bury the progress bar
        for name in ("hf_geosharp.api", "hf_geosharp.symmetry"):
            logging.getLogger(name).setLevel(logging.WARNING)
    try:
        models = resolve_models(model_specs)
        board = run_leaderboard(models, data, measures_of(args), ResultStore(args.out / STORE_FILE),
                                settings=settings_of(args), gap=gap, progress=not args.quiet)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT, None
    except Exception as err:  # noqa: BLE001 - a failed run keeps its finished results: say so, exit 1
        logger.debug("leaderboard failed", exc_info=True)
        print(f"error: {type(err).__name__}: {err}\nfinished results are kept in {args.out / STORE_FILE}; rerun the "
              "same command to resume.", file=sys.stderr)
        return EXIT_FAILED, None
    paths = write_outputs(board, args.out)
    if not args.quiet:
        report(board, paths)
    return EXIT_OK, board


def run(args: argparse.Namespace) -> int:
    problem = check_counts(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    if args.gap_splits:
        gap = GapSpec(train_split=args.gap_splits[0], test_split=args.gap_splits[1], metric=args.gap_metric,
                      n_examples=args.gap_n_examples)
    else:
        gap = GapSpec(file=args.gap) if args.gap else None
    data = DataSpec(dataset=args.dataset, config=args.config, split=args.split, n_examples=args.n_examples,
                    batch_size=args.batch_size, seed=args.seed, max_length=args.max_length,
                    label_column=args.label_column, text_column=args.text_column, image_column=args.image_column)
    return execute(args, args.models, data, gap)[0]
