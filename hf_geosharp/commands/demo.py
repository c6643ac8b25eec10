"""``geosharp demo``: the whole product on data that ship with the install, offline.

Trains (or reuses from the cache) the embedded zoo of small ViTs on scikit-learn's digits, ranks them with the
leaderboard (geodesic inv and mix, adaptive; gap = test minus train error), and prints the table, the Kendall taus,
the plot's path and a model-card snippet for the flattest model. A second run reuses the cached zoo and results.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from ..cards import card_yaml, dataset_info, eval_result
from ..data import DataSpec
from ..leaderboard import GapSpec, ranked
from ..zoo import build_zoo, cache_root, torch_threads
from .leaderboard import EXIT_BAD_INPUT, EXIT_OK, add_data_arguments, check_counts, execute


def _size(text: str) -> str | int:
    if text in ("mini", "full"):
        return text
    if text.isdigit() and int(text) > 0:
        return int(text)
    raise argparse.ArgumentTypeError(f"{text!r}: use mini, full or a number of models")


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "demo",
        help="train the embedded zoo of small ViTs on digits and rank them (offline, a few minutes)",
        description="Train (once; cached) a zoo of small ViT classifiers on scikit-learn's digits with varied "
        "hyperparameters, then run the leaderboard on them: geodesic and adaptive sharpness against the "
        "generalisation gap, with the trivial predictors beside them. Offline.",
    )
    p.add_argument("--size", type=_size, default="full", help="zoo size: full (20 models), mini (4) or a number")
    p.add_argument("--cache-dir", type=Path, help=f"zoo cache (default: $HF_GEOSHARP_CACHE/zoo or {cache_root()}/zoo)")
    p.add_argument("--out", type=Path, default=Path("outputs/demo"), help="output folder (default: outputs/demo)")
    p.add_argument("--threads", type=int, default=1, help="torch threads (default: 1; tiny models gain nothing more)")
    add_data_arguments(p, n_examples=256, batch_size=64)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    problem = check_counts(args)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    start = time.perf_counter()
    with torch_threads(args.threads):
        zoo = build_zoo(args.size, args.cache_dir, progress=not args.quiet)
        trained = time.perf_counter()
        data = DataSpec(dataset=str(zoo.data_dir), split="train", n_examples=args.n_examples,
                        batch_size=args.batch_size, seed=args.seed)
        code, board = execute(args, [str(d) for d in zoo.model_dirs], data, GapSpec())  # train and test splits
    if code != EXIT_OK:
        return code
    flattest = ranked(board)[0]["model"]
    entries = [eval_result(r, dataset_info({"data": vars(data)}, name="digits", local=True), "image-classification")
               for r in board.results[flattest]]
    if not args.quiet:
        print(f"\nmodel-card snippet for the flattest model ({flattest}); `geosharp card` writes such entries "
              "into a README.md:\n")
        print("---\n" + card_yaml(entries, flattest) + "\n---")
        print(f"\nzoo: {len(zoo.members)} models in {zoo.root} ({trained - start:.0f} s); "
              f"leaderboard: {time.perf_counter() - trained:.0f} s")
    return EXIT_OK
