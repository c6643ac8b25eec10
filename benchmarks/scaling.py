"""Scaling suite: how the geometry's cost grows with heads, head size and sequence length, and time vs batches.

* ``geometry``: the per-step work of the quotient geometry alone (Riemannian gradient with horizontal projection,
  ``Exp2`` written into a buffer, its vector-Jacobian product, three gradient inner products) for one attention layer,
  ``k`` heads of size ``h`` with ``d = k h`` (BERT layout: QK and VO pairs, biases appended). docs/spec.md §6 predicts
  ``O(k (d + 1) h^2)`` flops per layer for ``~4 k (d + 1) h`` parameters: the cost *per parameter* should grow like
  ``h`` and not depend on ``k`` (plus the ``O(k h^3)`` small solves, which matter only for tiny ``d``).
* ``sequence``: that same geometry on the whole MiniLM-sized model against one forward+backward as the sequence grows:
  the geometry does not depend on the tokens, the model's work does, so its share falls with batch x sequence.
* ``batches``: total geodesic time against the number of batches; each batch is solved separately, so time per batch
  should stay flat (the space is built once per call).
* ``threads``: wall time at one and two torch threads, MiniLM and BERT-base at 8 x 128 tokens, of a plain
  forward+backward, of a step's vector work over every parameter (the clean solver's: no pairs) and of the geodesic
  step (vector work plus pair geometry), next to the memory bandwidth of a parameter-sized ``c = a + b``. The floor
  suite times wall with every thread; the model's large products use them all, a step's passes over the parameter
  vectors and its small pair products scale less, so their share of a step grows with the threads (CPU only).
"""

from __future__ import annotations

import time
from typing import Any

import torch

import hf_geosharp as gs
from hf_geosharp.engine.solvers.pool import Pool
from hf_geosharp.engine.space.perturbation_space import PerturbationSpace, SpaceOptions
from hf_geosharp.symmetry.base import PairBlock

from .common import forward_backward, interleaved, synchronize
from .config import RunConfig
from .models import BERT_BASE, MINILM, bert_batches, bert_classifier, symmetry_map


def _layer_space(heads: int, h: int, metric: str, device: str) -> PerturbationSpace:
    """A flat vector holding one BERT-layout attention layer (QK and VO pair blocks), random weights of BERT scale."""
    d = heads * h
    shapes = [(heads, d + 1, h), (heads, d + 1, h), (heads, d + 1, h), (heads, d, h)]
    sizes = [heads * a * b for _, a, b in shapes]
    g = torch.Generator().manual_seed(0)
    theta0 = (0.04 * torch.randn(sum(sizes), generator=g)).to(device)
    starts = torch.tensor([0] + sizes).cumsum(0).tolist()
    index = [torch.arange(starts[i], starts[i + 1]).view(shapes[i]) for i in range(4)]
    blocks = [PairBlock("qk", "layer", index[0], index[1]), PairBlock("vo", "layer", index[2], index[3])]
    return PerturbationSpace(theta0, blocks, SpaceOptions(metric))


def geometry_step_seconds(space: PerturbationSpace, device: str, repeats: int) -> float:
    """Minimum seconds of one solver step's geometry on ``space`` (everything a step does besides the model)."""
    g = torch.Generator().manual_seed(1)
    like = space.zero()
    egrad = torch.randn(space.numel, generator=g).to(like)
    pool = Pool(like, 5)
    xi, xi_prev, d = pool.free(), pool.rows[1], pool.rows[2]
    xi.copy_(space.project(1e-3 * torch.randn(space.numel, generator=g).to(like), 0.1))
    xi_prev.copy_(xi)
    theta, grad = torch.empty_like(xi), egrad.clone()

    def step() -> None:  # what apgd does per step besides calling the model (see hf_geosharp.engine.solvers.apgd.apgd)
        space.ascent_direction(egrad, pool.stacked([xi, xi_prev]), out=d)
        pool.combine_into(d, 0.5, [(0.3, xi), (0.2, xi_prev)])
        pullback = space.exp_point(xi, theta, True)
        if pullback is not None:
            pullback(grad)

    step()
    samples = []
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        step()
        synchronize(device)
        samples.append(time.perf_counter() - t0)
    return min(samples)  # load from other processes only adds time


def _stream_seconds(n: int, device: str, repeats: int) -> float:
    """Minimum seconds of ``c = a + b`` on float32 vectors of ``n`` entries (12 n bytes moved)."""
    a, b = torch.ones(n, device=device), torch.ones(n, device=device)
    c = torch.empty_like(a)
    timings, _ = interleaved({"add": lambda: torch.add(a, b, out=c)}, repeats, device,
                             warmup=lambda: torch.add(a, b, out=c))
    return timings["add"].wall


def thread_scaling(cfg: RunConfig, reps: int) -> list[dict[str, Any]]:
    """Wall seconds at 1 and 2 torch threads of a forward+backward, a step's vector work and a geodesic step."""
    rows, threads = [], torch.get_num_threads()
    try:
        for size in (MINILM, BERT_BASE):
            model = bert_classifier(size, device=cfg.device)
            smap, _ = symmetry_map(model)
            batch = bert_batches(model, n_batches=1, batch_size=8, seq_len=128)[0]
            params = [p.detach() for p in model.parameters()]
            n = sum(p.numel() for p in params)
            for count in (1, 2):
                torch.set_num_threads(count)
                timings, _ = interleaved({"fb": lambda: forward_backward(model, batch)}, reps, cfg.device,
                                         warmup=lambda: forward_backward(model, batch))
                row = {"model": size.name, "n_params": n, "threads": count, "tokens_per_batch": 8 * 128,
                       "forward_backward_s": timings["fb"].wall,
                       "stream_gb_per_s": 12 * n / _stream_seconds(n, cfg.device, reps) / 1e9}
                for metric in ("none", "inv", "mix"):
                    space = PerturbationSpace(params, smap.blocks, SpaceOptions(None if metric == "none" else metric))
                    row[f"step_{metric}_s"] = geometry_step_seconds(space, cfg.device, reps)
                    del space
                rows.append(row)
            del model, params
    finally:
        torch.set_num_threads(threads)
    return rows


