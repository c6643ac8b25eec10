"""``geosharp run``: geodesic (and adaptive) sharpness of a saved model on a dataset, from the shell.

Under ``accelerate launch --multi_gpu --num_processes N -m hf_geosharp run ...`` or ``torchrun`` (``WORLD_SIZE`` > 1)
every process loads the same model and builds the same batches; the engine shares the batches out, gathers the
per-batch values, and only rank 0 prints and writes files. With ``--fsdp`` (``torchrun --nproc_per_node N -m
hf_geosharp run --fsdp ...``) the model is sharded over the ranks instead, which solve every batch together (see
:mod:`hf_geosharp.pipeline.launch`).

Results files (``--json PATH``, or ``--output-path DIR`` for ``DIR/<model>/results_<timestamp>.json`` as
lm-evaluation-harness lays them out) carry the results per measure key (``<key>``, ``<key>_stderr``, per-batch values,
convergence), ``higher_is_better``, the run's ``config``, package ``versions``, an ISO 8601 ``date``, the
``environment`` (device, platform) and the model's identity (content sha256 of its files, weight-file sha256s, or the
Hub revision).
"""

from __future__ import annotations

import argparse
import datetime
import logging
import math
import sys
from pathlib import Path
from typing import Any

import torch

from ..data import (
    DataError,
    DataSpec,
    check_source,
    load_batches,
    load_processor,
    require_model,
    require_task,
)
from ..durable import OutputPathError, check_writable, write_json
from ..measures import DEFAULT_MEASURES, MEASURES, Settings, parse_measures, spec
from ..pipeline import ModelSource, Request, load, prepare
from ..pipeline.launch import FSDP_LAUNCH, Launch, launch_warning, start
from .common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    add_measure_options,
    add_trust_remote_code,
    keep_on_interrupt,
    positive,
    quiet_libraries,
    settings_of,
)
from .run_results import (
    RunContext,
    check_distinct,
    model_file,
    model_folder_name,
    payload,
    print_header,
    profile_path,
    write_results,
)

logger = logging.getLogger(__name__)

METRICS = tuple(m.metric for m in MEASURES.values() if m.metric)  # the geodesic metrics: inv, mix
DTYPES = ("float32", "float64", "bfloat16", "float16")
#: The families whose worst case has a direction, which ``--profile`` draws and ``--by-layer`` breaks down.
DIRECTED = ("geodesic", "adaptive")
#: Points of ``--profile``'s curves on ``[0, 2 rho]`` (odd: ``rho`` itself is one of them).
PROFILE_POINTS = 21

EPILOG = """\
examples are the first --n-examples rows of the split after a shuffle seeded by --seed (--no-shuffle: file order);
a split with fewer rows is used whole, with a warning.
--head measures the encoder together with a NEW linear head initialised from --seed, not a trained classifier.
--fsdp needs a distributed launch: torchrun --nproc_per_node N -m hf_geosharp run --fsdp ... (gloo on CPU, NCCL on
GPUs); every rank loads the model and all batches, and holds its shard of the weights and of the solver state.
exit codes: 0 success; 1 the run failed or a value is not finite; 2 bad usage or input (model, dataset, columns);
130 interrupted (Ctrl-C). Under --fsdp every rank exits with the same code.
"""


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every default in --help (``inv,mix`` for a list), unless the help text already says it; the epilog's line
    breaks are kept."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (
            "default:" in text
            or action.default is None
            or action.default is False
            or action.default == argparse.SUPPRESS
        ):
            return text
        value = ",".join(map(str, action.default)) if isinstance(action.default, list) else action.default
        return f"{text} (default: {value})"


