"""Durable file writes: every file the library writes goes through here.

A write that fails partway (disk full, a quota, a file-size limit, Ctrl-C, a kill) must never destroy what the file
held before. So the new contents go into a temporary file in the same folder (same file system, so the rename is
atomic), which is flushed and ``fsync``-ed, then renamed over the target, and the folder is ``fsync``-ed so that the
rename itself survives a crash. On any failure the temporary file is removed and the old file is untouched.

Writers that produce bytes through a callback (matplotlib's ``savefig``, ``csv.writer``, ``ModelCard.save``) use
:func:`atomic_path`, which hands out the temporary path and commits it only if the block finishes.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class OutputPathError(ValueError):
    """An output path cannot be written (a folder, a read-only place, ...); checked before expensive work."""


def _fsync_dir(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:  # some file systems do not let a folder be opened; the rename is still atomic
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike[str], mode: int | None = None) -> Iterator[Path]:
    """Yield a temporary path next to ``path``; on a clean exit it is fsync-ed and renamed over ``path``.

    The temporary file keeps the target's suffix (so writers that pick a format from it, like ``savefig``, work) and
    the permissions of the file it replaces (``0o644`` minus the umask for a new one, unless ``mode`` is given)."""
    target = Path(path)
    folder = target.parent if str(target.parent) else Path(".")
    folder.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{target.suffix}", dir=folder)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        if mode is None:
            mode = target.stat().st_mode & 0o7777 if target.exists() else 0o666 & ~_umask()
        os.chmod(tmp, mode)
        os.replace(tmp, target)
        _fsync_dir(folder)
    except BaseException:  # also KeyboardInterrupt: the old file must stay as it was
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def write_bytes(path: str | os.PathLike[str], data: bytes) -> Path:
    """Replace ``path`` with ``data`` durably; the old contents survive any failure."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
    return Path(path)


def write_text(path: str | os.PathLike[str], text: str) -> Path:
    """Replace ``path`` with ``text`` (UTF-8) durably."""
    return write_bytes(path, text.encode("utf-8"))


def _no_nan(value: Any, where: str = "") -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"refusing to write the non-finite number {value} at {where or 'the top level'}")
    if isinstance(value, dict):
        for k, v in value.items():
            _no_nan(v, f"{where}.{k}" if where else str(k))
    elif isinstance(value, (list, tuple)):
        for i, v in enumerate(value):
            _no_nan(v, f"{where}[{i}]")


def write_json(path: str | os.PathLike[str], payload: Any, *, allow_nan: bool = True, indent: int | None = 2) -> Path:
    """Replace ``path`` with ``payload`` as JSON durably.

    ``allow_nan=False`` refuses NaN and inf anywhere (they are not JSON and most readers choke on them); with the
    default, they are written as JavaScript-style ``NaN`` like :func:`json.dumps` does."""
    if not allow_nan:
        _no_nan(payload)
    return write_text(path, json.dumps(payload, indent=indent, allow_nan=allow_nan, default=str) + "\n")


def check_writable(path: str | os.PathLike[str], *, what: str = "output file") -> Path:
    """Refuse, before any expensive work, an output path that cannot be written as a file.

    Raises :class:`OutputPathError` naming the problem and the fix: the path is a folder, its folder cannot be
    created, or the folder or the existing file is not writable. Creates no file (the folder may be created)."""
    target = Path(path)
    if target.is_dir():
        example = str(target / "out.json")
        raise OutputPathError(f"{what} {str(target)!r} is a folder; pass a file path (e.g. {example!r}).")
    folder = target.parent if str(target.parent) else Path(".")
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputPathError(f"cannot create the folder of {what} {str(target)!r}: {err.strerror or err}.") from None
    if not folder.is_dir():
        raise OutputPathError(f"the parent of {what} {str(target)!r} is not a folder.")
    # Mode bits as well as access(): root may write anything, but a file or folder marked read-only says the user
    # does not want it changed (and a durable write replaces the file by renaming, which its own mode does not stop).
    if not os.access(folder, os.W_OK | os.X_OK) or not folder.stat().st_mode & 0o222:
        raise OutputPathError(f"cannot write {what} {str(target)!r}: its folder is not writable; choose another path.")
    if target.exists() and (not os.access(target, os.W_OK) or not target.stat().st_mode & 0o222):
        raise OutputPathError(f"cannot write {what} {str(target)!r}: the file is read-only; choose another path.")
    return target
