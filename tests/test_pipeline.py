"""The measuring pipeline under the faces: a typed request in, the registry's results out, with the same numbers the
public functions give; the symmetry map made once and only where a measure (or a face) needs it; the memoised store
computing each record once; and the public keywords spelled one way, the old ones deprecated."""

from __future__ import annotations

import math

import pytest
import torch

import hf_geosharp as gs
from hf_geosharp.leaderboard.store import ResultStore
from hf_geosharp.measures import Settings
from hf_geosharp.pipeline import Memo, Request, measure, prepare

from .fixtures.hf_models import one_thread  # noqa: F401  (autouse: one torch thread for tiny models)
from .fixtures.intact import assert_intact, snapshot, tiny_batches, tiny_bert

SETTINGS = Settings(rho=0.05, steps=3)


def test_the_pipeline_gives_the_public_functions_numbers_and_leaves_the_model_intact():
    model, batches = tiny_bert(), tiny_batches()
    before = snapshot(model)
    results = measure(Request(model, batches, ["inv", "adaptive"], SETTINGS))
    assert list(results) == ["geodesic_sharpness_inv", "adaptive_sharpness"]  # keys, in the order asked
    assert_intact(model, before)
    geodesic = gs.geodesic_sharpness(model, batches, rho=0.05, steps=3, progress=False)
    adaptive = gs.adaptive_sharpness(model, batches, rho=0.05, steps=3, progress=False)
    assert results["geodesic_sharpness_inv"].per_batch == geodesic.per_batch  # the same bits
    assert results["adaptive_sharpness"].per_batch == adaptive.per_batch
    assert results["geodesic_sharpness_inv"].measure == "geodesic_inv_worst"  # the engine name of the run


def test_the_map_is_made_only_where_needed_and_its_report_kept():
    model, batches = tiny_bert(), tiny_batches(n=1)
    plain = prepare(Request(model, batches, ["adaptive"]))
    assert plain.symmetry_map is None and plain.symmetry_report is None and plain.note is None
    reported = prepare(Request(model, batches, ["adaptive"], map_always=True))
    assert reported.symmetry_report is not None and reported.symmetry_report["blocks"]
    assert reported.symmetry_map is None  # the report is kept, the map's index maps are not
    geodesic = prepare(Request(model, batches, ["inv", "mix"], SETTINGS))
    assert geodesic.symmetry_report["blocks"] and geodesic.note is None  # a BERT has pairs: nothing to note
    assert not geodesic.sharded and geodesic.world == 1 and geodesic.accelerator is None
    one = geodesic.measure_one("geodesic_sharpness_mix")
    assert one.per_batch == geodesic.measure()["geodesic_sharpness_mix"].per_batch
    seconds = geodesic.estimate_seconds()
    assert math.isfinite(seconds) and seconds > 0
    given = gs.map_symmetries(model)
    assert prepare(Request(model, batches, ["inv"], SETTINGS, symmetry_map=given)).symmetry_map is given


def test_no_map_made_by_the_pipeline_is_held_while_a_solver_runs(monkeypatch):
    """A map's index maps are 8 bytes per paired coordinate (2 bytes per parameter of BERT-base): held by the pipeline
    through every measure they would count against each solve's memory goal. Each geodesic measure maps the model for
    its own run and frees that map before its solver starts; the numbers are those of one shared map."""
    import hf_geosharp.pipeline.measuring as measuring

    from .fixtures.map_lifetime import watch_maps

    watch = watch_maps(monkeypatch, measuring)
    model, batches = tiny_bert(), tiny_batches(n=1)
    results = measure(Request(model, batches, ["inv", "mix"], SETTINGS, map_always=True))
    # the request's map, then one per measure, none alive in a solve
    assert watch.alive_counts() == [0, 0] and len(watch.made) >= 3
    shared = watch.map(model)  # counted in made
    with_one = measure(Request(model, batches, ["inv", "mix"], SETTINGS, symmetry_map=shared))
    assert watch.alive_counts()[2:] == [1, 1]  # only the caller's map is alive: it stays the caller's
    assert {k: r.per_batch for k, r in results.items()} == {k: r.per_batch for k, r in with_one.items()}


def test_an_unknown_measure_is_refused_before_any_work():
    model = tiny_bert()
    forwards = []
    model.register_forward_pre_hook(lambda module, inputs: forwards.append(1))
    with pytest.raises(ValueError, match="unknown measure 'sharpest'"):
        prepare(Request(model, tiny_batches(), ["inv", "sharpest"]))
    assert not forwards


def test_the_memo_computes_each_record_once_and_rereads_another_writer(tmp_path):
    path = tmp_path / "results.jsonl"
    memo, calls = Memo(ResultStore(path)), []

    def compute() -> dict:
        calls.append(1)
        return {"kind": "test", "value": 1.5}

    first = memo("k1", compute)
    assert first == {"key": "k1", "kind": "test", "value": 1.5} and calls == [1]
    assert memo("k1", compute) == first and calls == [1]  # stored: not computed again
    assert Memo(ResultStore(path))("k1", compute) == first and calls == [1]  # and kept on disk
    reader, blind = Memo(ResultStore(path), reread=True), Memo(ResultStore(path))
    ResultStore(path).put({"key": "k2", "kind": "test", "value": 2.0})  # another process writes
    assert reader.get("k2") == {"key": "k2", "kind": "test", "value": 2.0}
    assert blind.get("k2") is None  # without reread, the store as first read


def test_symmetry_map_is_the_one_keyword_and_smap_is_deprecated():
    model, batches = tiny_bert(), tiny_batches(n=1)
    smap = gs.map_symmetries(model)
    with pytest.warns(DeprecationWarning, match=r"reparametrize\(smap=...\) is deprecated.*symmetry_map="):
        old = gs.reparametrize(tiny_bert(), seed=3, smap=smap)
    new = gs.reparametrize(tiny_bert(), seed=3, symmetry_map=smap)
    assert all(torch.equal(a, b) for a, b in zip(old, new))
    with pytest.raises(TypeError, match="symmetry_map= only"):
        gs.reparametrize(model, symmetry_map=smap, smap=smap)
    with pytest.warns(DeprecationWarning, match=r"hide\(smap=...\) is deprecated"):
        gs.hide(model, batches, target="flat", search_steps=2, evaluate=False, smap=smap)