def _metrics(text: str) -> list[str]:
    metrics = [m.strip() for m in text.split(",") if m.strip()]
    bad = [m for m in metrics if m not in METRICS]
    if bad or not metrics:
        raise argparse.ArgumentTypeError(f"{text!r}: use a comma-separated list of {', '.join(METRICS)}")
    return metrics


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``geosharp run``."""
    default_metrics = [spec(k).metric for k in DEFAULT_MEASURES if spec(k).metric]
    p = subparsers.add_parser(
        "run",
        help="measure geodesic (and adaptive) sharpness of a model on a dataset",
        description="Measure geodesic sharpness, and adaptive sharpness as a baseline, of a model on batches of a\n"
        "dataset; print a table and optionally write a results file.",
        epilog=EPILOG,
        formatter_class=HelpFormatter,
    )
    p.add_argument("--model", required=True, help="saved model folder or Hub id, with its task head and tokenizer")
    p.add_argument(
        "--dataset",
        required=True,
        help="Hub dataset (name or name:config) or local csv/tsv/json/jsonl/parquet file, save_to_disk folder, "
        "folder of data files or imagefolder",
    )
    p.add_argument("--config", help="Hub dataset configuration")
    p.add_argument("--split", default="train", help="dataset split")
    p.add_argument("--n-examples", type=positive(int), default=DataSpec.n_examples, help="examples to use at most")
    p.add_argument("--batch-size", type=positive(int), default=DataSpec.batch_size, help="examples per batch")
    p.add_argument("--metric", type=_metrics, default=default_metrics, help="geodesic metrics, comma-separated")
    p.add_argument(
        "--baseline",
        action=argparse.BooleanOptionalAction,
        default="adaptive_sharpness" in DEFAULT_MEASURES,
        help="also measure adaptive sharpness (the baseline)",
    )
    add_measure_options(p, DEFAULT_MEASURES, measures_instead_of="--metric/--baseline")
    p.add_argument("--no-shuffle", action="store_true", help="take the first --n-examples rows in file order")
    p.add_argument("--max-length", type=positive(int), default=DataSpec.max_length, help="tokenizer truncation length")
    p.add_argument("--text-column", help="text column (default: found by name)")
    p.add_argument("--text-pair-column", help="second text column for sentence pairs")
    p.add_argument("--label-column", help="label column (default: a ClassLabel column or 'label', 'labels', ...)")
    p.add_argument("--image-column", help="image column of a vision dataset")
    p.add_argument("--device", help="cpu, cuda, cuda:1, mps, ... (default: cuda when available, else cpu)")
    p.add_argument("--dtype", choices=DTYPES, help="cast the model and float inputs to it (default: as saved)")
    p.add_argument("--head", action="store_true",
                   help="attach a new seeded linear classification head to an encoder without one (e.g. a "
                   "sentence-transformers BertModel); the numbers then describe that encoder+head")  # fmt: skip
    p.add_argument("--num-labels", type=positive(int), default=2, help="classes of the --head")
    p.add_argument("--json", type=Path, help="write the results to this JSON file")
    p.add_argument("--output-path", type=Path,
                   help="write DIR/<model>/results_<timestamp>.json (lm-evaluation-harness layout)")  # fmt: skip
    p.add_argument("--quiet", action="store_true",
                   help="no progress bars and no header; the table only when no results file is written")  # fmt: skip
    p.add_argument("--fsdp", action="store_true",
                   help="shard the model with FSDP2 over the ranks of a distributed launch, each holding its share "
                   f"of the weights and of the solver state ({FSDP_LAUNCH})")  # fmt: skip
    p.add_argument("--by-layer", action="store_true",
                   help="print where each worst case's perturbation sits: per layer its share of the norm and of "
                   "the loss increase's first-order term, and the top heads (docs/where.md)")  # fmt: skip
    p.add_argument("--profile", type=Path, nargs="?", const=Path("."), metavar="DIR",
                   help="draw the loss along each worst direction from 0 to 2 rho (geodesic, straight segment, "
                   "adaptive worst case) into DIR/<model>_profile.png (default DIR: .)")  # fmt: skip
    add_trust_remote_code(p)
    p.set_defaults(func=run)


# ---------------------------------------------------------------------------------------------------------- models


def _load(args: argparse.Namespace) -> Any:
    """The model to measure: as saved, or (``--head``) with a new linear head initialised from ``--seed``."""
    return load(ModelSource(args.model, args.trust_remote_code, args.num_labels if args.head else None, args.seed))


def _device(args: argparse.Namespace, accelerator: Any) -> Any:
    """``--device`` (checked by allocating on it), the launcher's device, or CUDA when available."""
    if accelerator is not None:
        if args.device:
            raise DataError("--device does not apply under a launcher: each process uses the device it is given.")
        return accelerator.device
    if args.device:
        try:
            device = torch.device(args.device)
            torch.empty(0, device=device)
        except (RuntimeError, AssertionError) as err:
            raise DataError(f"--device {args.device!r} is not usable here: {err}") from None
        return device
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _cast_inputs(batches: list[dict], dtype: Any) -> list[dict]:
    """Floating-point inputs (pixels, float labels) in the model's dtype; token ids stay integers."""
    return [{k: v.to(dtype) if v.is_floating_point() else v for k, v in b.items()} for b in batches]


