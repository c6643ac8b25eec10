"""``python -m experiments.minilm_family``: train, measure and report (see the package's docstring)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import re

from hf_geosharp.commands.common import Parser, file_path, folder_path, positive
from hf_geosharp.zoo import cache_root, torch_threads

from . import __doc__ as PACKAGE_DOC
from .config import DOC, RESULTS, STORE, Config, installed, members
from .cost import status
from .prose import doc_problem, tables_markdown
from .report import report
from .runner import run, spot_check


def _shard(text: str) -> tuple[int, int]:
    """``--shard K/N``."""
    match = re.fullmatch(r"(\d+)/(\d+)", text)
    if not match or not 0 <= int(match[1]) < int(match[2]):
        raise argparse.ArgumentTypeError(f"--shard takes K/N with 0 <= K < N, got {text!r}")
    return int(match[1]), int(match[2])



def build_parser() -> argparse.ArgumentParser:
    """The command line; every argument is checked by its type (usage errors: one line, exit 2)."""
    parser = Parser(prog="python -m experiments.minilm_family", description=PACKAGE_DOC.splitlines()[0])
    parser.add_argument("--cache", type=folder_path, default=None,
                        help="members, corpus and result store (default $HF_GEOSHARP_CACHE/minilm_family)")
    parser.add_argument("--n-models", type=positive(int), default=Config.n_models)
    parser.add_argument("--store", type=file_path, default=STORE,
                        help=f"the result store, appended to as numbers are measured (default {STORE}: committed, so "
                             "that a sitting on a fresh machine measures only what is missing)")
    parser.add_argument("--library", default=None, metavar="VERSION",
                        help="--status, --report, --spot-check: the hf_geosharp version whose numbers to read (default "
                             "the installed one; a run always measures with the installed one)")
    parser.add_argument("--previous", default=None, metavar="VERSION",
                        help="--report: compare the main numbers with those this hf_geosharp version stored")
    parser.add_argument("--spot-check", default=None, metavar="MEMBER",
                        help="measure MEMBER's main numbers again with the installed library and compare them with "
                             "those of --library (writes minilm_family_spot_check.json into --out)")
    parser.add_argument("--out", type=folder_path, default=RESULTS,
                        help="where the JSON and PNG go (default docs/results)")
    parser.add_argument("--doc", type=file_path, default=DOC, help="the doc whose generated section is rewritten")
    parser.add_argument("--status", action="store_true", help="print progress and the remaining time; compute nothing")
    parser.add_argument("--report", action="store_true", help="write the JSON, figure and doc tables from the store")
    parser.add_argument("--calibrated-library", default=None, metavar="VERSION",
                        help="--report: the hf_geosharp version whose calibrated-ball numbers to show (default the "
                             "installed one)")
    parser.add_argument("--stages", default="train,main,adversarial,sweep,calibrated",
                        help="comma-separated stages to run (default all, in this order)")
    parser.add_argument("--shard", type=_shard, default=(0, 1),
                        help="K/N: this process does the members whose index is K mod N (N processes share the store)")
    parser.add_argument("--no-report", action="store_true",
                        help="do not write the report at the end of a run")
    parser.add_argument("--threads", type=positive(int), default=1,
                        help="torch threads (default 1: reproducible, cheapest)")
    return parser


STAGES = ("train", "main", "adversarial", "sweep", "calibrated")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The arguments, with what depends on several of them checked before any work: the member ``--spot-check``
    names, the stages, ``--library`` only where numbers are read, and the doc a report rewrites."""
    parser = build_parser()
    args = parser.parse_args(argv)
    config = dataclasses.replace(Config(), n_models=args.n_models)
    names = [m.name for m in members(config)]
    if args.spot_check is not None and args.spot_check not in names:
        parser.error(f"--spot-check {args.spot_check!r} is not a member of the {len(names)}-model family "
                     f"({names[0]} .. {names[-1]})")
    args.stages = tuple(s.strip() for s in args.stages.split(",") if s.strip())
    if not args.stages or set(args.stages) - set(STAGES):
        parser.error(f"--stages {','.join(args.stages) or repr('')}: use some of {','.join(STAGES)}")
    reads = args.status or args.report or args.spot_check
    if not reads and args.library not in (None, installed()):
        parser.error(f"--library {args.library}: a run measures with the installed hf_geosharp {installed()}; use "
                     "--library with --status, --report or --spot-check")
    if (args.report or not (reads or args.no_report)) and not args.status:
        problem = doc_problem(args.doc)
        if problem:
            parser.error(f"--doc {str(args.doc)!r} {problem}; pass the doc to rewrite, or --no-report")
    return args



def main(argv: list[str] | None = None) -> None:
    """``python -m experiments.minilm_family``: train, measure, report (see the module docstring)."""
    args = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    config = dataclasses.replace(Config(), n_models=args.n_models)
    cache = args.cache or cache_root() / "minilm_family"
    if args.status:
        print(status(config, cache, args.store, args.library))
        return
    if args.spot_check:
        checked = spot_check(config, cache, args.spot_check, args.out, library=args.library or installed(),
                             store=args.store)
        print(json.dumps(checked, indent=1))
        return
    if args.report:
        out = report(config, cache, args.out, doc=args.doc, store=args.store, library=args.library,
                     previous=args.previous, calibrated_library=args.calibrated_library)
        print(tables_markdown(out, figure_link=False, versions=True))
        return
    with torch_threads(args.threads):
        run(config, cache, None if args.no_report else args.out, doc=None if args.no_report else args.doc,
            shard=args.shard, stages=args.stages, store=args.store)
    print(status(config, cache, args.store))
