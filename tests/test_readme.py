"""The README's Python example runs as written, and its "Supported versions" block is the one CI's records give."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest
from packaging.version import Version

from .fixtures.hf_models import one_thread  # noqa: F401

REPO = Path(__file__).resolve().parents[1]
README = (REPO / "README.md").read_text()


def _versions_script():
    pytest.importorskip("tomllib")  # Python >= 3.11
    spec = importlib.util.spec_from_file_location("supported_versions", REPO / "scripts" / "supported_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_python_example_runs_as_written(capsys):
    section = README.split("\n### Python\n", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    exec(compile(code, "README.md (### Python)", "exec"), {"__name__": "readme_example"})
    printed = capsys.readouterr().out.split()
    assert printed[0] == "8" and float(printed[1]) > 0  # 8 QK pairs; a positive geodesic sharpness


def test_supported_versions_block_is_generated_from_the_records_and_the_floors():
    versions = _versions_script()
    assert versions.block() in README, "README is stale: python scripts/supported_versions.py readme"
    recorded = versions.read_record("floors")
    for name, floor in versions.floors().items():
        assert Version(Version(recorded[name]).base_version) == Version(floor), (
            f"{name}: pyproject.toml declares >={floor}, the floors run recorded {recorded[name]}: "
            "rerun bash scripts/compat.sh floors")
