"""The ``geosharp`` command line: one sub-command per module in :mod:`hf_geosharp.commands`.

Each command module defines ``add_parser(subparsers)`` (which registers its arguments and sets ``func``) and a
``run(args) -> int`` exit code. Exit codes (:mod:`hf_geosharp.commands.common`): 0 success, 1 failure while running,
2 bad usage or bad input, 130 interrupted with Ctrl-C.

Logging: one handler, on the library's own ``hf_geosharp`` logger (WARNING by default, INFO with ``-v``, DEBUG with
``-vv`` or ``--verbosity``); the root logger and other libraries' loggers are left alone, and third-party progress
bars are turned off, so that what the command prints is its own.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import logging
import os
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

from ._version import __version__
from .commands.common import Parser, exit_process, invoke, quiet_libraries


def _demo_minutes() -> str:
    """``DEMO_MINUTES`` of :mod:`hf_geosharp.commands.demo`, read from its source: the one constant, and ``geosharp
    --help`` imports no command module."""
    import ast

    tree = ast.parse((Path(__file__).parent / "commands" / "demo.py").read_text(encoding="utf-8"))
    return next(str(ast.literal_eval(node.value)) for node in tree.body if isinstance(node, ast.Assign)
                and any(getattr(target, "id", None) == "DEMO_MINUTES" for target in node.targets))


#: Every sub-command: its name, the module of :mod:`hf_geosharp.commands` that defines it, and its one-line help (the
#: same as the module's ``add_parser`` gives it, tested). ``geosharp --help`` lists them from here, so that it imports
#: no command module, nor torch; a command's module is imported only when the command is on the command line.
SUBCOMMANDS = {
    "run": ("run", "measure geodesic (and adaptive) sharpness of a model on a dataset"),
    "symmetry": ("symmetry",
                 "show the attention symmetries of a model (GL(h) pairs, orbit and quotient dimensions, conditioning)"),
    "register": ("register", "register the 'geodesic_sharpness' evaluate module in evaluate's module cache"),
    "leaderboard": ("leaderboard",
                    "rank many models by sharpness; Kendall tau of each measure against the generalisation gap"),
    "card": ("card",
             "publish sharpness results in a model card (model-index) and/or .eval_results, optionally as a Hub PR"),
    "demo": ("demo", "train the embedded zoo of small ViTs on digits and rank them (offline, about "
                     f"{_demo_minutes()} minutes on a 2-core CPU)"),
    "export-space": ("export_space", "write a self-contained Hugging Face Space folder (Gradio app, evaluate "
                                     "module, wheel, requirements)"),
    "reparametrize": ("reparametrize", "save a copy of a model moved along its attention symmetries (same "
                                       "function), optionally adversarially"),
}
COMMANDS = tuple(module for module, _ in SUBCOMMANDS.values())
LEVELS = ("error", "warning", "info", "debug")


class _Handler(logging.StreamHandler):
    """The CLI's handler (so that a second ``main()`` in one process replaces it instead of adding one)."""


class _Formatter(logging.Formatter):
    """``warning: message`` like the commands' own ``error:`` lines; the logger's name only when debugging."""

    def format(self, record: logging.LogRecord) -> str:
        where = f" [{record.name}]" if record.levelno <= logging.DEBUG else ""
        text = f"{record.levelname.lower()}{where}: {record.getMessage()}"
        return text + ("\n" + self.formatException(record.exc_info) if record.exc_info else "")


def configure_logging(level: int) -> None:
    """One stderr handler on the ``hf_geosharp`` logger at ``level``; nothing else is touched."""
    library = logging.getLogger("hf_geosharp")
    for handler in [h for h in library.handlers if isinstance(h, _Handler)]:
        library.removeHandler(handler)
    handler = _Handler(sys.stderr)
    handler.setFormatter(_Formatter())
    library.addHandler(handler)
    library.setLevel(level)


