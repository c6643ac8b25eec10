"""Durable writes: a write that fails partway leaves the previous file intact (file-size limit, exceptions)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from hf_geosharp import durable


def test_write_replaces_contents_and_keeps_permissions(tmp_path: Path) -> None:
    target = tmp_path / "out.json"
    target.write_text("old")
    os.chmod(target, 0o600)
    durable.write_json(target, {"a": 1})
    assert json.loads(target.read_text()) == {"a": 1}
    assert target.stat().st_mode & 0o777 == 0o600
    assert [p.name for p in tmp_path.iterdir()] == ["out.json"]  # no temporary file left behind


def test_exception_inside_atomic_path_keeps_old_file(tmp_path: Path) -> None:
    target = tmp_path / "card.md"
    target.write_text("the user's prose")
    with pytest.raises(RuntimeError):
        with durable.atomic_path(target) as tmp:
            tmp.write_text("half")
            raise RuntimeError("boom")
    assert target.read_text() == "the user's prose"
    assert [p.name for p in tmp_path.iterdir()] == ["card.md"]


def test_file_size_limit_mid_write_keeps_old_file(tmp_path: Path) -> None:
    """A disk-full style failure (RLIMIT_FSIZE) in the middle of a large write: the old file survives whole."""
    target = tmp_path / "results.json"
    old = json.dumps({"value": 1.0, "prose": "x" * 60_000})
    target.write_text(old)
    script = textwrap.dedent(
        f"""
        import resource, signal
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # get EFBIG instead of being killed
        resource.setrlimit(resource.RLIMIT_FSIZE, (16_384, 16_384))
        from hf_geosharp import durable
        try:
            durable.write_text({str(target)!r}, "y" * 100_000)
        except OSError as err:
            print("failed", err.errno)
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert "failed" in out.stdout, out.stderr
    assert target.read_text() == old
    assert [p.name for p in tmp_path.iterdir()] == ["results.json"]


