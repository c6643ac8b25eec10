"""Durable file writes: every file the library writes goes through here.

A write that fails partway (disk full, a quota, a file-size limit, Ctrl-C, a kill) must never destroy what the file
held before. So the new contents go into a temporary file in the same folder (same file system, so the rename is
atomic), which is flushed and ``fsync``-ed, then renamed over the target, and the folder is ``fsync``-ed so that the
rename itself survives a crash. On any failure the temporary file is removed and the old file is untouched.

Writers that produce bytes through a callback (matplotlib's ``savefig``, ``csv.writer``, ``ModelCard.save``) use
:func:`atomic_path`, which hands out the temporary path and commits it only if the block finishes.

Folders (a saved model, a Space) are built in a staging folder next to the target (:func:`staged_dir`) and put in
place by :func:`replace_dir`: the target's name holds either the old folder or the new one, complete (an atomic
exchange where the OS has one, else two renames that Ctrl-C cannot separate). Nothing is created before the write
itself (:func:`check_writable` only looks), and everything is created with the user's umask.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import functools
import json
import logging
import math
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


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
    """The process's umask, read without changing it where the OS says it (``os.umask`` can only set it, and
    setting it to 0 even for an instant would give another thread's new files the wrong mode)."""
    with contextlib.suppress(OSError, ValueError, StopIteration):
        with open("/proc/self/status", encoding="ascii") as status:
            return int(next(line for line in status if line.startswith("Umask:")).split()[1], 8)
    current = os.umask(0o022)
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