# ------------------------------------------------------------------------------------------------------------- run


def run(args: argparse.Namespace) -> int:
    """Measure a model on a dataset, print the table and write the results; the exit code."""
    quiet_libraries()
    if problem := _no_output(args):
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        launch = start(args.fsdp)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        code = _run(args, launch)
    finally:
        launch.close()
    return launch.exit(code)


def _run(args: argparse.Namespace, launch: Launch) -> int:
    main = launch.main
    if args.quiet or not main:  # sharded, every rank has rank 0's results, and its warnings
        logging.getLogger("hf_geosharp").setLevel(logging.ERROR if launch.fsdp and not main else logging.WARNING)

    def fail(code: int, message: str) -> int:
        if main:
            print(f"error: {message}", file=sys.stderr)
        return launch.agree(code)

    warning = None if launch.fsdp else launch_warning(launch.world)
    if warning and main:
        print(f"warning: {warning}", file=sys.stderr)
    keys, settings, spec_ = _what_to_run(args)
    started = datetime.datetime.now(datetime.timezone.utc)
    try:
        outputs = _outputs(args, started, check=main)
        device, model, batches = _model_and_batches(args, launch, spec_)
    except (DataError, OutputPathError) as err:
        return fail(EXIT_BAD_INPUT, str(err))
    if code := launch.agree(EXIT_OK):  # another rank could not start (its code): stop here with it
        return code

    n_examples = sum(len(next(iter(b.values()))) for b in batches)
    show = main and not args.quiet
    timed: list[tuple[str, Any, float]] = []
    context = RunContext(args=args, model=model, spec=spec_, batches=batches, n_examples=n_examples, keys=keys,
                         settings=settings, world_size=launch.world, device=device, started=started,
                         fsdp=launch.fsdp, model_class=type(model).__name__)  # fmt: skip
    try:
        _measure(context, launch, show, timed, outputs if main else [])
    except ValueError as err:  # the engine refuses inputs it cannot measure (dtype, parameters, ...)
        return fail(EXIT_BAD_INPUT, str(err))
    except Exception as err:  # noqa: BLE001 - any other failure is a failed run: exit 1, traceback with -v
        logger.debug("run failed", exc_info=True)
        return fail(EXIT_FAILED, f"the measurement failed: {type(err).__name__}: {err}")

    if main and (problem := write_results(context, timed, outputs, show)):
        return fail(EXIT_FAILED, problem)
    bad = [key for key, res, _ in timed if not math.isfinite(res.value)]
    if bad:
        return fail(EXIT_FAILED, f"non-finite sharpness for {', '.join(bad)}; try a smaller --rho or check the model.")
    return launch.agree(EXIT_OK)


def _no_output(args: argparse.Namespace) -> str | None:
    """An option that no measure of the run could serve (``--profile``, ``--by-layer``: they read a worst case's
    direction), said before any work rather than after it."""
    asked = [words for words, on in (("--profile draws", getattr(args, "profile", None) is not None),
                                     ("--by-layer breaks down", getattr(args, "by_layer", False))) if on]  # fmt: skip
    if not asked:
        return None
    said, flags = " and ".join(asked), " and ".join(words.split()[0] for words in asked)
    if args.mode != "worst" or args.fsdp:
        return f"{said} the worst case's direction: use --mode worst, without --fsdp."
    keys = _keys(args)
    if not any(spec(k).family in DIRECTED for k in keys):
        names = ", ".join(spec(k).short or k for k in keys)
        return (f"{said} a worst case's direction, which only geodesic and adaptive sharpness have (this run "
                f"measures {names}): add inv, mix or adaptive to --measures, or drop {flags}.")
    return None


def _keys(args: argparse.Namespace) -> list[str]:
    """The measure keys: ``--measures``, else ``--metric`` and ``--baseline``."""
    return args.measures or parse_measures(args.metric + (["adaptive"] if args.baseline else []))


def _what_to_run(args: argparse.Namespace) -> tuple[list[str], Settings, DataSpec]:
    """The measure keys, the solver settings and the data, from the arguments alone."""
    keys = _keys(args)
    settings = settings_of(args)
    spec_ = DataSpec(
        dataset=args.dataset, config=args.config, split=args.split, n_examples=args.n_examples,
        batch_size=args.batch_size, seed=args.seed, shuffle=not args.no_shuffle, max_length=args.max_length,
        text_column=args.text_column, text_pair_column=args.text_pair_column, label_column=args.label_column,
        image_column=args.image_column,
    )  # fmt: skip
    return keys, settings, spec_


