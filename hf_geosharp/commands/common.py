"""What every ``geosharp`` command shares: exit codes, argument types, the remote-code flag, quiet third-party
libraries and Ctrl-C handling, defined once so that the commands behave alike.

Exit codes: 0 success; 1 the run failed (or a value is not finite); 2 bad usage or bad input, found before the
expensive work; 130 interrupted with Ctrl-C (what had finished is kept, and the message says where).
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; numpy (the example shuffle) needs them non-negative

TRUST_HELP = (
    "allow running the Python code a model folder or Hub repo ships for its classes (config.json auto_map); "
    "off by default, and never asked interactively"
)


def _number(kind: type, text: str) -> Any:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not {'an integer' if kind is int else 'a number'}") from None


def positive(kind: type) -> Callable[[str], Any]:
    """An argparse type: a finite number above 0."""

    def parse(text: str) -> Any:
        value = _number(kind, text)
        if not value > 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse


def steps_arg(text: str) -> int | str:
    """An argparse type: a positive number of solver steps, or ``auto`` (continue until certified)."""
    return "auto" if text == "auto" else positive(int)(text)


def non_negative(kind: type) -> Callable[[str], Any]:
    """An argparse type: a finite number >= 0 (e.g. ``--epsilon 0``, which the invariance examples use)."""

    def parse(text: str) -> Any:
        value = _number(kind, text)
        if not value >= 0 or value == float("inf"):
            raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def seed(text: str) -> int:
    """An argparse type: a seed in 0 .. 2**63-1 (the example shuffle cannot take negative seeds)."""
    value = _number(int, text)
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(f"must be an integer in 0..2**63-1, got {text}; e.g. --seed 0")
    return value


def comma_list(allowed: tuple[str, ...]) -> Callable[[str], list[str]]:
    """An argparse type: a comma-separated list of ``allowed`` values, duplicates dropped, order kept."""

    def parse(text: str) -> list[str]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items or any(i not in allowed for i in items):
            raise argparse.ArgumentTypeError(f"{text!r}: use a comma-separated list of {', '.join(allowed)}")
        return list(dict.fromkeys(items))

    parse.__name__ = "list"
    return parse


def measure_keys(text: str) -> list[str]:
    """An argparse type: measure keys of the registry or their short forms, comma-separated."""
    from ..measures import parse_measures  # the registry imports torch: only once a command parses its arguments

    try:
        return parse_measures(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_trust_remote_code(parser: argparse.ArgumentParser) -> None:
    """``--trust-remote-code``: the only way a command runs a model's own Python code."""
    parser.add_argument("--trust-remote-code", action="store_true", help=TRUST_HELP)


def quiet_libraries() -> None:
    """The loading bars and advice of transformers, datasets and huggingface_hub would bury our progress bars and
    errors."""
    import datasets
    import huggingface_hub
    import transformers

    datasets.disable_progress_bars()
    huggingface_hub.utils.disable_progress_bars()
    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()


def error(message: str) -> None:
    """One line on stderr: what is wrong and how to fix it."""
    print(f"error: {message}", file=sys.stderr)


_kept: list[str] = []  # what the running command has saved so far, for the Ctrl-C message


def keep_on_interrupt(sentence: str) -> None:
    """Tell the Ctrl-C handler where the running command's finished work is (e.g. its result store)."""
    _kept[:] = [sentence]


def invoke(func: Callable[..., int | None], *args: Any) -> int:
    """Run a command; Ctrl-C becomes exit code 130 and one line saying what was kept, never a traceback."""
    _kept.clear()
    try:
        return int(func(*args) or 0)
    except KeyboardInterrupt:
        print(f"\ninterrupted (Ctrl-C); {_kept[0] if _kept else 'nothing was written'}.", file=sys.stderr)
        return EXIT_INTERRUPTED