def test_write_json_writes_strict_json_with_null_for_non_finite_numbers(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    payload = {"taus": {"a": [float("nan"), 0.5]}, "inf": float("-inf"), "pair": (1.0, float("inf")), "n": 3}
    durable.write_json(target, payload)
    text = target.read_text()
    assert "NaN" not in text and "Infinity" not in text

    def refuse(constant: str) -> None:
        raise AssertionError(f"{constant} in a written JSON file")

    assert json.loads(text, parse_constant=refuse) == {"taus": {"a": [None, 0.5]}, "inf": None, "pair": [1.0, None],
                                                       "n": 3}
    assert payload["taus"]["a"][0] != payload["taus"]["a"][0]  # the caller's payload is not changed


def test_check_writable_refuses_a_folder(tmp_path: Path) -> None:
    with pytest.raises(durable.OutputPathError, match="is a folder"):
        durable.check_writable(tmp_path)
    assert durable.check_writable(tmp_path / "new" / "out.json") == tmp_path / "new" / "out.json"


# ------------------------------------------------------------------------------------------------ folders
def _tree(folder: Path) -> dict[str, bytes] | None:
    """A folder's files by relative path (``None``: the folder is missing)."""
    if not folder.is_dir():
        return None
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


OLD = {"config.json": b'{"old": 1}', "sub/weights.bin": b"o" * 1000}
NEW = {"config.json": b'{"new": 2}', "weights.safetensors": b"n" * 3000}


def _make(folder: Path, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


@pytest.fixture(params=["exchange", "two renames"])
def swap(request, monkeypatch, tmp_path) -> str:
    """Both ways of replacing a full folder: the atomic exchange, and the two renames where the OS has none."""
    if request.param == "two renames":
        monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
        return request.param
    a, b = tmp_path / "probe-a", tmp_path / "probe-b"
    a.mkdir()
    b.mkdir()
    exchanged = durable._exchange(a, b)
    a.rmdir()
    b.rmdir()
    if not exchanged:
        pytest.skip("no atomic exchange here (C library or file system)")
    return request.param


def _steps(monkeypatch, at_each, seen: list[str] | None = None) -> list[str]:
    """Call ``at_each(name)`` before every step of a replacement that touches the file system (the renames, the
    exchange, the folder flushes); the names seen go into ``seen``, which is returned."""
    seen = [] if seen is None else seen
    real = {"rename": os.rename, "_exchange": durable._exchange, "_fsync_dir": durable._fsync_dir}

    def wrap(name, func):
        def step(*args, **kwargs):
            seen.append(name)
            at_each(name)
            return func(*args, **kwargs)
        return step

    monkeypatch.setattr(os, "rename", wrap("rename", real["rename"]))
    monkeypatch.setattr(durable, "_exchange", wrap("_exchange", real["_exchange"]))
    monkeypatch.setattr(durable, "_fsync_dir", wrap("_fsync_dir", real["_fsync_dir"]))
    return seen


@pytest.mark.parametrize("before", ["missing", "empty", "full"])
def test_a_replaced_folder_is_old_or_new_complete_at_every_step(tmp_path, monkeypatch, swap, before) -> None:
    target = tmp_path / "OUT"
    old = None if before == "missing" else ({} if before == "empty" else OLD)
    if old is not None:
        target.mkdir()
        _make(target, old)
    states = []
    seen = _steps(monkeypatch, lambda name: states.append(_tree(target)))
    committed = []
    with durable.staged_dir(target, on_commit=lambda: committed.append(_tree(target))) as staging:
        _make(staging, NEW)
    states.append(_tree(target))
    gaps = [i for i, state in enumerate(states) if state not in (old, NEW)]
    if swap == "two renames" and before == "full":  # only between the two renames (which Ctrl-C cannot separate)
        assert [seen[i - 1 : i + 1] for i in gaps] == [["rename", "rename"]], (seen, states)
    else:  # one atomic rename or exchange: never a gap
        assert seen and gaps == [], (seen, states)
    assert committed == [NEW] and _tree(target) == NEW
    assert [p.name for p in tmp_path.iterdir()] == ["OUT"]  # no staging folder, no old copy left behind


def _replace_full(target: Path, at_step: int, monkeypatch, seen: list[str], committed: list[bool]) -> None:
    """Replace a full ``target`` (OLD) by NEW with a real SIGINT before step ``at_step`` (-1: while NEW is being
    written); ``seen`` gets the steps, ``committed`` a ``True`` when the commit hook runs."""
    target.mkdir()
    _make(target, OLD)
    count = iter(range(1000))

    def interrupt(name: str) -> None:
        if next(count) == at_step:
            signal.raise_signal(signal.SIGINT)

    with monkeypatch.context() as m:
        _steps(m, interrupt, seen)
        with durable.staged_dir(target, on_commit=lambda: committed.append(True)) as staging:
            _make(staging, NEW)
            if at_step == -1:
                signal.raise_signal(signal.SIGINT)


@pytest.mark.usefixtures("ctrl_c_raises")
def test_ctrl_c_at_any_step_leaves_old_or_new_complete_and_says_which(tmp_path, monkeypatch, swap) -> None:
    """A real SIGINT while the new folder is written and before each step of the replacement: the folder is the old
    one or the new one, complete; the commit hook (what the command reports) ran exactly when it is the new one; a
    Ctrl-C that arrives during the renames is held until they are done; nothing is left behind."""
    steps: list[str] = []
    _replace_full(tmp_path / "dry", 10**6, monkeypatch, steps, [])
    assert {"rename", "_exchange"} & set(steps)
    for k in range(-1, len(steps)):
        target, committed = tmp_path / f"OUT{k}", []
        with pytest.raises(KeyboardInterrupt):
            _replace_full(target, k, monkeypatch, [], committed)
        state = _tree(target)
        assert state in (OLD, NEW), (k, steps)
        assert committed == ([True] if state == NEW else []), (k, steps)
        if k >= 0 and steps[k] in ("rename", "_exchange"):  # inside the swap: held off until it is complete
            assert state == NEW, (k, steps)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == [], (k, steps)


def test_a_failed_second_rename_puts_the_old_folder_back(tmp_path, monkeypatch) -> None:
    """Without an atomic exchange, the old folder is moved aside first; if the new one then cannot be renamed in,
    the old one goes back under its name."""
    monkeypatch.setattr(durable, "_exchange", lambda a, b: False)
    target = tmp_path / "OUT"
    target.mkdir()
    _make(target, OLD)
    real, calls = os.rename, []

    def rename(src, dst):
        calls.append(src)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(src, dst)

    monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(OSError, match="No space"):
        with durable.staged_dir(target) as staging:
            _make(staging, NEW)
    assert _tree(target) == OLD and [p.name for p in tmp_path.iterdir()] == ["OUT"]


@pytest.mark.parametrize("umask", [0o022, 0o077, 0o002])
def test_new_folders_and_files_follow_the_umask(tmp_path, umask) -> None:
    previous = os.umask(umask)
    try:
        assert durable._umask() == umask
        with durable.staged_dir(tmp_path / "a" / "OUT") as staging:
            (staging / "sub").mkdir()
            durable.write_text(staging / "sub" / "f.txt", "x")
            fd, private = tempfile.mkstemp(dir=staging)  # 0600, as libraries' own atomic writes leave files
            os.close(fd)
            os.rename(private, staging / "weights.safetensors")
        durable.write_text(tmp_path / "b" / "c" / "out.json", "{}")
    finally:
        os.umask(previous)
    for folder in (tmp_path / "a", tmp_path / "a" / "OUT", tmp_path / "a" / "OUT" / "sub", tmp_path / "b" / "c"):
        assert folder.stat().st_mode & 0o777 == 0o777 & ~umask, folder
    out = tmp_path / "a" / "OUT"
    for file in (out / "sub" / "f.txt", out / "weights.safetensors", tmp_path / "b" / "c" / "out.json"):
        assert file.stat().st_mode & 0o777 == 0o666 & ~umask, file


def test_a_replaced_folder_keeps_its_mode(tmp_path) -> None:
    target = tmp_path / "OUT"
    target.mkdir()
    _make(target, OLD)
    target.chmod(0o750)
    with durable.staged_dir(target) as staging:
        _make(staging, NEW)
    assert target.stat().st_mode & 0o777 == 0o750 and _tree(target) == NEW


def test_the_path_check_creates_nothing(tmp_path) -> None:
    """``check_writable`` only looks: a run stopped after it leaves no folder behind; an unwritable folder is found
    also when the file would go into sub-folders still to be created."""
    durable.check_writable(tmp_path / "a" / "b" / "out.json")
    assert list(tmp_path.iterdir()) == []
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o550)
    try:
        for path in (locked / "out.json", locked / "model" / "results.json"):
            with pytest.raises(durable.OutputPathError, match="is not writable; choose another path"):
                durable.check_writable(path)
        assert list(locked.iterdir()) == []
    finally:
        locked.chmod(0o750)
    (tmp_path / "file").write_text("x")
    with pytest.raises(durable.OutputPathError, match="is a file, not a folder"):
        durable.check_writable(tmp_path / "file" / "out.json")
