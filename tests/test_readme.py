"""The README runs as written: every Python block executes in order, its set-up commands are the ones CI runs, its
links resolve, and the numbers moved to docs/ (supported versions, the demo's table) are the recorded ones."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from .fixtures.hf_models import one_thread  # noqa: F401
from .fixtures.torchrun import offline_env

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


#: README shell commands the tests do not run, by how they start (after ``.venv/bin/``), and why; every other command
#: of every ```bash block runs as pasted (below), its placeholders filled in and its optional ``[...]`` left out.
NOT_RUN = {
    "bash scripts/install.sh": "installs from the network (CI runs the set-up's command 2 itself)",
    "geosharp run ": "a measurement on a dataset: tests/test_cli.py runs it on tiny models",
    "geosharp leaderboard ": "many measurements: tests/test_leaderboard.py",
    "geosharp card ": "needs a run's results, and --push the network: tests/test_cards.py",
    "geosharp demo": "trains a zoo: minutes",
    "geosharp register": "writes evaluate's module cache: tests/test_evaluate_module.py",
    "geosharp export-space ": "builds a wheel and needs the `space` extra: tests/test_gradio_space.py",
    "python spaces_demo/app.py": "serves the app until stopped",
}
#: What the runnable commands' placeholders stand for: a tiny saved model, and a folder to write.
PLACEHOLDERS = {"PATH_OR_ID": "{model}", "MODEL": "{model}", "OUT": "{out}"}
ACTIVATE = ". .venv/bin/activate"


def _commands(block: str, chains: bool = True) -> list[str]:
    """The commands of a shell block: its lines without comments; with ``chains=False``, ``&&`` chains split."""
    lines = [line.split("  #", 1)[0].strip() for line in block.splitlines() if not line.lstrip().startswith("#")]
    return [part.strip() for line in lines if line for part in ([line] if chains else line.split("&&"))]


def _skipped(command: str) -> str | None:
    """Why ``command`` is not run (``NOT_RUN``), or None: a chain is skipped where any of its commands is."""
    return next((why for part in command.split("&&") for start, why in NOT_RUN.items()
                 if part.strip().removeprefix(".venv/bin/").startswith(start)), None)


def test_every_shell_block_names_the_venv_once():
    """``geosharp`` and ``python`` run from the venv that scripts/install.sh makes: each block either activates it
    first, or names ``.venv/bin/`` on every such command (bare ``geosharp`` is "command not found" otherwise)."""
    assert "-m venv .venv\n" in (REPO / "scripts" / "install.sh").read_text(), "the venv the blocks name"
    blocks = _blocks(README, "bash")
    assert len(blocks) >= 3, "the set-up, the command line and the Space"
    for block in blocks:
        commands = _commands(block, chains=False)
        tools = [c for c in commands if re.match(r"(\.venv/bin/)?(geosharp|python)\b", c)]
        if commands[0] == ACTIVATE:
            assert not [c for c in tools if c.startswith(".venv/")], f"activated, then named again: {block}"
        else:
            assert ACTIVATE not in commands, f"activate it before the first command: {block}"
            assert all(c.startswith(".venv/bin/") for c in tools), f"a bare command without the venv: {block}"


def _fake_venv(root: Path) -> dict[str, str]:
    """``root/.venv`` as scripts/install.sh leaves it, for this checkout: ``bin/activate`` puts ``bin`` first on the
    PATH, ``bin/geosharp`` and ``bin/python`` are this interpreter on this repository's package. Returns the
    environment of a fresh shell, whose PATH has no ``geosharp``."""
    venv = root / ".venv" / "bin"
    venv.mkdir(parents=True)
    (venv / "activate").write_text(f'export PATH="{venv}:$PATH"\n')
    for name, args in {"geosharp": "-m hf_geosharp", "python": ""}.items():
        (venv / name).write_text(f'#!/bin/sh\nexec "{sys.executable}" {args} "$@"\n')
        (venv / name).chmod(0o755)
    return {**offline_env(), "PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)}


def test_the_cheap_shell_commands_run_as_pasted(tmp_path):
    """Each README shell block's commands that ``NOT_RUN`` does not name run in bash from a folder holding the venv,
    in the block's order (so an activation carries over), and exit 0; the options every command names (skipped or
    not) are options of its sub-command. Without the activation the same commands are "command not found"."""
    from hf_geosharp.cli import build_parser, option_names

    from .fixtures.hf_models import save_text_model

    env = _fake_venv(tmp_path)
    model = save_text_model(tmp_path / "model")
    ran = []
    for block in _blocks(README, "bash"):
        script = []
        for command in _commands(block):
            words = command.removeprefix(".venv/bin/").split()
            if words[0] == "geosharp" and "&&" not in command:
                unknown = set(re.findall(r"(?<![\w-])--[\w-]+", command)) - option_names(build_parser(words),
                                                                                      words[1])
                assert not unknown, f"{command}: geosharp {words[1]} has no {sorted(unknown)}"
            if _skipped(command):
                continue
            runnable = re.sub(r"\s*\[[^]]*\]", "", command)
            for placeholder, value in PLACEHOLDERS.items():
                runnable = re.sub(rf"\b{placeholder}\b", value, runnable)
            runnable = runnable.format(model=model, out=tmp_path / "moved")
            assert not re.search(r"\b[A-Z][A-Z_]{2,}\b", runnable), f"a placeholder PLACEHOLDERS lacks: {runnable}"
            script.append(runnable)
        if script:
            done = subprocess.run(["bash", "-ec", "\n".join(script)], cwd=tmp_path, env=env, capture_output=True,
                                  text=True, timeout=600)
            assert done.returncode == 0, f"{script}: {done.stderr[-2000:]}"
            ran += script
    assert ACTIVATE in ran and any(c.startswith("geosharp symmetry") for c in ran), ran
    assert (tmp_path / "moved" / "config.json").is_file()  # geosharp reparametrize MODEL OUT wrote its copy
    bare = subprocess.run(["bash", "-c", "geosharp --version"], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert bare.returncode == 127, "without the activation there is no geosharp (the control of the test)"


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
