"""No silence in a log from the long jobs of ``geosharp leaderboard`` and ``geosharp demo``: where no bar shows
(stderr not a terminal), the zoo's training, each result of a leaderboard and each measurement of hide & seek start
with a plain ``progress:`` line, and the engine's lines run inside each measure; ``--quiet`` and a cached rerun write
none. On the mini zoo, trained into a folder of this module's own so that its training is seen."""

from __future__ import annotations

import contextlib
import io
import re

import pytest

from hf_geosharp import cli
from hf_geosharp.engine.progress import PROGRESS_ENV, Stage, progress_lines
from hf_geosharp.zoo import build_zoo, torch_threads, zoo_members

FAST = ["--n-examples", "32", "--batch-size", "32", "--steps", "1"]
MEASURES = ("geodesic_inv_worst", "geodesic_mix_worst", "adaptive_clean_worst")
JOB_LINE = re.compile(r"progress: (.+?), (\d+)/(\d+) (\w+)s done, now (.+), \d+:\d\d:\d\d elapsed$")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The mini zoo trained while a face listens, and what the face was told."""
    told: list = []
    with pytest.MonkeyPatch.context() as mp, torch_threads(1):
        mp.delenv(PROGRESS_ENV, raising=False)
        with contextlib.redirect_stderr(io.StringIO()), progress_lines(told.append):
            zoo = build_zoo("mini", tmp_path_factory.mktemp("zoo"), progress=True)
    return zoo, told


@pytest.fixture(autouse=True)
def no_forced_progress(monkeypatch):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    with torch_threads(1):
        yield


def _jobs(err: str, job: str) -> list[tuple[int, int, str, str]]:
    """(done, total, unit, item) of each line of ``job`` in ``err``."""
    found = [JOB_LINE.match(line) for line in err.splitlines()]
    return [(int(m[2]), int(m[3]), m[4], m[5]) for m in found if m is not None and m[1] == job]


def test_training_the_zoo_reports_each_model_as_it_starts(trained):
    zoo, told = trained
    names = [m.name for m in zoo_members("mini")]
    assert all(isinstance(t, Stage) and t.job == "training zoo" and t.total == len(names) for t in told), told
    assert [(t.done, t.item) for t in told] == list(enumerate(names))
    assert [t.elapsed for t in told] == sorted(t.elapsed for t in told)


def test_the_leaderboard_writes_a_line_per_result_into_a_log_and_none_when_quiet(trained, tmp_path, capsys):
    zoo, _ = trained
    model = str(zoo.model_dirs[0])
    argv = ["leaderboard", model, "--dataset", str(zoo.data_dir), "--measures", "adaptive", *FAST]
    assert cli.main([*argv, "--out", str(tmp_path / "quiet"), "--quiet"]) == 0
    assert "progress: " not in capsys.readouterr().err
    assert cli.main([*argv, "--out", str(tmp_path / "log")]) == 0
    err = capsys.readouterr().err
    name = zoo.model_dirs[0].name
    assert _jobs(err, "leaderboard") == [(0, 2, "result", f"{name}: adaptive_clean_worst"),
                                         (1, 2, "result", f"{name}: parameter norm and clean loss")], err
    assert "progress: adaptive_clean_worst, batch 1/1, done after 1 steps" in err  # the engine's, inside the measure


def test_the_demo_writes_lines_for_its_leaderboard_and_hide_and_seek_and_none_when_cached(trained, tmp_path, capfd):
    zoo, _ = trained
    argv = ["demo", "--size", "mini", "--cache-dir", str(zoo.root), "--out", str(tmp_path), *FAST, "--hide-steps", "1",
            "--rho-sweep", "none"]
    assert cli.main(argv) == 0  # in a child process on the portable kernels: its stderr is this process's descriptor
    err = capfd.readouterr().err
    board, seek = _jobs(err, "leaderboard"), _jobs(err, "hide & seek")
    names = [d.name for d in zoo.model_dirs]
    for name in names:
        assert {f"{name}: {m}" for m in MEASURES} <= {item for *_, item in board}, err
        assert {f"{name} as trained", f"{name} under a random element"} <= {item for *_, item in seek}, err
    for lines, total in ((board, 6 * len(names)), (seek, 3 * len(names) + 2)):  # 6 results a model; 3 stages + 2
        done = [d for d, *_ in lines]
        assert done == sorted(set(done)) and done[-1] < total and {t for _, t, *_ in lines} == {total}
    assert all(line.endswith(" elapsed") for line in err.splitlines() if line.startswith("progress: "))

    assert cli.main(argv) == 0  # everything cached: nothing is measured, nothing reported
    assert "progress: " not in capfd.readouterr().err
