"""``geosharp register``: make ``evaluate.load("geodesic_sharpness")`` work from any directory, in any new process.

``scripts/install.sh`` runs it; importing the package never registers (importing writes nothing).
"""

from __future__ import annotations

import argparse
import sys

from ..evaluate_module.register import NAME, modules_cache, register_evaluate_module


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``geosharp register``."""
    parser = subparsers.add_parser(
        "register",
        help=f"register the {NAME!r} evaluate module in evaluate's module cache",
        description=f"Write the {NAME!r} loading script into evaluate's module cache (HF_MODULES_CACHE) so that "
        f'evaluate.load("{NAME}") resolves from any working directory, also offline. Idempotent.',
    )
    parser.add_argument("--quiet", action="store_true", help="print nothing")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """Register the evaluate module in evaluate's module cache; the exit code."""
    try:
        target = register_evaluate_module()
    except OSError as err:
        print(
            f"error: could not write to evaluate's module cache: {err}. Set HF_HOME or HF_MODULES_CACHE to a "
            "writable folder, or load the module by path: evaluate.load(hf_geosharp.EVALUATE_MODULE_SCRIPT).",
            file=sys.stderr,
        )
        return 1
    if not args.quiet:
        print(f'registered {NAME}: evaluate.load("{NAME}") now resolves to {target}\n'
              f"It resolves in every process whose evaluate module cache is {modules_cache()} (from HF_HOME or "
              f"HF_MODULES_CACHE); under another HF_HOME run `geosharp register` again, or load the module by path "
              "from any: evaluate.load(hf_geosharp.EVALUATE_MODULE_SCRIPT).")
    return 0
