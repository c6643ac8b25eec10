"""When progress shows, and how: a bar only where it was asked for (``progress=True``, no ``--quiet``), and then only
on a terminal, so that logs, CI output and redirected files get no bar lines (``HF_GEOSHARP_PROGRESS`` overrides
it); where a bar was asked for but stderr is not a terminal, plain progress lines instead, for a face that listens
(:func:`progress_lines`: at most one every ``every`` seconds while a batch is solved, and one at each batch's end).
The engine reports where it stands (:class:`Tick`), and so does a face's own long job, one line per item it starts
(:class:`Stages`: the leaderboard's results, the zoo's training, hide & seek's measurements); the face words both."""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextvars import ContextVar
from dataclasses import dataclass

#: ``1``: show the bars that were asked for also when stderr is not a terminal (``geosharp --progress`` sets it for
#: the command and the processes it starts); ``0``: hide every bar (and every progress line).
PROGRESS_ENV = "HF_GEOSHARP_PROGRESS"
#: Seconds between two progress lines while one batch is solved (a batch's end always gets its line).
EVERY = 30.0


def bar_disabled(progress: bool) -> bool | None:
    """tqdm's ``disable=`` for a bar the caller asked for or not.

    Args:
        progress: whether the caller asked for the bar.

    Returns:
        True (hidden) when not asked for or ``HF_GEOSHARP_PROGRESS=0``, False (shown) with ``HF_GEOSHARP_PROGRESS=1``,
        else None: tqdm shows it only when its stream is a terminal.
    """
    forced = os.environ.get(PROGRESS_ENV, "").strip()
    if not progress or forced == "0":
        return True
    return False if forced == "1" else None


@dataclass(frozen=True)
class Tick:
    """Where one measure stands, for a progress line.

    Attributes:
        measure: the engine's name of the measure (``geodesic_inv_worst``).
        batch: which of this process's batches (from 1).
        n_batches: how many batches this process solves.
        steps: solver steps (or average-case samples) done in this batch.
        n_steps: the steps asked for (``"auto"``: until certified).
        elapsed: seconds since the measure's first batch began.
        done: whether the batch has ended.
        value: the batch's sharpness so far (its result when ``done``).
    """

    measure: str
    batch: int
    n_batches: int
    steps: int
    n_steps: int | str
    elapsed: float
    done: bool
    value: float


@dataclass(frozen=True)
class Stage:
    """Where a face's long job stands, for a progress line.

    Attributes:
        job: what runs (``leaderboard``, ``training zoo``).
        done: items finished.
        total: items in all.
        unit: what one item is (``result``, ``model``).
        item: the item starting now (``zoo-02: geodesic_inv_worst``).
        elapsed: seconds since the job began.
    """

    job: str
    done: int
    total: int
    unit: str
    item: str
    elapsed: float


OnTick = Callable[[Tick | Stage], None]
_listener: ContextVar[tuple[OnTick, float] | None] = ContextVar("hf_geosharp_progress_lines", default=None)


@contextlib.contextmanager
def progress_lines(on_tick: OnTick, every: float = EVERY) -> Iterator[None]:
    """Inside the block, a measurement whose bar would not show (asked for, stderr not a terminal) reports to
    ``on_tick`` instead: at most once every ``every`` seconds within a batch, and at each batch's end; a face's
    :class:`Stages` report there too.

    Args:
        on_tick: called with each :class:`Tick` and :class:`Stage` (a face prints it).
        every: seconds between two reports within a batch.
    """
    token = _listener.set((on_tick, every))
    try:
        yield
    finally:
        _listener.reset(token)


def lines_wanted(progress: bool) -> bool:
    """Whether progress lines replace the bar: it was asked for, no ``HF_GEOSHARP_PROGRESS`` decides, and stderr is
    not a terminal (where tqdm would hide it).

    Args:
        progress: whether the caller asked for progress.

    Returns:
        ``True`` where lines should be written instead of a bar.
    """
    isatty = getattr(sys.stderr, "isatty", None)
    return bar_disabled(progress) is None and not (isatty is not None and isatty())


class Ticker:
    """One measure's progress reports to the listening face (none: every call is a no-op)."""

    def __init__(self, measure: str, n_batches: int, n_steps: int | str, progress: bool) -> None:
        listener = _listener.get()
        self._listener = listener if listener is not None and lines_wanted(progress) else None
        self._measure, self._n_batches, self._n_steps = measure, n_batches, n_steps
        self._start = self._last = time.monotonic()

    def step(self, batch: int, steps: int, value: float) -> None:
        """``steps`` steps of batch ``batch`` (from 1) are done: reported when ``every`` seconds have passed."""
        if self._listener is not None and time.monotonic() - self._last >= self._listener[1]:
            self._report(batch, steps, value, done=False)

    def batch_end(self, batch: int, steps: int, value: float) -> None:
        """Batch ``batch`` (from 1) ended after ``steps`` steps with ``value``: always reported."""
        if self._listener is not None:
            self._report(batch, steps, value, done=True)

    def _report(self, batch: int, steps: int, value: float, done: bool) -> None:
        self._last = now = time.monotonic()
        self._listener[0](Tick(self._measure, batch, self._n_batches, steps, self._n_steps, now - self._start, done,
                               value))


class Stages:
    """A face's job of many items, reported to the listening face as a line when each item starts, where the job's
    bar does not show (none listening: every call is a no-op). Long items get the engine's own lines besides."""

    def __init__(self, job: str, total: int, unit: str, progress: bool) -> None:
        listener = _listener.get()
        self._listener = listener if listener is not None and lines_wanted(progress) else None
        self._job, self._total, self._unit = job, total, unit
        self._start = time.monotonic()
        self.done = 0

    def update(self, n: int = 1) -> None:
        """``n`` more items are finished (or were found stored)."""
        self.done += n

    def begin(self, item: str) -> None:
        """Item ``item`` starts: always reported."""
        if self._listener is not None:
            self._listener[0](Stage(self._job, self.done, self._total, self._unit, item,
                                    time.monotonic() - self._start))
