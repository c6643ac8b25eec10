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
from hf_geosharp.engine.progress import PROGRESS_ENV

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
