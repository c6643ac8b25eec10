"""The GPU run (``python -m benchmarks.gpu``), end to end on the CPU with ``--tiny``: every part in its own capped
process, the JSON it writes, and the budget that keeps the whole run under 8 minutes."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks import gpu


def test_the_caps_fit_the_eight_minute_budget():
    assert gpu.BUDGET <= 8 * 60
    assert set(gpu.CAPS) == {"launch", "floor", "overhead", "llama"}
    assert all(cap <= 8 * 60 for cap in gpu.EXTRA_CAPS.values())  # a named extra part fits one run of its own


def test_a_tiny_run_writes_the_suites_and_the_decoders_json(tmp_path):
    gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--parts", "overhead,llama"])
    summary = json.loads((tmp_path / "gpu-cpu.json").read_text())
    assert [p["part"] for p in summary["parts"]] == ["overhead", "llama"]
    assert all(p["status"] == "ok" and p["seconds"] <= p["cap_s"] for p in summary["parts"])
    overhead = json.loads((tmp_path / "overhead-cpu.json").read_text())
    assert overhead["suite"] == "overhead" and overhead["rows"][0]["model"] == "tiny-2x32x4"
    llama = json.loads((tmp_path / "llama-cpu.json").read_text())
    assert llama["dtype"] == "bfloat16" and llama["config"]["num_key_value_heads"] == 2
    assert llama["n_params"] == sum(p.numel() for p in gpu.llama_inputs(True, "cpu")[0].parameters())
    assert llama["symmetry_blocks"] > 0  # the decoder's head pairs were mapped: geodesic inv measures them
    for name in gpu.MEASURES:
        m = llama["measures"][name]
        assert math.isfinite(m["step_s"]) and m["solve_over_floor"] > 0
        assert m["certificate"] in ("certified", "certified_at_precision", "not_certified")
        assert m["solver_bytes_per_param"] is None  # measured on CUDA only


def test_the_capture_part_runs_only_when_named_and_writes_its_suite(tmp_path):
    gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--parts", "capture"])
    (part,) = json.loads((tmp_path / "gpu-cpu.json").read_text())["parts"]
    assert part["part"] == "capture" and part["status"] == "ok"
    (row,) = json.loads((tmp_path / "capture-cpu.json").read_text())["rows"]
    assert row["compile"] == "aot_eager" and row["model"] == "tiny-2x32x4"
    assert all(v["relative_difference"] == 0.0 for v in row["values"].values())  # the eager kernels, the same bits
    assert "capture" not in gpu.CAPS  # the default run leaves it out


def test_a_part_past_its_cap_is_recorded_and_the_rest_skipped_when_the_budget_is_spent(tmp_path):
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path), "--parts", "llama,floor",
                  "--budget", str(gpu.RESERVE + 1)])
    assert stop.value.code == 1
    parts = json.loads((tmp_path / "gpu-cpu.json").read_text())["parts"]
    assert parts[0]["part"] == "llama" and parts[0]["status"].startswith("ran past its cap")
    assert parts[1] == {"part": "floor", "status": "skipped", "why": "the budget ran out", "seconds": 0.0}


@pytest.mark.skipif(torch.cuda.is_available(), reason="the refusal is for machines without CUDA")
def test_cuda_is_refused_before_any_work_without_a_gpu(tmp_path, capsys):
    with pytest.raises(SystemExit) as stop:
        gpu.main(["--out", str(tmp_path)])
    assert stop.value.code == 2 and "--device cpu --tiny" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())
