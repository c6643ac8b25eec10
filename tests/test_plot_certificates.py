"""The figures every face draws mark a value that is not certified, as the tables do with ``≥``: the profile's dot
at rho is hollow and named in the legend, and a leaderboard heat map's title says its worst case is not certified."""

from __future__ import annotations

import pytest

pytest.importorskip("matplotlib")

from hf_geosharp.engine.result import Profile, SharpnessResult, certificate_words  # noqa: E402
from hf_geosharp.plots import profile_figure  # noqa: E402


def _result(converged: bool, value: float) -> SharpnessResult:
    profile = Profile(t=[0.0, 1.0, 2.0], geodesic=[[0.0, value, 3 * value]], segment=[[0.0, value, 2 * value]])
    return SharpnessResult(value=value, per_batch=[value], clean_loss=0.3, per_batch_clean_loss=[0.3],
                           measure="adaptive_clean_worst", config={"mode": "worst", "rho": 0.1}, converged=converged,
                           profile=profile, certificate="certified" if converged else "not_certified")


def test_the_profile_marks_the_value_of_an_uncertified_worst_case_as_a_lower_bound():
    fig = profile_figure({"adaptive_sharpness": _result(False, 0.2), "geodesic_sharpness_inv": _result(True, 0.1)},
                         "tiny")
    dots = [line for line in fig.axes[0].get_lines() if line.get_marker() == "o"]
    assert len(dots) == 2
    bound, sure = dots
    assert bound.get_markerfacecolor() == "none" and sure.get_markerfacecolor() != "none"
    legend = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [t for t in legend if certificate_words(False) in t] == [f"Adaptive sharpness: {certificate_words(False)}"]


def test_a_heat_map_of_an_uncertified_worst_case_says_so_in_its_title(tmp_path, monkeypatch):
    from hf_geosharp.leaderboard import Leaderboard, report

    titles = []
    monkeypatch.setattr("hf_geosharp.plots.breakdown_heatmap", lambda breakdown, title: titles.append(title))
    monkeypatch.setattr("hf_geosharp.plots.save_figure", lambda fig, path: None)
    def record(converged: bool) -> dict:
        return {"measure": "geodesic_inv_worst", "config": {"mode": "worst"}, "converged": converged,
                "breakdown": {"heads": [{"name": "h"}]}}

    board = Leaderboard([], ["geodesic_inv_worst"], None, results={"a": [record(True)], "b": [record(False)]})
    report.heatmaps(board, tmp_path)
    assert titles == ["a, geodesic_inv_worst", "b, geodesic_inv_worst (not certified: the best perturbation found)"]