def _add_verbosity(parser: argparse.ArgumentParser, default: object) -> None:
    parser.add_argument("-v", "--verbose", action="count", default=default,
                        help="more log lines from hf_geosharp: -v info, -vv debug")  # fmt: skip
    parser.add_argument("--verbosity", choices=LEVELS, default=default,
                        help="log level of hf_geosharp's own messages (default: warning)")  # fmt: skip
    parser.add_argument("--progress", action="store_true", default=default,
                        help="progress bars also when stderr is not a terminal (a log file, CI; default: on a "
                        "terminal only; HF_GEOSHARP_PROGRESS=1 does the same)")  # fmt: skip


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The ``geosharp`` parser with one sub-command per module of :mod:`hf_geosharp.commands`.

    Args:
        argv: the command line it will parse: only the command named there gets its full parser (its module is
            imported), the others are listed by name and help. ``None``: every command's full parser.

    Returns:
        The parser; ``parse_args`` sets ``func`` to the named command's ``run``.
    """
    parser = Parser(
        prog="geosharp",
        description="Geodesic sharpness: symmetry-invariant sharpness for Hugging Face models.",
    )
    parser.add_argument("--version", action="version", version=f"hf_geosharp {__version__}")
    _add_verbosity(parser, None)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    named = next((arg for arg in argv if arg in SUBCOMMANDS), None) if argv is not None else None
    for name, (module, help_text) in SUBCOMMANDS.items():
        if argv is None or name == named:
            importlib.import_module(f"hf_geosharp.commands.{module}").add_parser(subparsers)
        else:
            subparsers.add_parser(name, help=help_text)
    for sub in subparsers.choices.values():  # also after the command: `geosharp run ... -v`
        _add_verbosity(sub, argparse.SUPPRESS)
    return parser


def level_of(args: argparse.Namespace) -> int:
    """The logging level the verbosity flags ask for (``--verbosity`` wins over ``-v`` counts)."""
    if args.verbosity:
        return getattr(logging, args.verbosity.upper())
    return {0: logging.WARNING, 1: logging.INFO}.get(args.verbose or 0, logging.DEBUG)


def main(argv: list[str] | None = None) -> int:
    """Run ``geosharp`` with ``argv`` (default: the command line) and return its exit code."""
    code = invoke(_main, argv)  # Ctrl-C, also while the libraries import: exit 130, one line, no traceback
    if argv is None:  # the process's own command line (the geosharp script, python -m hf_geosharp): exit now
        exit_process(code)
    return code


def _main(argv: list[str] | None) -> int:
    own_process = argv is None  # the process's own command line (the geosharp script, python -m hf_geosharp)
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    args.argv, args.own_process = argv, own_process  # for a command that runs its command line again
    prepare(args.command, level_of(args))
    from .commands.common import print_progress
    from .engine.progress import progress_lines
    from .engine.result import command_line_words

    options = option_names(parser, args.command)
    with command_line_words(options), _progress_forced(bool(getattr(args, "progress", None))), \
            progress_lines(print_progress):  # plain lines where a log gets no bar
        return int(args.func(args) or 0)  # advice names this command's options (--steps auto), not Python arguments


def option_names(parser: argparse.ArgumentParser, command: str) -> frozenset[str]:
    """Every option string ``geosharp COMMAND`` accepts (``--steps``, ``-v``, ...): what its advice may name.

    Args:
        parser: the ``geosharp`` parser (:func:`build_parser`).
        command: the sub-command's name.

    Returns:
        The option strings of the command's parser.
    """
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return frozenset(s for action in subparsers.choices[command]._actions for s in action.option_strings)


@contextlib.contextmanager
def _progress_forced(forced: bool) -> Iterator[None]:
    """With ``--progress``: ``HF_GEOSHARP_PROGRESS=1`` while the command runs (its launched processes inherit it)."""
    if not forced:
        yield
        return
    name, previous = "HF_GEOSHARP_PROGRESS", os.environ.get("HF_GEOSHARP_PROGRESS")
    os.environ[name] = "1"
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = previous


def prepare(command: str, level: int) -> None:
    """What the command's output needs before it runs: our log lines only, and no third-party progress bars (turned
    off before the command loads, trains, saves or maps anything; ``register`` imports no third-party library)."""
    configure_logging(level)
    # the engine says a worst case is not converged by a NotConvergedWarning; here it is one of our log lines
    from .api import NotConvergedWarning

    show = warnings.showwarning
    if not getattr(show, "logs_not_converged", False):  # once per process (tests call main() many times)

        def show_as_log_line(message, category, *args, **kwargs):  # noqa: ANN001, ANN202 (showwarning's shape)
            if issubclass(category, NotConvergedWarning):
                logging.getLogger("hf_geosharp").warning("%s", message)
            else:
                show(message, category, *args, **kwargs)

        show_as_log_line.logs_not_converged = True
        warnings.showwarning = show_as_log_line
    if command != "register":
        quiet_libraries()


if __name__ == "__main__":
    sys.exit(main())