def _outputs(args: argparse.Namespace, started: datetime.datetime, *, check: bool) -> list[Path]:
    """The results files (``--json``, ``--output-path``); with ``check`` (rank 0) each is checked before the work,
    which a bad path would otherwise lose."""
    outputs = [args.json] if args.json else []
    if args.output_path:
        stamp = started.strftime("%Y-%m-%dT%H-%M-%S.%f")  # lm-evaluation-harness's file name, in UTC
        outputs.append(args.output_path / model_folder_name(args.model) / f"results_{stamp}.json")
    if check:
        named = [(path, "--json" if path == args.json else "--output-path file") for path in outputs]
        if args.profile is not None:
            named.append((profile_path(args.profile, args.model), "--profile figure"))
        for path, what in named:
            check_writable(path, what=what)
        check_distinct(named, _inputs(args))
    return outputs


def _inputs(args: argparse.Namespace) -> list[tuple[Path, str]]:
    """The files the run reads, which no output may replace: the dataset file and the model folder's own files."""
    inputs = [(Path(args.dataset), "--dataset")] if Path(args.dataset).is_file() else []
    model = Path(args.model)
    if model.is_dir():
        inputs += [(path, "a file of --model") for path in model.iterdir() if path.is_file() and model_file(path.name)]
    return inputs


def _model_and_batches(args: argparse.Namespace, launch: Launch, spec_: DataSpec) -> tuple[Any, Any, list]:
    """The device, the model on it (in ``--dtype``) and the batches. Under ``--fsdp`` the model stays where it was
    loaded until it is sharded: sharding moves each rank's shards to its device."""
    if launch.fsdp and args.device:
        raise DataError("--device does not apply with --fsdp: each rank uses its own GPU (LOCAL_RANK), or the CPU.")
    device = launch.device if launch.fsdp else _device(args, launch.accelerator)
    require_model(args.model)  # both paths (and a Hub id the Hub cannot serve) before any loading
    check_source(spec_)
    model = _load(args)
    require_task(model)  # before any data work: a model without a loss cannot be measured
    dtype = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    model.to(**dtype) if launch.fsdp else model.to(device=device, **dtype)
    processor = load_processor(args.model, model, trust_remote_code=args.trust_remote_code)
    with launch.main_first():  # rank 0 fills the datasets cache, the others then read it
        batches = load_batches(model, processor, spec_)
    if args.dtype:
        batches = _cast_inputs(batches, next(model.parameters()).dtype)
    return device, model, batches


def _measure(c: RunContext, launch: Launch, show: bool, timed: list, outputs: list[Path]) -> None:
    """Prepare the measurement (the pipeline maps the symmetries, under ``--fsdp`` on the unsharded model, which it
    then shards), print the header and the time estimate, and run every measure, appending to ``timed``. On Ctrl-C
    the finished measures are written to ``outputs`` (marked interrupted) before it propagates."""
    request = Request(c.model, c.batches, c.keys, c.settings, fsdp=launch.fsdp, accelerator=launch.accelerator,
                      progress=show, profile_points=PROFILE_POINTS if c.args.profile is not None else 0,
                      map_always=True)  # the header reports the map
    try:
        prepared = prepare(request)
        c.symmetry = prepared.symmetry_report
        if show:
            print_header(c)
        if show or (launch.fsdp and not c.args.quiet):  # sharded, every rank takes part in the estimate's solve
            estimate = prepared.estimate_seconds()
            shown = f"{estimate:,.0f}" if estimate >= 10 else f"{estimate:.1f}"
            bound = "at least " if c.settings.steps == "auto" else ""
            if show:
                print(f"estimated {bound}{shown} s (from a timed first solver step per measure)\n", flush=True)
        prepared.measure(on_result=lambda key, res, seconds: timed.append((key, res, seconds)))
    except KeyboardInterrupt:
        if timed and outputs:
            for path in outputs:
                write_json(path, payload(c, timed, interrupted=True))
            keep_on_interrupt(f"the {len(timed)} finished measure(s) are in {outputs[0]} (marked interrupted)")
        raise
