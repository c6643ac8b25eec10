"""The capture suite (benchmarks/capture.py) end to end on a tiny BERT: eager and captured solves in alternating
rounds, their shares of the floor, the first captured solve timed alone and the values compared. On the CPU of a
test the capture runs with ``aot_eager`` (the eager kernels: inductor compiles for minutes on a CI CPU), which gives
the eager values bit for bit."""

from __future__ import annotations

import math

from benchmarks import capture, models
from benchmarks.config import RunConfig, Workload


def test_the_capture_suite_times_eager_and_captured_solves_against_the_floor(monkeypatch):
    monkeypatch.setitem(models.SIZES, "tiny", models.ModelSize("tiny-2x32x4", 2, 32, 4))
    monkeypatch.setattr(capture, "workloads", lambda cfg: [Workload("tiny", 2, 8, 2)])
    monkeypatch.setattr(capture, "capture_choice", lambda device: "aot_eager")
    result = capture.run(RunConfig(device="cpu", quick=True, repeats=2))
    (row,) = result["rows"]
    assert row["compile"] == "aot_eager"
    assert set(row["shares"]) == {f"{m}/{c}" for m in capture.MEASURES for c in ("off", "aot_eager")}
    for case, share in row["shares"].items():
        assert len(share["rounds"]) == 2 and share["total_s"] > 0 and share["non_model_share_cpu"] < 1, case
    for measure in capture.MEASURES:
        assert row["first_captured_solve"][measure]["cpu"] > 0
        values = row["values"][measure]
        assert math.isfinite(values["off"]) and values["off"] > 0
        assert values["relative_difference"] == 0.0  # aot_eager: the eager kernels, the same bits
    table = capture.table(result)
    assert table.count("| tiny-2x32x4 |") == 2 * len(capture.MEASURES)
