"""``geosharp leaderboard``: rank many models by sharpness and correlate every measure with the generalisation gap.

Results go into ``OUT/results.jsonl`` as they are computed; rerunning the same command after a crash, a kill or
Ctrl-C computes only what is missing. One run at a time per ``--out``: a second one fails at once with exit code 2,
naming the lock (``OUT/leaderboard.lock``) that the first holds. Outputs (written durably): ``leaderboard.md``,
``leaderboard.csv`` and, with a gap, ``taus.json`` and ``scatter.png``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from ..data import DataSpec
from ..leaderboard import GapSpec
from .board import add_data_arguments, execute
from .common import add_trust_remote_code, existing_file, folder_path, positive

EPILOG = """\
models: model folders, folders of checkpoint folders, text files listing models (one per line) or Hub ids.
gap: --gap FILE (CSV/TSV with columns model,gap or JSON {model: gap}), or --gap-splits TRAIN,TEST to compute
     test minus train error (--gap-metric loss: loss) on two splits of --dataset.
resume: rerun the same command; finished results are read from OUT/results.jsonl, never recomputed.
"""


def _splits(text: str) -> tuple[str, str]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) != 2 or not all(parts):
        raise argparse.ArgumentTypeError(f"{text!r}: use TRAIN,TEST (e.g. train,test)")
    return parts[0], parts[1]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``geosharp leaderboard``."""
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
    p.add_argument("--max-length", type=positive(int), default=128, help="tokenizer truncation length")
    add_data_arguments(p, n_examples=1024, batch_size=128)
    gap = p.add_mutually_exclusive_group()
    gap.add_argument("--gap", type=existing_file, help="file with each model's generalisation gap")
    gap.add_argument("--gap-splits", type=_splits, help="TRAIN,TEST: compute the gap on these splits")
    p.add_argument("--gap-metric", choices=("error", "loss"), default="error",
                   help="with --gap-splits: test minus train error or loss (default: error)")
    p.add_argument("--gap-n-examples", type=positive(int), help="examples per split for the gap (default: whole split)")
    p.add_argument("--out", type=folder_path, default=Path("outputs/leaderboard"),
                   help="output folder and result store")
    add_trust_remote_code(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Rank the models and write the tables and plot; the exit code."""
    if args.gap_splits:
        gap = GapSpec(train_split=args.gap_splits[0], test_split=args.gap_splits[1], metric=args.gap_metric,
                      n_examples=args.gap_n_examples)
    else:
        gap = GapSpec(file=args.gap) if args.gap else None
    data = DataSpec(dataset=args.dataset, config=args.config, split=args.split, n_examples=args.n_examples,
                    batch_size=args.batch_size, seed=args.seed, max_length=args.max_length,
                    label_column=args.label_column, text_column=args.text_column, image_column=args.image_column)
    return execute(args, args.models, data, gap)[0]
