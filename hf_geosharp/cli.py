"""The ``geosharp`` command line: one sub-command per module in :mod:`hf_geosharp.commands`.

Each command module defines ``add_parser(subparsers)`` (which registers its arguments and sets ``func``) and a
``run(args) -> int`` exit code. Exit codes (:mod:`hf_geosharp.commands.common`): 0 success, 1 failure while running,
2 bad usage or bad input, 130 interrupted with Ctrl-C.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys

from . import __version__
from .commands.common import invoke

COMMANDS = ("run", "symmetry", "register", "leaderboard", "card", "demo", "export_space", "reparametrize")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="geosharp",
        description="Geodesic sharpness: symmetry-invariant sharpness for Hugging Face models.",
    )
    parser.add_argument("--version", action="version", version=f"hf_geosharp {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        importlib.import_module(f"hf_geosharp.commands.{name}").add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    return invoke(_main, argv)  # Ctrl-C, also while the libraries import: exit 130, one line, no traceback


def _main(argv: list[str] | None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
