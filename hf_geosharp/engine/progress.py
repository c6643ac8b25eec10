"""When a progress bar shows: only where it was asked for (``progress=True``, no ``--quiet``), and then only on a
terminal, so that logs, CI output and redirected files get no bar lines; ``HF_GEOSHARP_PROGRESS`` overrides it."""

from __future__ import annotations

import os

#: ``1``: show the bars that were asked for also when stderr is not a terminal (``geosharp --progress`` sets it for
#: the command and the processes it starts); ``0``: hide every bar.
PROGRESS_ENV = "HF_GEOSHARP_PROGRESS"


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
