"""``geosharp symmetry MODEL``: print where a model's GL(h) symmetries live (and optionally audit the dimensions)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

from ..data import DataError
from ..durable import OutputPathError, check_writable, write_json
from ..pipeline import ModelSource, load, symmetry_map
from ..symmetry.audit import MAX_AUDIT_PARAMS, jacobian_rank_audit, random_inputs
from ..symmetry.audit_blocks import block_audit
from ..symmetry.audit_rank import use_float64_attention
from ..symmetry.report import format_report
from .common import EXIT_BAD_INPUT, EXIT_FAILED, EXIT_OK, add_trust_remote_code

logger = logging.getLogger(__name__)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``geosharp symmetry``."""
    p = subparsers.add_parser(
        "symmetry",
        help="show the attention symmetries of a model (GL(h) pairs, orbit and quotient dimensions, conditioning)",
        description="Map a model onto its attention (and LoRA) symmetry group and print the symmetry report: pairs "
        "per kind, orbit and quotient dimensions, unmapped modules, and the conditioning of every head.",
        epilog="exit codes: 0 success; 1 --strict found unmapped attention, or an audit verdict FAIL; 2 bad input "
        "(model cannot be loaded, --audit of a whole model that is too big: use --layers).",
    )
    p.add_argument("model", metavar="MODEL", help="saved model folder or Hub id")
    p.add_argument("--json", type=Path, metavar="PATH", help="also write the report as JSON")
    p.add_argument("--audit", action="store_true",
                   help="also measure the rank of the parameter-to-output Jacobian against the predicted dimension: "
                   "of the whole model (tiny models), or with --layers of those attention blocks (any size)")
    p.add_argument("--layers", type=_layers, metavar="L[,L...]",
                   help="with --audit: audit the attention blocks of these layer indices (e.g. 0 or 0,3), the rest "
                   "frozen, matrix-free; prints predicted and measured rank and 'verdict: PASS' or 'verdict: FAIL'")
    p.add_argument("--strict", action="store_true", help="fail if any attention module cannot be mapped")
    p.add_argument("--params", choices=("all", "trainable"), default="all",
                   help="map all pairs, or only pairs of trainable parameters (default: all)")
    add_trust_remote_code(p)
    p.set_defaults(func=run)


def _layers(text: str) -> list[int]:
    try:
        layers = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--layers takes comma-separated layer indices such as 0 or 0,3; got "
                                         f"{text!r}") from None
    if any(i < 0 for i in layers):
        raise argparse.ArgumentTypeError(f"layer indices are >= 0; got {text!r}")
    return layers


def run(args: argparse.Namespace) -> int:
    """Print (or write) the symmetry report of a model, with the audits asked for; the exit code."""
    if args.layers and not args.audit:
        print("geosharp symmetry: --layers selects the blocks of --audit; add --audit", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        if args.json:
            check_writable(args.json, what="--json")  # before the work, which a bad path would otherwise lose
        model = load(ModelSource(args.model, args.trust_remote_code))
    except (DataError, OutputPathError) as err:
        print(f"geosharp symmetry: {err}", file=sys.stderr)
        return EXIT_BAD_INPUT
    try:
        smap = symmetry_map(model, strict=args.strict, params=args.params)
    except ValueError as err:
        print(f"geosharp symmetry: {err}", file=sys.stderr)
        return EXIT_FAILED
    report = smap.summary(model)
    print(format_report(report))
    code = EXIT_OK
    if args.audit:
        if not args.layers and smap.n_params > MAX_AUDIT_PARAMS:
            print(f"geosharp symmetry --audit: the whole-model audit is for tiny models ({smap.n_params:,} parameters "
                  f"> {MAX_AUDIT_PARAMS:,}); audit chosen attention blocks instead, e.g. --audit --layers 0.",
                  file=sys.stderr)
            return EXIT_BAD_INPUT
        model = model.double()  # numerical rank needs float64 (the model was loaded here, not handed over)
        if hasattr(model, "set_attn_implementation"):  # float64 attention: eager, or sdpa if eager's softmax is float32
            try:
                attention = use_float64_attention(model, random_inputs(model)(torch.Generator().manual_seed(0), 8))
            except ValueError as err:
                print(f"geosharp symmetry --audit: {err}", file=sys.stderr)
                return EXIT_BAD_INPUT
            logger.info("audit attention: %s", attention)
        print()
        try:
            if args.layers:
                results = block_audit(model, args.layers, log=lambda line: print(line, flush=True))
                for result in results:
                    print(result.format())
                report["audit_blocks"] = [r.to_dict() for r in results]
                code = EXIT_OK if all(r.verdict == "PASS" for r in results) else EXIT_FAILED
            else:
                audit = jacobian_rank_audit(model, smap)
                print(audit.format())
                report["audit"] = audit.to_dict()
        except ValueError as err:
            print(f"geosharp symmetry --audit: {err}", file=sys.stderr)
            return EXIT_BAD_INPUT
    if args.json:
        try:
            write_json(args.json, report)
        except OSError as err:  # disk full, quota, a file-size limit: the old file is intact
            print(f"geosharp symmetry: could not write {args.json} ({err.strerror or err}); its previous contents are "
                  "unchanged.", file=sys.stderr)
            return EXIT_FAILED
        logger.info("wrote %s", args.json)
    return code
