"""What ``geosharp leaderboard`` and ``geosharp demo`` share (not a sub-command itself): the data and measure options,
and running a leaderboard into an output folder with the commands' exit codes."""

from __future__ import annotations

import argparse
import dataclasses
import logging
from pathlib import Path

from ..data import DataError, DataSpec
from ..durable import OutputPathError, check_writable
from ..leaderboard import (
    Column,
    GapSpec,
    Leaderboard,
    markdown,
    resolve_models,
    run_leaderboard,
    write_outputs,
)
from ..leaderboard.report import sweep_markdown, write_sweep
from ..leaderboard.run import ModelError, ModelFailed, radius_columns, rho_sweep
from ..leaderboard.store import STORE_FILE, ResultStore, StoreLockedError, output_lock
from ..measures import BOARD_MEASURES
from .common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    add_measure_options,
    error,
    keep_on_interrupt,
    positive,
    quiet_libraries,
    settings_of,
)

logger = logging.getLogger(__name__)



def radii(text: str) -> list[float]:
    """An argparse type: comma-separated positive radii (``none``: no sweep)."""
    if text.strip().lower() == "none":
        return []
    try:
        return sorted({positive(float)(t.strip()) for t in text.split(",") if t.strip()})
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: use comma-separated positive radii, e.g. 0.01,0.03,0.3, "
                                         "or none") from None


def add_data_arguments(p: argparse.ArgumentParser, n_examples: int, batch_size: int,
                       rho_sweep: tuple[float, ...] = (), sweep_examples: int | None = None) -> None:
    """Data and measure options of both commands (``geosharp demo`` fills the dataset in itself)."""
    p.add_argument("--n-examples", type=positive(int), default=n_examples,
                   help=f"examples to measure on (default: {n_examples})")
    p.add_argument("--batch-size", type=positive(int), default=batch_size,
                   help=f"examples per batch (default: {batch_size})")
    add_measure_options(p, BOARD_MEASURES, several_modes=True)
    grid = ",".join(f"{r:g}" for r in rho_sweep) or "none"
    p.add_argument("--rho-sweep", type=radii, default=list(rho_sweep), metavar="R1,R2,...",
                   help="radii at which the geodesic and adaptive measures are ranked again: their taus and certified "
                        f"fractions across radii in rho_sweep.png and .json (needs a gap; default: {grid})")
    p.add_argument("--sweep-examples", type=positive(int), default=sweep_examples,
                   help="examples the rho sweep measures on, the first of --n-examples; it ranks again at --rho on "
                        f"them (default: {sweep_examples or 'all of --n-examples'})")
    p.add_argument("--quiet", action="store_true", help="no progress bar and no table")


def columns_of(args: argparse.Namespace) -> list[Column]:
    """The leaderboard's columns: every measure asked for in every mode asked for."""
    return [Column(key, mode) for mode in args.mode for key in args.measures]


def sweep_data(args: argparse.Namespace, data: DataSpec) -> DataSpec:
    """The data a rho sweep measures on: the first ``--sweep-examples`` of the leaderboard's examples."""
    n = getattr(args, "sweep_examples", None)
    if n is None or (data.n_examples is not None and n >= data.n_examples):
        return data
    return dataclasses.replace(data, n_examples=n)


def report(board: Leaderboard, paths: dict[str, Path]) -> None:
    """Print the ranked table, the taus and where the files are."""
    print(markdown(board))
    if board.sweep:
        print(sweep_markdown(board.sweep))
    width = max((len(kind) for kind in paths), default=0) + 1  # "sweep plot" is longer than the column was
    for kind, path in paths.items():
        print(f"{kind:{width}s}{path}")


def execute(
    args: argparse.Namespace, model_specs: list[str], data: DataSpec, gap: GapSpec | None
) -> tuple[int, Leaderboard | None]:
    """Run (or resume) the leaderboard into ``args.out`` and write its files; the exit code and the board."""
    quiet_libraries()
    if getattr(args, "rho_sweep", None):  # before any work
        problem = ("--rho-sweep ranks against the gap: give --gap or --gap-splits (or --rho-sweep none)"
                   if gap is None else None)
        if problem is None and not radius_columns(columns_of(args)):
            problem = "--rho-sweep needs a measure with a radius among --measures (inv, mix or adaptive)"
        if problem:
            error(problem)
            return EXIT_BAD_INPUT, None
    store_path = args.out / STORE_FILE
    try:
        for name in ("leaderboard.md", STORE_FILE):  # before any work: a bad --out would lose the whole run
            check_writable(args.out / name, what="--out file")
        models = resolve_models(model_specs)
        with output_lock(args.out):
            store = ResultStore(store_path)  # warns about damaged lines, which it skips
            keep_on_interrupt(f"finished results are kept in {store_path}; rerun the same command to resume")
            trust = getattr(args, "trust_remote_code", False)  # geosharp demo has no such flag: its zoo has no code
            board = run_leaderboard(models, data, columns_of(args), store, settings=settings_of(args), gap=gap,
                                    progress=not args.quiet, trust_remote_code=trust)
            paths = write_outputs(board, args.out)
            if rhos := getattr(args, "rho_sweep", None):
                sweep = rho_sweep(models, sweep_data(args, data), columns_of(args), store, rhos,
                                  settings=settings_of(args), gap=gap, progress=not args.quiet,
                                  trust_remote_code=trust)
                paths.update(write_sweep(sweep, args.out, getattr(args, "sweep_title", "")))
                board.sweep = sweep
    except ModelError as err:  # one model cannot be measured as it is: a rerun with it would fail again
        error(f"{err}\nThe other models' finished results are kept in {store_path} and reused by the next run.")
        return EXIT_BAD_INPUT, None
    except (DataError, OutputPathError, StoreLockedError) as err:
        error(str(err))
        return EXIT_BAD_INPUT, None
    except OSError as err:  # disk full, a quota, a file-size limit: durable writes keep the old files
        error(f"could not write into {str(args.out)!r} ({err.strerror or err}); previous files are unchanged and "
              f"finished results are kept in {store_path}. Free space and rerun the same command to resume.")
        return EXIT_FAILED, None
    except Exception as err:  # noqa: BLE001 - a failed run keeps its finished results: say so, exit 1
        logger.debug("leaderboard failed", exc_info=True)
        what = str(err) if isinstance(err, ModelFailed) else f"{type(err).__name__}: {err}"
        error(f"{what}\nfinished results are kept in {store_path}; rerun the same command to "
              "resume.")
        return EXIT_FAILED, None
    if not args.quiet:
        report(board, paths)
    return EXIT_OK, board
