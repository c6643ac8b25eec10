"""What every ``geosharp`` command shares: exit codes, argument types, the remote-code flag, quiet third-party
libraries and Ctrl-C handling, defined once so that the commands behave alike.

Exit codes: 0 success; 1 the run failed (or a value is not finite); 2 bad usage or bad input, found before the
expensive work; 130 interrupted with Ctrl-C (what had finished is kept, and the message says where).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from ..engine.progress import Stage

logger = logging.getLogger(__name__)

EXIT_OK, EXIT_FAILED, EXIT_BAD_INPUT, EXIT_INTERRUPTED = 0, 1, 2, 130
MAX_SEED = 2**63 - 1  # torch generators take 64-bit seeds; numpy (the example shuffle) needs them non-negative

TRUST_HELP = (
    "allow running the Python code a model folder or Hub repo ships for its classes (config.json auto_map); "
    "off by default, and never asked interactively"
)


class Parser(argparse.ArgumentParser):
    """An argument parser whose usage errors are one line on stderr (what is wrong, and where the options are listed)
    and exit code 2; the sub-command parsers it makes are of the same kind."""

    def error(self, message: str) -> NoReturn:
        """Print ``PROG: error: MESSAGE (PROG --help lists the options)`` and exit 2."""
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def file_path(text: str) -> Path:
    """An argparse type: a path to a file (it may not exist yet), never an existing folder."""
    path = Path(text)
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a folder; pass a file path")
    return path


def folder_path(text: str) -> Path:
    """An argparse type: a path to a folder (it may not exist yet), never an existing file."""
    path = Path(text)
    if path.exists() and not path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a file; pass a folder path")
    return path


def existing_file(text: str) -> Path:
    """An argparse type: a file that exists."""
    path = Path(text)
    if not path.is_file():
        raise argparse.ArgumentTypeError(f"{text!r} {'is a folder' if path.is_dir() else 'does not exist'}; "
                                         "pass an existing file")
    return path


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


#: How each shared setting (a field of :class:`hf_geosharp.measures.Settings`) is parsed from a command line; its
#: flag is the field's name (``n_samples``: ``--n-samples``), its default and help the field's.
SETTING_TYPES: dict[str, Callable[[str], Any]] = {
    "rho": positive(float), "steps": steps_arg, "n_samples": positive(int), "epsilon": non_negative(float),
    "seed": seed, "compile": str,
}


def add_measure_options(parser: argparse.ArgumentParser, default_measures: tuple[str, ...], *,
                        several_modes: bool = False, measures_instead_of: str | None = None) -> None:
    """The measure options of ``geosharp run``, ``leaderboard`` and ``demo``, declared once: ``--measures``,
    ``--mode`` and one option per shared setting, with the registry's defaults and meanings.

    Args:
        parser: the command's parser.
        default_measures: the measures run when ``--measures`` is not given.
        several_modes: ``--mode`` takes a comma-separated list (one leaderboard column per measure and mode).
        measures_instead_of: other options that also select measures (``--measures`` then defaults to ``None``).
    """
    import dataclasses

    from ..engine.settings import MODES
    from ..measures import MEASURES, Settings

    def short(keys: tuple[str, ...]) -> str:
        return ",".join(MEASURES[key].short or key for key in keys)

    shorts = ", ".join(m.short or m.key for m in MEASURES.values())
    instead = f"; instead of {measures_instead_of}" if measures_instead_of else ""
    parser.add_argument("--measures", type=measure_keys, default=None if instead else list(default_measures),
                        help=f"measure keys or short forms ({shorts}), comma-separated{instead} "
                             f"(default: {short(default_measures)})")
    for field in dataclasses.fields(Settings):
        flag, meaning = "--" + field.name.replace("_", "-"), field.metadata["help"]
        if field.name == "mode" and several_modes:
            parser.add_argument(flag, type=comma_list(MODES), default=[field.default],
                                help=f"{' and/or '.join(MODES)}, comma-separated: one column per measure and mode "
                                     f"(default: {field.default})")
        elif field.name == "mode":
            parser.add_argument(flag, choices=MODES, default=field.default, help=f"{meaning} (default: %(default)s)")
        elif field.metadata.get("choices"):
            parser.add_argument(flag, choices=field.metadata["choices"], default=field.default,
                                help=f"{meaning} (default: %(default)s)")
        elif field.name in SETTING_TYPES:
            parser.add_argument(flag, type=SETTING_TYPES[field.name], default=field.default,
                                help=f"{meaning} (default: %(default)s)")


def settings_of(args: argparse.Namespace, **fixed: Any) -> Any:
    """The :class:`~hf_geosharp.measures.Settings` of parsed options (those :func:`add_measure_options` added).

    Args:
        args: the parsed command line.
        **fixed: settings given otherwise (e.g. ``mode`` where each leaderboard column has its own).

    Returns:
        The settings.
    """
    import dataclasses

    from ..measures import Settings

    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(Settings)
             if (f.name in SETTING_TYPES or f.metadata.get("choices")) and hasattr(args, f.name)
             or (f.name == "mode" and isinstance(getattr(args, "mode", None), str))}
    return Settings(**{**given, **fixed})


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


_kept: list[str | Callable[[], str]] = []  # what the running command has saved so far, for the Ctrl-C message
_interrupts = [0]  # Ctrl-Cs seen by the running command


def progress_line(tick: Any) -> str:
    """A measurement's or a job's progress as one plain line for a log (``geosharp`` prints it where no bar shows).

    Args:
        tick: an :class:`hf_geosharp.engine.progress.Tick` (a measure's batch) or
            :class:`hf_geosharp.engine.progress.Stage` (a job's item).

    Returns:
        E.g. ``progress: geodesic_inv_worst, batch 2/8, step 14/20, 0:03:12 elapsed`` or
        ``progress: leaderboard, 5/24 results done, now zoo-02: geodesic_mix_worst, 0:01:10 elapsed``.
    """
    minutes, seconds = divmod(int(tick.elapsed), 60)
    elapsed = f"{minutes // 60}:{minutes % 60:02d}:{seconds:02d} elapsed"
    if isinstance(tick, Stage):
        return f"progress: {tick.job}, {tick.done}/{tick.total} {tick.unit}s done, now {tick.item}, {elapsed}"
    state = f"done after {tick.steps} steps, sharpness {tick.value:.4g}" if tick.done else \
        f"step {tick.steps}/{tick.n_steps}"
    return f"progress: {tick.measure}, batch {tick.batch}/{tick.n_batches}, {state}, {elapsed}"


def print_progress(tick: Any) -> None:
    """:func:`progress_line` on stderr, flushed (a log shows it at once)."""
    print(progress_line(tick), file=sys.stderr, flush=True)


def keep_on_interrupt(sentence: str | Callable[[], str]) -> None:
    """Tell the Ctrl-C handler where the running command's finished work is (e.g. its result store); a callable is
    asked at the moment of the Ctrl-C (e.g. how many members of a zoo are trained by then)."""
    _kept[:] = [sentence]


def _kept_sentence(default: str) -> str:
    if not _kept:
        return default
    try:
        return _kept[0]() if callable(_kept[0]) else _kept[0]
    except Exception:  # noqa: BLE001 - the Ctrl-C line is printed whatever the callable does
        logger.debug("the Ctrl-C sentence failed", exc_info=True)
        return default


def _on_sigint(signum: int, frame: Any) -> None:
    """The first Ctrl-C interrupts the command (KeyboardInterrupt); a second one, while the first is still being
    cleaned up after (a child process stopped, a staging folder removed), is noted and does not interrupt the clean-up
    (which could leave torch's or a context manager's state half undone); a third quits at once."""
    _interrupts[0] += 1
    if _interrupts[0] == 1:
        raise KeyboardInterrupt
    if _interrupts[0] == 2:
        print("\n(Ctrl-C again: finishing the clean-up, a moment; a third Ctrl-C quits at once)", file=sys.stderr)
        return
    print(f"\ninterrupted (Ctrl-C, three times: quit without cleaning up); {_kept_sentence('nothing was written')}.",
          file=sys.stderr, flush=True)
    os._exit(EXIT_INTERRUPTED)


def _handle_sigint(handler: Any) -> Any:
    """Install ``handler`` for SIGINT where Python allows it (the main thread); the previous one, or None."""
    if threading.current_thread() is not threading.main_thread() or signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        return None  # a background job started with Ctrl-C ignored keeps ignoring it
    return signal.signal(signal.SIGINT, handler)


def invoke(func: Callable[..., int | None], *args: Any) -> int:
    """Run a command; Ctrl-C becomes exit code 130 and one line saying what was kept, never a traceback (also after
    a second Ctrl-C during the clean-up)."""
    _kept.clear()
    _interrupts[0] = 0
    previous = _handle_sigint(_on_sigint)
    try:
        return int(func(*args) or 0)
    except KeyboardInterrupt:
        print(f"\ninterrupted (Ctrl-C); {_kept_sentence('nothing was written')}.", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        if previous is not None:
            _handle_sigint(previous)


def exit_process(code: int) -> NoReturn:
    """End the command's own process with ``code`` at once, after the exit handlers (logging, temporary files) but
    without tearing down every module: that teardown (torch's, up to seconds) runs with Python's signal handling
    already off, where a Ctrl-C killed the process without a word. A Ctrl-C while exiting says the command had
    finished, and what it kept. Only for a process of its own (the ``geosharp`` script); with other (non-daemon)
    threads still running, the normal exit, which waits for them."""

    def on_sigint(signum: int, frame: Any) -> None:
        print(f"\ninterrupted (Ctrl-C) while exiting, after the command had finished; "
              f"{_kept_sentence('its output is complete')}.", file=sys.stderr, flush=True)
        os._exit(EXIT_INTERRUPTED)

    _handle_sigint(on_sigint)
    main = threading.main_thread()
    if any(t is not main and not t.daemon and t.is_alive() for t in threading.enumerate()):
        sys.exit(code)  # Python's own exit joins them
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)
