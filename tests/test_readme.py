"""The README's Python example runs as written, and its "Supported versions" block is the one CI's records give."""

from __future__ import annotations

import importlib.util
import json
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


def test_the_demo_table_is_the_recorded_demo_run():
    """The README's leaderboard table is docs/results/demo_taus.json (the taus.json of a fresh geosharp demo),
    rounded as printed: editing one without the other fails here."""
    recorded = json.loads((REPO / "docs" / "results" / "demo_taus.json").read_text())
    labels = {"geodesic inv (worst)": "geodesic_inv_worst", "geodesic mix (worst)": "geodesic_mix_worst",
              "adaptive (clean solver, worst)": "adaptive_clean_worst",
              "relative flatness (Petzka et al., exact)": "relative_flatness", "parameter norm (trivial)": "param_norm",
              "clean training loss (trivial)": "clean_loss"}
    section = README.split("\n### The embedded demo\n", 1)[1]
    for label, key in labels.items():
        t = recorded["taus"][key]
        count = recorded["certified"].get(key)
        d = recorded["versus_param_norm"].get(key)
        versus = "-" if d is None else f"{d['difference']:+.2f} [{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]"
        row = (f"| {label} | {t['tau']:+.2f} | [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}] | {t['p_value']:.2g} | "
               f"{'-' if count is None else f'{count[0]} of {count[1]}'} | {versus} |")
        assert row in section, row
