"""Durable writes: a write that fails partway leaves the previous file intact (file-size limit, exceptions)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def test_write_json_refuses_nan_when_asked(tmp_path: Path) -> None:
    target = tmp_path / "x.json"
    with pytest.raises(ValueError, match="non-finite"):
        durable.write_json(target, {"results": [{"value": float("nan")}]}, allow_nan=False)
    assert not target.exists()


def test_check_writable_refuses_a_folder(tmp_path: Path) -> None:
    with pytest.raises(durable.OutputPathError, match="is a folder"):
        durable.check_writable(tmp_path)
    assert durable.check_writable(tmp_path / "new" / "out.json") == tmp_path / "new" / "out.json"
