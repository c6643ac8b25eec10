"""Bad arguments to any entry point (every ``geosharp`` command, every experiment and benchmark): one line on stderr
naming the option, exit code 2, no traceback, and before any work (the functions that do the work are patched to
fail the test if they are reached)."""

from __future__ import annotations

import importlib
from pathlib import Path

import pytest

from hf_geosharp import cli


@pytest.fixture()
def paths(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "a-folder"
    folder.mkdir()
    file = tmp_path / "a-file.txt"
    file.write_text("x")
    return {"folder": folder, "file": file, "missing": tmp_path / "missing.md"}


def _one_line_usage_error(main, argv: list[str], capsys, *words: str) -> str:
    with pytest.raises(SystemExit) as info:
        main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert info.value.code == 2, err
    assert len(lines) == 1 and "error:" in lines[0] and "Traceback" not in err, err
    assert all(w in lines[0] for w in words), lines[0]
    return lines[0]


def _no_work(monkeypatch, module, *names: str) -> None:
    for name in names:
        monkeypatch.setattr(module, name, lambda *a, _name=name, **k: pytest.fail(f"{_name} ran despite a usage error"))


MINILM = [
    (["--n-models", "0"], "--n-models", "must be positive"),
    (["--n-models", "-3"], "--n-models", "must be positive"),
    (["--threads", "0"], "--threads", "must be positive"),
    (["--store", "{folder}"], "--store", "is a folder"),
    (["--cache", "{file}"], "--cache", "is a file"),
    (["--spot-check", "minilm-99"], "--spot-check 'minilm-99' is not a member", "minilm-00"),
    (["--doc", "{missing}"], "--doc", "does not exist"),
    (["--report", "--doc", "{file}"], "--doc", "has no generated section"),
    (["--stages", "train,bogus"], "--stages", "train,main,adversarial,sweep"),
    (["--library", "0.0.1"], "--library 0.0.1", "--status"),
]


@pytest.mark.parametrize(("argv", "option", "why"), MINILM, ids=[" ".join(a) for a, _, _ in MINILM])
def test_minilm_family_refuses_bad_arguments_in_one_line(paths, monkeypatch, capsys, argv, option, why):
    family = importlib.import_module("experiments.minilm_family.cli")
    _no_work(monkeypatch, family, "run", "spot_check", "report", "status")
    argv = [a.format(**paths) for a in argv]
    _one_line_usage_error(family.main, argv, capsys, option, why)
    assert [p.name for p in paths["folder"].iterdir()] == [] and paths["file"].read_text() == "x"


def test_minilm_family_accepts_what_it_documents(monkeypatch, capsys):
    family = importlib.import_module("experiments.minilm_family.cli")
    args = family.parse_args(["--spot-check", "minilm-03", "--threads", "2", "--stages", "main, sweep"])
    assert args.spot_check == "minilm-03" and args.threads == 2 and args.stages == ("main", "sweep")


DIAGONAL = [
    (["--n-nets", "0"], "--n-nets"), (["--rho", "-1"], "--rho"), (["--threads", "0"], "--threads"),
    (["--seed", "-1"], "--seed"), (["--nonzeros", "300"], "--nonzeros 300 exceeds --dim 200"),
    (["--alpha-range", "1", "0.1"], "--alpha-range"), (["--out", "{file}"], "is a file"),
    (["--rho-grid", "0.1", "nan"], "--rho-grid"),
]
OTHERS = [
    ("experiments.coverage", ["--timeout", "0"], "--timeout"),
    ("experiments.coverage", ["--types", "bert,not_a_model_type"], "not_a_model_type"),
    ("experiments.coverage", ["--json", "{folder}"], "is a folder"),
    ("experiments.convergence_audit", ["--steps", "3"], "unrecognized arguments"),
    ("experiments.epsilon_conditioning", ["--rho", "1"], "unrecognized arguments"),
    ("benchmarks.__main__", ["--repeats", "0"], "--repeats"),
    ("benchmarks.__main__", ["--threads", "-1"], "--threads"),
    ("benchmarks.__main__", ["--suite", "nope"], "unknown suite"),
    ("benchmarks.__main__", ["--suite", "floor", "--only", "minilm-3x3"], "--only names no workload"),
    ("benchmarks.__main__", ["--out", "{file}"], "is a file"),
    ("benchmarks.cuda_agreement", ["--out", "{folder}"], "is a folder"),
]


@pytest.mark.parametrize(("argv", "words"), DIAGONAL, ids=[" ".join(a) for a, _ in DIAGONAL])
def test_diagonal_networks_refuses_bad_arguments_in_one_line(paths, monkeypatch, capsys, argv, words):
    module = importlib.import_module("experiments.diagonal_networks")
    _no_work(monkeypatch, module, "run")
    _one_line_usage_error(module.main, [a.format(**paths) for a in argv], capsys, words)


@pytest.mark.parametrize(("module", "argv", "words"), OTHERS, ids=[f"{m} {' '.join(a)}" for m, a, _ in OTHERS])
def test_every_experiment_and_benchmark_refuses_bad_arguments_in_one_line(paths, monkeypatch, capsys, module, argv,
                                                                          words):
    module = importlib.import_module(module)
    for name in ("sweep", "worker", "tiny_bert", "batches", "run"):
        if hasattr(module, name):
            _no_work(monkeypatch, module, name)
    _one_line_usage_error(module.main, [a.format(**paths) for a in argv], capsys, words)


GEOSHARP = [
    (["demo", "--threads", "0"], "--threads"),
    (["demo", "--hide-steps", "0"], "--hide-steps"),
    (["demo", "--cache-dir", "{file}"], "is a file"),
    (["demo", "--out", "{file}"], "is a file"),
    (["leaderboard", "m", "--dataset", "d", "--max-length", "0"], "--max-length"),
    (["leaderboard", "m", "--dataset", "d", "--gap", "{missing}"], "does not exist"),
    (["leaderboard", "m", "--dataset", "d", "--out", "{file}"], "is a file"),
    (["reparametrize", "m", "{folder}", "--seed", "-1"], "--seed"),
    (["reparametrize", "m", "{folder}", "--rho", "0"], "--rho"),
    (["reparametrize", "m", "{folder}", "--n-examples", "0"], "--n-examples"),
    (["run", "m", "--steps", "0"], "--steps"),
    (["no-such-command"], "invalid choice"),
]


@pytest.mark.parametrize(("argv", "words"), GEOSHARP, ids=[" ".join(a) for a, _ in GEOSHARP])
def test_every_geosharp_command_refuses_bad_arguments_in_one_line(paths, capsys, argv, words):
    line = _one_line_usage_error(cli.main, [a.format(**paths) for a in argv], capsys, words)
    assert "--help lists the options" in line
