"""Progress bars show only where they were asked for and then only on a terminal: a log file, CI or a pipe gets no
bar lines unless ``--progress`` or ``HF_GEOSHARP_PROGRESS=1`` asks for them; ``HF_GEOSHARP_PROGRESS=0`` hides them."""

from __future__ import annotations

import contextlib
import io
import os

import pytest
import torch

import hf_geosharp as gs
from hf_geosharp import cli
from hf_geosharp.engine.progress import PROGRESS_ENV, Tick, progress_lines

from .fixtures.hf_models import one_thread, save_text_model, tiny_bert, write_csv  # noqa: F401


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def _bar(stream: io.StringIO, progress: bool = True) -> str:
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 100, (4, 8), generator=g), "labels": torch.tensor([0, 1, 0, 1])}]
    with contextlib.redirect_stderr(stream):
        gs.adaptive_sharpness(tiny_bert(), batches, steps=1, progress=progress)
    return stream.getvalue()


@pytest.mark.parametrize(("stream", "forced", "progress", "shown"), [
    (io.StringIO, None, True, False),  # a log file: no bar
    (Terminal, None, True, True),  # a terminal: the bar
    (io.StringIO, "1", True, True),  # asked for: the bar in the log too
    (Terminal, "0", True, False),  # hidden everywhere
    (Terminal, "1", False, False),  # never where the caller did not ask
])
def test_a_bar_shows_on_a_terminal_or_when_forced(monkeypatch, stream, forced, progress, shown):
    if forced is None:
        monkeypatch.delenv(PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRESS_ENV, forced)
    printed = _bar(stream(), progress)
    assert ("adaptive_clean_worst" in printed and "batch" in printed) is shown, printed


def test_the_command_line_progress_flag_forces_bars_for_the_command_only(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    model, data = save_text_model(tmp_path / "bert"), write_csv(tmp_path / "reviews.csv", 8)
    argv = ["run", "--model", str(model), "--dataset", str(data), "--n-examples", "4", "--batch-size", "4",
            "--measures", "adaptive", "--steps", "1"]
    assert cli.main(argv) == 0
    assert "adaptive_clean_worst:" not in capsys.readouterr().err  # captured output is not a terminal
    assert cli.main([*argv, "--progress"]) == 0
    assert "adaptive_clean_worst:" in capsys.readouterr().err
    assert PROGRESS_ENV not in os.environ  # the flag holds for its command only


def _ticks(stream: io.StringIO, progress: bool = True, every: float = 0.0) -> tuple[list, str]:
    """The ticks a listening face receives from a two-batch, three-step measurement, and what stderr got."""
    g = torch.Generator().manual_seed(0)
    batches = [{"input_ids": torch.randint(0, 100, (4, 8), generator=g), "labels": torch.tensor([0, 1, 0, 1])}
               for _ in range(2)]
    ticks: list[Tick] = []
    with contextlib.redirect_stderr(stream), progress_lines(ticks.append, every=every):
        gs.adaptive_sharpness(tiny_bert(), batches, steps=3, progress=progress)
    return ticks, stream.getvalue()


def test_a_log_gets_progress_lines_with_the_measure_and_batch_counts(monkeypatch):
    """Where the bar does not show (stderr not a terminal), the face hears every batch's end and, with a short
    interval, the steps within it; stderr itself gets no bar."""
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    ticks, printed = _ticks(io.StringIO())
    ends = [t for t in ticks if t.done]
    assert [(t.measure, t.batch, t.n_batches) for t in ends] == [("adaptive_clean_worst", 1, 2),
                                                                   ("adaptive_clean_worst", 2, 2)]
    assert all(t.steps >= 1 and t.elapsed >= 0 for t in ends)
    steps = [t for t in ticks if not t.done]
    assert steps and all(t.n_steps == 3 and 1 <= t.steps <= 3 and t.n_batches == 2 for t in steps)
    assert [t.batch for t in ticks] == sorted(t.batch for t in ticks)  # in order
    assert "adaptive_clean_worst" not in printed
    ends_only, _ = _ticks(io.StringIO(), every=3600.0)  # a long interval: the batch ends alone
    assert [t.batch for t in ends_only] == [1, 2] and all(t.done for t in ends_only)


@pytest.mark.parametrize(("stream", "forced", "progress"), [
    (Terminal, None, True),  # the bar shows instead
    (io.StringIO, None, False),  # not asked for (--quiet)
    (io.StringIO, "0", True),  # hidden everywhere
    (io.StringIO, "1", True),  # the bar is forced into the log
])
def test_no_progress_lines_where_a_bar_shows_or_none_was_asked_for(monkeypatch, stream, forced, progress):
    if forced is None:
        monkeypatch.delenv(PROGRESS_ENV, raising=False)
    else:
        monkeypatch.setenv(PROGRESS_ENV, forced)
    assert _ticks(stream(), progress)[0] == []


def test_the_command_line_prints_progress_lines_into_a_log(tmp_path, monkeypatch, capsys):
    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    model, data = save_text_model(tmp_path / "bert"), write_csv(tmp_path / "reviews.csv", 8)
    argv = ["run", "--model", str(model), "--dataset", str(data), "--n-examples", "8", "--batch-size", "4",
            "--measures", "inv,adaptive", "--steps", "2"]
    assert cli.main(argv) == 0
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("progress: ")]
    for measure in ("geodesic_inv_worst", "adaptive_clean_worst"):
        assert [line.split(", ")[1] for line in lines if line.startswith(f"progress: {measure},")] == \
            ["batch 1/2", "batch 2/2"], lines
    assert all(line.endswith(" elapsed") and "done after" in line for line in lines)
    assert cli.main([*argv, "--quiet"]) == 0
    assert "progress: " not in capsys.readouterr().err