def strict(value: Any) -> Any:
    """``value`` with every non-finite float (NaN, inf) replaced by ``None``: JSON has no such numbers, and strict
    readers (JavaScript's ``JSON.parse``, ``jq``, most languages' parsers) refuse the ``NaN`` that :func:`json.dumps`
    writes by default.

    Args:
        value: a JSON-able value (dicts, lists, tuples, numbers, strings).

    Returns:
        The same structure (tuples become lists) with ``null`` where a number was not finite.
    """
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: strict(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [strict(v) for v in value]
    return value


def write_json(path: str | os.PathLike[str], payload: Any, *, indent: int | None = 2) -> Path:
    """Replace ``path`` with ``payload`` as strict JSON durably: a number that is not finite (NaN, inf) is written as
    ``null`` (:func:`strict`), so every JSON file the package writes parses anywhere.

    Args:
        path: the file to replace.
        payload: what to write; objects JSON does not know are written as their ``str``.
        indent: JSON indentation (``None``: one line).

    Returns:
        The path written.
    """
    text = json.dumps(strict(payload), indent=indent, allow_nan=False, default=str)
    return write_text(path, text + "\n")


def check_writable(path: str | os.PathLike[str], *, what: str = "output file") -> Path:
    """Refuse, before any expensive work, an output path that cannot be written as a file.

    Raises :class:`OutputPathError` naming the problem and the fix: the path is a folder, a file stands where a
    folder is needed, or the folder that would hold it (the nearest one that exists, when folders are still to be
    created) or the existing file is not writable. Creates nothing: a run stopped after the check leaves no trace."""
    target = Path(path)
    if target.is_dir():
        example = str(target / "out.json")
        raise OutputPathError(f"{what} {str(target)!r} is a folder; pass a file path (e.g. {example!r}).")
    folder = Path(os.path.abspath(target.parent if str(target.parent) else "."))
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise OutputPathError(f"cannot write {what} {str(target)!r}: {str(existing)!r} is a file, not a folder; "
                              "choose another path.")
    # Mode bits as well as access(): root may write anything, but a file or folder marked read-only says the user
    # does not want it changed (and a durable write replaces the file by renaming, which its own mode does not stop).
    if not os.access(existing, os.W_OK | os.X_OK) or not existing.stat().st_mode & 0o222:
        where = "its folder" if existing == folder else f"the folder {str(existing)!r}, where it would be created,"
        raise OutputPathError(f"cannot write {what} {str(target)!r}: {where} is not writable; choose another path.")
    if target.exists() and (not os.access(target, os.W_OK) or not target.stat().st_mode & 0o222):
        raise OutputPathError(f"cannot write {what} {str(target)!r}: the file is read-only; choose another path.")
    return target


# ------------------------------------------------------------------------------------------------ folders
AT_FDCWD, RENAME_EXCHANGE = -100, 2  # <fcntl.h>, <linux/fs.h>


@functools.lru_cache(maxsize=1)
def _renameat2() -> Any:
    """glibc's ``renameat2`` (Linux), or ``None`` where the C library has none."""
    try:
        return getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    except OSError:
        return None


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step (``renameat2(RENAME_EXCHANGE)``); ``False`` where the OS or the
    file system cannot, so that the caller falls back to two renames."""
    func = _renameat2()
    if func is None:
        return False
    if func(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP):  # an old kernel, or a file system without exchange
        return False
    raise OSError(err, os.strerror(err), str(b))


@contextlib.contextmanager
def held_interrupts() -> Iterator[list[int]]:
    """Hold SIGINT back while the block runs; yields the list of those received meanwhile, for the caller to act on
    (deliver them later, or undo what the block did). Signals reach only the main thread: in any other thread, when
    SIGINT is ignored, or when its handler was not installed from Python, nothing is held and the list stays empty."""
    received: list[int] = []
    previous = signal.getsignal(signal.SIGINT) if threading.current_thread() is threading.main_thread() else None
    if previous is None or previous is signal.SIG_IGN:
        yield received
        return
    signal.signal(signal.SIGINT, lambda signum, frame: received.append(signum))
    try:
        yield received
    finally:
        signal.signal(signal.SIGINT, previous)


@contextlib.contextmanager
def ctrl_c_deferred() -> Iterator[None]:
    """Hold Ctrl-C off while the block runs and deliver it once the block has finished, so that steps that must not
    be separated (the two renames of a folder replacement) never are."""
    with held_interrupts() as received:
        yield
    if received:
        handler = signal.getsignal(signal.SIGINT)
        if callable(handler):
            handler(signal.SIGINT, None)  # Python's default handler raises KeyboardInterrupt here
        else:
            signal.raise_signal(signal.SIGINT)  # the default action


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not path.is_symlink() and next(path.iterdir(), None) is None


def replace_dir(new: str | os.PathLike[str], target: str | os.PathLike[str],
                on_commit: Callable[[], None] | None = None) -> None:
    """Put the finished folder ``new`` at ``target`` (a new name, an empty folder, or a folder to replace).

    ``target`` is the old folder or the new one, complete: a missing or empty target is replaced by one ``rename``
    (atomic, also over an empty folder); a full one is swapped in one atomic exchange (Linux), else moved aside and
    replaced by two renames that Ctrl-C cannot separate (a failure of the second puts the old one back; only a kill
    between them leaves the old folder, complete, in ``.NAME-old-*`` next to it). ``on_commit`` runs as soon as the
    new folder is in place, before a Ctrl-C held off meanwhile is delivered, so that the command can say truthfully
    what it did; the old folder is then removed."""
    new, target = Path(new), Path(target)
    old: Path | None = None
    with ctrl_c_deferred():
        if not target.exists() or _is_empty_dir(target):
            os.rename(new, target)
        elif _exchange(new, target):
            old = new  # the exchange left the old folder under the staging name
        else:
            old = Path(tempfile.mkdtemp(prefix=f".{target.name}-old-", dir=target.parent))
            try:
                os.rename(target, old / target.name)
                try:
                    os.rename(new, target)
                except BaseException:
                    os.rename(old / target.name, target)
                    raise
            except BaseException:
                with contextlib.suppress(OSError):  # rmdir: only if the old folder is back under its name
                    old.rmdir()
                raise
        _fsync_dir(target.parent)
        if on_commit is not None:
            on_commit()
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
            if old.exists():
                logger.warning("could not remove the previous copy of %s, now in %s; delete it", target, old)


def _settle_tree(root: Path, umask: int) -> None:
    """Give everything under ``root`` the user's modes and flush it to disk, before it replaces the old folder.

    Libraries write some files through private temporary files (``mkstemp``'s 0600: safetensors weights, for one);
    the folder is the user's, so every file gets ``0o666`` (``0o777`` if executable) minus the umask, and every
    folder ``0o777`` minus the umask."""
    for folder, dirs, files in os.walk(root):
        for name in dirs:
            os.chmod(os.path.join(folder, name), 0o777 & ~umask)
        for name in files:
            path = os.path.join(folder, name)
            if os.path.islink(path):
                continue
            os.chmod(path, (0o777 if os.stat(path).st_mode & 0o100 else 0o666) & ~umask)
            with open(path, "rb") as f:
                os.fsync(f.fileno())
        _fsync_dir(Path(folder))


@contextlib.contextmanager
def staged_dir(target: str | os.PathLike[str], on_commit: Callable[[], None] | None = None) -> Iterator[Path]:
    """Yield an empty staging folder next to ``target``; if the block finishes, its contents are flushed and put in
    place by :func:`replace_dir`, else the staging folder is removed and ``target`` is untouched.

    The new folder gets the mode of the folder it replaces, or for a new one the user's (``0o777`` minus the umask:
    ``mkdtemp`` alone would make it private); what is inside it gets the user's modes (:func:`_settle_tree`)."""
    target, umask = Path(target), _umask()
    target.parent.mkdir(parents=True, exist_ok=True)
    mode = target.stat().st_mode & 0o7777 if target.is_dir() else 0o777 & ~umask
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}-new-", dir=target.parent))
    try:
        os.chmod(staging, mode)
        yield staging
        _settle_tree(staging, umask)
        replace_dir(staging, target, on_commit)
    finally:
        shutil.rmtree(staging, ignore_errors=True)  # after a failure; after an exchange, replace_dir removed it