def run(cfg: RunConfig) -> dict[str, Any]:
    reps = max(3, cfg.repeats)
    geometry = []
    grid = [(12, h) for h in (16, 32, 64, 128)] + [(k, 64) for k in (4, 8, 16, 32)]
    for heads, h in dict.fromkeys(grid):
        for metric in ("inv", "mix"):
            t0 = time.perf_counter()
            space = _layer_space(heads, h, metric, cfg.device)
            setup = time.perf_counter() - t0
            n = space.numel
            step = geometry_step_seconds(space, cfg.device, reps)
            geometry.append({"heads": heads, "head_dim": h, "hidden": heads * h, "metric": metric, "n_params": n,
                             "setup_s": setup, "step_s": step, "ns_per_param": 1e9 * step / n})
            del space

    model = bert_classifier(MINILM, device=cfg.device)
    smap, source = symmetry_map(model)
    theta0 = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    space = PerturbationSpace(theta0, smap.blocks, SpaceOptions("inv"))
    geo_step = geometry_step_seconds(space, cfg.device, reps)
    sequence = []
    for seq in cfg.pick((32, 64, 128, 256), (32, 64, 128)):
        batch = bert_batches(model, n_batches=1, batch_size=8, seq_len=seq)[0]
        timings, _ = interleaved({"fb": lambda: forward_backward(model, batch)}, reps, cfg.device,
                                 warmup=lambda: forward_backward(model, batch))
        fb = timings["fb"].wall
        sequence.append({"batch_size": 8, "seq_len": seq, "forward_backward_s": fb, "geometry_step_s": geo_step,
                         "geometry_share": geo_step / (fb + geo_step)})
    del space, theta0

    batch_counts = cfg.pick((1, 2, 4), (1, 2, 4))
    steps = cfg.pick(10, 5)
    all_batches = bert_batches(model, n_batches=max(batch_counts), batch_size=8, seq_len=64)
    cases = {
        f"{b}": (lambda b=b: gs.geodesic_sharpness(model, all_batches[:b], rho=cfg.rho, steps=steps, symmetry_map=smap,
                                                    progress=False).value)
        for b in batch_counts
    }
    timings, _ = interleaved(cases, cfg.repeats, cfg.device, warmup=lambda: forward_backward(model, all_batches[0]))
    batches = [{"n_batches": int(b), "total_s": t.wall, "per_batch_s": t.wall / int(b)} for b, t in timings.items()]
    return {"suite": "scaling", "symmetry_map": source, "geometry": geometry,
            "sequence": sequence, "batches": {"steps": steps, "batch_size": 8, "seq_len": 64, "rows": batches},
            "threads": thread_scaling(cfg, reps) if cfg.device == "cpu" else []}


def table(result: dict[str, Any]) -> str:
    lines = ["Geometry alone, one attention layer (QK + VO blocks), one solver step:", "",
             "| heads | head dim h | hidden | metric | params | setup ms | step ms | ns / param |",
             "|---|---|---|---|---|---|---|---|"]
    for r in result["geometry"]:
        lines.append(f"| {r['heads']} | {r['head_dim']} | {r['hidden']} | {r['metric']} | {r['n_params']:,} | "
                     f"{1e3 * r['setup_s']:.1f} | {1e3 * r['step_s']:.2f} | {r['ns_per_param']:.2f} |")
    lines += ["", "Whole MiniLM-sized model (inv): geometry per step vs one forward+backward, batch 8:", "",
              "| seq len | fwd+bwd s | geometry step s | geometry share |", "|---|---|---|---|"]
    for r in result["sequence"]:
        lines.append(f"| {r['seq_len']} | {r['forward_backward_s']:.3f} | {r['geometry_step_s']:.3f} | "
                     f"{100 * r['geometry_share']:.1f} % |")
    b = result["batches"]
    lines += ["", f"Geodesic inv, MiniLM-sized, batch {b['batch_size']}x{b['seq_len']}, {b['steps']} steps:", "",
              "| batches | total s | s / batch |", "|---|---|---|"]
    for r in b["rows"]:
        lines.append(f"| {r['n_batches']} | {r['total_s']:.2f} | {r['per_batch_s']:.2f} |")
    lines += ["", "Wall ms at 8 x 128 tokens by torch threads: a forward+backward, a step's vector work over every "
              "parameter (no pairs), a geodesic step, and their share of the forward+backward:", "",
              "| model | threads | stream GB/s | fwd+bwd ms | vector work ms (share) | inv step ms (share) | "
              "mix step ms (share) |", "|---|---|---|---|---|---|---|"]
    for r in result.get("threads", []):
        fb = r["forward_backward_s"]
        cells = [f"{1e3 * r[f'step_{m}_s']:.0f} ({100 * r[f'step_{m}_s'] / fb:.1f} %)" for m in ("none", "inv", "mix")]
        lines.append(f"| {r['model']} | {r['threads']} | {r['stream_gb_per_s']:.1f} | {1e3 * fb:.0f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)
