"""``geosharp reparametrize MODEL OUT``: save a copy of a model moved along its symmetry group (same function).

A random group element by default, or with ``--hide flat|sharp`` the element that makes adaptive sharpness as small or
as large as :func:`hf_geosharp.hide` finds. The copy is written with ``save_pretrained`` (with the model's tokenizer or
image processor) into a staging folder next to ``OUT`` and put in place by :func:`hf_geosharp.durable.replace_dir`:
at every instant ``OUT`` is the old folder or the new one, complete, also on Ctrl-C (whose message says which);
``MODEL`` is never written. The function check (the largest output change on the probe batches, relative to the
largest output) is printed.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import Any

import torch

from .. import durable
from ..data import DataError, DataSpec, load_batches, load_processor
from ..hiding import DEFAULT_CONDITION, FunctionChangedError, hide, reparametrize_checked
from ..measures import Settings
from ..pipeline import ModelSource, load
from .common import (
    EXIT_BAD_INPUT,
    EXIT_FAILED,
    EXIT_OK,
    add_trust_remote_code,
    keep_on_interrupt,
    positive,
    quiet_libraries,
    seed,
)

logger = logging.getLogger(__name__)

DEFAULTS = Settings()

RECORD = "geosharp_reparametrize.json"
#: ``--hide``'s default condition: on the README's tiny BERT (float64, 32 examples), --hide sharp moved adaptive
#: sharpness x1.003 at 100, x1.18 at 1e3, x4.7 at 1e4 and x16 at 1e5 (no further at 1e6).
HIDE_CONDITION = 1e5


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``geosharp reparametrize``."""
    p = subparsers.add_parser(
        "reparametrize",
        help="save a copy of a model moved along its attention symmetries (same function), optionally adversarially",
        description="Apply an element of the model's symmetry group (a random one, or with --hide the one that "
        "makes adaptive sharpness look flat or sharp), check that the outputs did not change, and save the copy "
        "to OUT with save_pretrained. MODEL itself is never written.",
        epilog="exit codes: 0 success; 1 the function check failed (nothing written); 2 bad input.",
    )
    p.add_argument("model", metavar="MODEL", help="saved model folder or Hub id")
    p.add_argument("out", metavar="OUT", type=Path, help="folder for the transformed copy (new or empty)")
    p.add_argument("--hide", choices=("flat", "sharp"), help="search for the element that makes adaptive sharpness "
                   "look flat or sharp (needs --dataset: the search uses the loss's gradients)")
    p.add_argument("--condition", type=float, help="largest condition number of each head's group element "
                   f"(default: {DEFAULT_CONDITION:g}; with --hide {HIDE_CONDITION:g}, where a smaller one barely moves "
                   "adaptive sharpness)")
    p.add_argument("--seed", type=seed, default=DEFAULTS.seed,
                   help="seed of the group element or of the search (default: %(default)s)")
    p.add_argument("--dataset", help="dataset for the probe and --hide (default without --hide: random inputs)")
    p.add_argument("--split", default="train", help="split of --dataset (default: train)")
    p.add_argument("--n-examples", type=positive(int), default=32, help="examples of --dataset (default: 32)")
    p.add_argument("--batch-size", type=positive(int), default=16, help="examples per batch (default: 16)")
    p.add_argument("--rho", type=positive(float), default=DEFAULTS.rho,
                   help="with --hide: the radius of adaptive sharpness (default: %(default)s)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty OUT")
    add_trust_remote_code(p)
    p.set_defaults(func=run)


def _problem(args: argparse.Namespace) -> str | None:
    """The usage error, if any (checked before anything is loaded)."""
    if args.condition is None:
        args.condition = HIDE_CONDITION if args.hide else DEFAULT_CONDITION
    if args.hide and not args.dataset:
        return "--hide needs --dataset: the search follows the loss's gradients on real examples."
    if not args.condition >= 1.0:
        return f"--condition must be >= 1 (got {args.condition})."
    if args.n_examples < 1 or args.batch_size < 1:
        return "--n-examples and --batch-size must be at least 1."
    out = args.out.resolve()
    source = Path(args.model).resolve()
    if Path(args.model).exists() and (out == source or source in out.parents):
        return f"OUT {str(args.out)!r} is (inside) MODEL; choose a new folder: MODEL is never written."
    if Path(args.model).exists() and out in source.parents:  # replacing OUT would delete MODEL with it
        return f"OUT {str(args.out)!r} holds MODEL; choose a new folder: MODEL is never written."
    if out.exists() and not out.is_dir():
        return f"OUT {str(args.out)!r} is a file; choose a folder."
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        return f"OUT {str(args.out)!r} is not empty; choose a new folder or pass --overwrite."
    durable.check_writable(out / RECORD, what="OUT")
    return None


