"""The README runs as written: every Python block executes in order, its set-up commands are the ones CI runs, its
links resolve, and the numbers moved to docs/ (supported versions, the demo's table) are the recorded ones."""

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
INSTALL = (REPO / "docs" / "install.md").read_text()
DEMO = (REPO / "docs" / "demo.md").read_text()


def _versions_script():
    pytest.importorskip("tomllib")  # Python >= 3.11
    spec = importlib.util.spec_from_file_location("supported_versions", REPO / "scripts" / "supported_versions.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def test_the_python_example_runs_as_written(capsys, tmp_path, monkeypatch):
    """Every ```python block of the README, in order and in one namespace (later sections continue the example), run
    from an empty directory: the example prints what each ``# -> `` comment says, line for line, and the prose after it
    quotes the same run."""
    monkeypatch.chdir(tmp_path)
    blocks = _blocks(README, "python")
    assert len(blocks) >= 3, "the README's example, evaluate and Trainer blocks"
    namespace = {"__name__": "readme_example"}
    printed = []
    for i, code in enumerate(blocks):
        exec(compile(code, f"README.md (python block {i + 1})", "exec"), namespace)
        printed.append(capsys.readouterr().out.split("\n"))
    promised = [line.split("# -> ", 1)[1] for line in blocks[0].splitlines() if "# -> " in line]
    assert len(promised) == 3 and [line for line in printed[0] if line] == promised
    moved, before, after = namespace["moved"], namespace["before"], namespace["after"]
    assert moved.factor > 2 and abs(after.value - before.value) <= 1e-6 * before.value, "the example's point"
    quoted = f"`gs.hide`: {moved.factor:.1f}x, {moved.value_before:.3g} to {moved.value_after:.3g}, the function"
    assert quoted in " ".join(README.split()), f"the prose after the example should quote this run: {quoted}"
    for i, lines in enumerate(printed[1:], start=2):
        assert "nan" not in " ".join(lines).lower() and lines[0].strip(), f"block {i} printed {lines}"
    logged = json.loads([line for line in printed[-1] if line.strip()][-1])  # the Trainer block's measurements
    assert len(logged) == 2 and all(v > 0 for v in logged)


def test_the_set_up_commands_are_the_ones_ci_runs():
    setup = README.split("\n## Set-up: two commands\n", 1)[1].split("\n## ", 1)[0]
    commands = [line for line in _blocks(setup, "bash")[0].splitlines() if line and not line.startswith("#")]
    assert commands == ["bash scripts/install.sh && .venv/bin/geosharp demo",
                        "bash scripts/install.sh test && .venv/bin/python -m pytest -q"]
    ci = (REPO / ".ci" / "run").read_text()
    assert "bash scripts/install.sh test\n" in ci and "\n.venv/bin/python -m pytest -q\n" in ci


def test_the_readme_is_short_and_its_links_resolve():
    assert len(README.splitlines()) <= 200
    links = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", README)
    local = [link for link in links if "://" not in link]
    assert local and not [link for link in local if not (REPO / link).exists()]
    assert "docs/results/hide_and_seek.png" in local  # the point, in one picture
    assert 'pip install "hf_geosharp[space]"' in README  # the Space's extra, beside the Space


def test_supported_versions_block_is_generated_from_the_records_and_the_floors():
    versions = _versions_script()
    assert versions.block() in INSTALL, "docs/install.md is stale: python scripts/supported_versions.py readme"
    recorded = versions.read_record("floors")
    for name, floor in versions.floors().items():
        assert name in recorded, f"{name}: declared but not in the floors record: rerun bash scripts/compat.sh floors"
        assert Version(Version(recorded[name]).base_version) == Version(floor), (
            f"{name}: pyproject.toml declares >={floor}, the floors run recorded {recorded[name]}: "
            "rerun bash scripts/compat.sh floors")


def test_the_demo_table_is_the_recorded_demo_run():
    """docs/demo.md's leaderboard table is docs/results/demo_taus.json (the taus.json of a fresh geosharp demo),
    rounded as printed: editing one without the other fails here."""
    recorded = json.loads((REPO / "docs" / "results" / "demo_taus.json").read_text())
    labels = {"geodesic inv (worst)": "geodesic_inv_worst", "geodesic mix (worst)": "geodesic_mix_worst",
              "adaptive (clean solver, worst)": "adaptive_clean_worst",
              "relative flatness (Petzka et al., exact)": "relative_flatness", "parameter norm (trivial)": "param_norm",
              "clean training loss (trivial)": "clean_loss"}
    section = DEMO.split("\n## The leaderboard\n", 1)[1]
    for label, key in labels.items():
        t = recorded["taus"][key]
        count = recorded["certified"].get(key)
        d = recorded["versus_param_norm"].get(key)
        versus = "-" if d is None else f"{d['difference']:+.2f} [{d['ci_low']:+.2f}, {d['ci_high']:+.2f}]"
        row = (f"| {label} | {t['tau']:+.2f} | [{t['ci_low']:+.2f}, {t['ci_high']:+.2f}] | {t['p_value']:.2g} | "
               f"{'-' if count is None else f'{count[0]} of {count[1]}'} | {versus} |")
        assert row in section, row


def test_the_demo_rho_sweep_table_is_the_recorded_demo_run():
    """docs/demo.md's rho sweep table is docs/results/demo_rho_sweep.json (the rho_sweep.json of a fresh geosharp
    demo) as the demo prints it, and the README shows the figure drawn from it."""
    from hf_geosharp.leaderboard.report import sweep_markdown

    recorded = json.loads((REPO / "docs" / "results" / "demo_rho_sweep.json").read_text())
    assert sweep_markdown(recorded) in DEMO
    assert "](docs/results/demo_rho_sweep.png)" in README
    assert (REPO / "docs" / "results" / "demo_rho_sweep.png").is_file()