def _random_batches(model: torch.nn.Module, seed: int) -> list[dict[str, torch.Tensor]]:
    """Random probe inputs from the config alone (tokens, or images): enough to see a changed function."""
    config, generator = model.config, torch.Generator().manual_seed(seed)
    if getattr(model, "main_input_name", "input_ids") == "pixel_values":
        size = getattr(config, "image_size", 224)
        size = (size, size) if isinstance(size, int) else tuple(size)
        shape = (4, getattr(config, "num_channels", 3), *size)
        return [{"pixel_values": torch.randn(shape, generator=generator).to(model.dtype)}]
    if getattr(config, "vocab_size", None) is None:
        raise DataError("cannot make random inputs for this model; pass --dataset.")
    length = min(16, getattr(config, "max_position_embeddings", 16) or 16)
    return [{"input_ids": torch.randint(0, config.vocab_size, (4, length), generator=generator)}]


def run(args: argparse.Namespace) -> int:
    """Move the model along its symmetries (random or ``--hide``), check the function and save it; the exit code."""
    try:
        problem = _problem(args)
    except durable.OutputPathError as err:
        problem = str(err)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        return EXIT_BAD_INPUT
    quiet_libraries()
    try:
        model = load(ModelSource(args.model, args.trust_remote_code))
        processor = _processor(args.model, model, args.trust_remote_code)
        if args.dataset:
            spec = DataSpec(dataset=args.dataset, split=args.split, n_examples=args.n_examples,
                            batch_size=args.batch_size, seed=args.seed)
            batches = load_batches(model, processor, spec)
        else:
            batches = _random_batches(model, args.seed)
    except DataError as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    record: dict[str, Any] = {"source": args.model, "seed": args.seed, "condition": args.condition,
                              "hide": args.hide}
    try:
        if args.hide:
            result = hide(model, batches, target=args.hide, condition=args.condition, seed=args.seed,
                          settings=Settings(rho=args.rho, seed=args.seed))
            record |= result.to_dict()
        else:
            _, deviation = reparametrize_checked(model, batches, seed=args.seed, condition=args.condition)
            record["max_output_deviation"] = deviation
    except (FunctionChangedError, ValueError) as err:
        print(f"error: {err}", file=sys.stderr)
        return EXIT_FAILED if isinstance(err, FunctionChangedError) else EXIT_BAD_INPUT
    out = args.out.resolve()
    unchanged = f"nothing was written ({args.out} is as it was)" if out.exists() else "nothing was written"
    keep_on_interrupt(unchanged)
    committed = f"the new copy in {args.out} is complete"
    try:
        with durable.staged_dir(out, on_commit=lambda: keep_on_interrupt(committed)) as tmp:
            model.save_pretrained(tmp)
            if processor is not None:
                processor.save_pretrained(tmp)
            durable.write_json(tmp / RECORD, record)
    except OSError as err:  # disk full, a quota: the staging folder is gone and OUT untouched
        print(f"error: could not write {str(args.out)!r} ({err.strerror or err}); {unchanged}.", file=sys.stderr)
        return EXIT_FAILED
    what = f"hide={args.hide}" if args.hide else "a random element"
    print(f"reparametrized {args.model} with {what} (condition <= {args.condition:g}, seed {args.seed}) -> {args.out}")
    print(f"function check: max |output change| / max |output| = {record['max_output_deviation']:.3g} "
          f"on {sum(len(next(iter(b.values()))) for b in batches)} probe inputs")
    if args.hide:
        print(f"adaptive sharpness: {record['value_before']:.6g} -> {record['value_after']:.6g} "
              f"(x{record['factor']:.3g}); geodesic sharpness is unchanged by construction")
        hint = _further(record["factor"], args)
        if hint:
            print(hint)
    return EXIT_OK


#: Below this factor (or above its inverse for --hide flat) the move is small enough to say how to make it larger.
SMALL_MOVE = 10.0


def _further(factor: float, args: argparse.Namespace) -> str | None:
    """What to pass to move adaptive sharpness further, when ``--hide`` moved it by less than :data:`SMALL_MOVE`: a
    larger ``--condition`` (the group elements may then stretch each head more; the function check still holds
    them)."""
    moved = factor if args.hide == "sharp" else 1.0 / factor if factor > 0 else float("inf")
    if not moved < SMALL_MOVE:
        return None
    return (f"adaptive sharpness moved by x{moved:.3g} only at --condition {args.condition:g}; a larger one may move "
            f"it further (e.g. --condition {args.condition * 10:g}; the function check refuses an element that "
            "changes the outputs)")


def _processor(model_id: str, model: torch.nn.Module, trust_remote_code: bool) -> Any:
    """The tokenizer or image processor saved with the model, or ``None`` (the copy is then weights only)."""
    try:
        return load_processor(model_id, model, trust_remote_code=trust_remote_code)
    except DataError:
        logger.warning("no tokenizer or image processor found with %s; the copy holds the model only", model_id)
        return None
