"""Step-profile suite: where a solver step's time goes, stage by stage.

Each worst-case measure is solved at two step counts with every engine stage wrapped in a timer; the per-step cost
of a stage is the difference between the two runs divided by the difference in steps, so the one-off work (building
the space, the Gram factors) drops out. The stages, each timed exclusive of the stages inside it:

- ``forward`` (the model and its loss), ``backward`` (autograd, with each gradient streamed into the flat buffer):
  the model's own work; next to them, a plain forward+backward of the same model on the same batch, the floor;
- ``weights``: the perturbed weights ``w + xi`` written into the flat buffer (``exp_point`` outside the pairs);
- ``pair geometry``: per head chunk, the base point's factors, the Riemannian gradient, the horizontal projection,
  the Exp2 correction and its pullback;
- ``direction``: the elementwise pass of the ascent direction with its inner products;
- ``substitution``: the swap of the perturbed weights into the model (the placement) and the buffers around a
  call;
- ``vectors``: the solver's combinations of its buffer rows;
- ``solver``: everything else of a step (bookkeeping, Python, the copy of a kept best-point gradient).

Each row also says whether the solver's memory rule kept the best point's gradient
(:func:`hf_geosharp.engine.solvers.memory.keeps_best_gradient`): where it does, a restart from an earlier best point
costs a copy instead of a forward and backward, and the model calls per step approach ``1 + 1 / steps``.

Times are the calling thread's CPU time (``time.thread_time``), which other processes' load barely changes: the
suite sets one torch thread, so all of torch's work runs on that thread. Wall time is recorded beside it.
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import torch

from hf_geosharp.engine.geometry import elementwise, gl_quotient
from hf_geosharp.engine.model_function import objective as objective_module
from hf_geosharp.engine.placement import single
from hf_geosharp.engine.solvers import memory as solver
from hf_geosharp.engine.solvers import pool as solver_pool
from hf_geosharp.engine.space import pair_group
from hf_geosharp.engine.space import perturbation_space as space

from .common import forward_backward, solve
from .config import RunConfig, Workload
from .models import SIZES, workload_inputs

STAGES = ("forward", "backward", "weights", "pair geometry", "direction", "substitution", "vectors", "solver")


class StageClock:
    """Exclusive CPU and wall seconds per stage: a stage's time excludes the stages entered inside it."""

    def __init__(self) -> None:
        self.cpu: dict[str, float] = defaultdict(float)
        self.wall: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.kept_best_gradient: list[bool] = []  # the memory rule's decision, per solve
        self._stack: list[list[float]] = []  # per open stage: [cpu of its children, wall of its children]

    @contextlib.contextmanager
    def stage(self, name: str, count: bool = True) -> Iterator[None]:
        """Time the block as stage ``name`` (``count``: as one more call of it)."""
        cpu0, wall0 = time.thread_time(), time.perf_counter()
        self._stack.append([0.0, 0.0])
        try:
            yield
        finally:
            child_cpu, child_wall = self._stack.pop()
            cpu, wall = time.thread_time() - cpu0, time.perf_counter() - wall0
            self.cpu[name] += cpu - child_cpu
            self.wall[name] += wall - child_wall
            self.calls[name] += count
            if self._stack:
                self._stack[-1][0] += cpu
                self._stack[-1][1] += wall

    def timed(self, name: str, fn: Callable, returned: str | None = None) -> Callable:
        """``fn`` timed as stage ``name``; with ``returned``, the function it returns is timed as that stage."""
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            with self.stage(name):
                result = fn(*args, **kwargs)
            return self.timed(returned, result) if returned is not None and callable(result) else result

        return wrapper

    def timed_block(self, name: str, fn: Callable[..., contextlib.AbstractContextManager]) -> Callable:
        """``fn``, which returns a context manager, with its entry and exit timed as one call of stage ``name``
        (the caller's block between them is the caller's)."""
        @functools.wraps(fn)
        @contextlib.contextmanager
        def wrapper(*args: Any, **kwargs: Any) -> Iterator[Any]:
            block = fn(*args, **kwargs)
            with self.stage(name):
                value = block.__enter__()
            try:
                yield value
            except BaseException as err:
                with self.stage(name, count=False):
                    if not block.__exit__(type(err), err, err.__traceback__):
                        raise
            else:
                with self.stage(name, count=False):
                    block.__exit__(None, None, None)

        return wrapper


# (owner, attribute, stage, stage of the function it returns): the engine's stages, patched for the duration of one
# profiled solve only; exp_point returns the pullback of the curvature terms
PATCHES = [
    (objective_module.Objective, "on_device", "substitution", None),  # (a call goes through it too)
    (single.SingleProcess, "stream_backward", "backward", None),
    (space.PerturbationSpace, "exp_point", "weights", "pair geometry"),
    (space.PerturbationSpace, "ascent_direction", "direction", None),
    (pair_group.PairGroup, "part", "pair geometry", None),
    (pair_group.PairGroup, "base", "pair geometry", None),
    (gl_quotient.GLQuotient, "euclidean_to_riemannian_gradient", "pair geometry", None),
    (gl_quotient.GLQuotient, "projection", "pair geometry", None),
    (gl_quotient.InvQuotient, "exp2_correction_with_pullback", "pair geometry", None),
    (gl_quotient.MixQuotient, "exp2_correction_with_pullback", "pair geometry", None),
    (elementwise.ElementwiseGeometry, "riemannian_gradient_pass", "direction", None),
    (solver_pool.Pool, "combine_into", "vectors", None),
]


@contextlib.contextmanager
def profiled(clock: StageClock) -> Iterator[None]:
    """The engine with every stage of :data:`PATCHES` timed, and each objective's loss function timed as forward."""
    originals = [(owner, attr, getattr(owner, attr)) for owner, attr, _, _ in PATCHES]
    init, rule = objective_module.Objective.__init__, solver.keeps_best_gradient

    def timed_init(self, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        self.loss_fn = clock.timed("forward", self.loss_fn)

    def recorded_rule(footprint: solver.Footprint) -> bool:
        clock.kept_best_gradient.append(rule(footprint))
        return clock.kept_best_gradient[-1]

    pending = objective_module.Objective.pending
    try:
        for owner, attr, name, returned in PATCHES:
            setattr(owner, attr, clock.timed(name, getattr(owner, attr), returned))
        objective_module.Objective.pending = clock.timed_block("substitution", pending)  # a model call too
        objective_module.Objective.__init__ = timed_init
        solver.keeps_best_gradient = recorded_rule
        yield
    finally:
        for owner, attr, fn in originals:
            setattr(owner, attr, fn)
        objective_module.Objective.__init__ = init
        objective_module.Objective.pending = pending
        solver.keeps_best_gradient = rule


def workloads(cfg: RunConfig) -> list[Workload]:
    return cfg.pick(
        [Workload("minilm", 16, 64, 20, n_batches=2), Workload("minilm", 8, 128, 20), Workload("base", 16, 128, 20)],
        [Workload("minilm", 16, 64, 10, n_batches=2)],
    )


def _profile(measure: str, model: torch.nn.Module, batches: list, smap: Any, steps: int, rho: float) -> StageClock:
    clock = StageClock()
    with profiled(clock), clock.stage("solver"):
        solve(measure, model, batches, smap, steps, rho)
    return clock


def run(cfg: RunConfig) -> dict[str, Any]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    rows = []
    try:
        for w in cfg.chosen(workloads(cfg)):
            model, batches, smap, source = workload_inputs(w, cfg.device)
            forward_backward(model, batches[0])  # warm-up
            fb_cpu = min(_thread_seconds(lambda: forward_backward(model, batches[0])) for _ in range(3))
            low = max(1, w.steps // 2)
            measures = {}
            for measure in ("adaptive_clean", "geodesic_inv", "geodesic_mix"):
                short = _profile(measure, model, batches, smap, low, cfg.rho)
                long = _profile(measure, model, batches, smap, w.steps, cfg.rho)
                per_step = {s: (long.cpu[s] - short.cpu[s]) / ((w.steps - low) * w.n_batches) for s in STAGES}
                calls = (long.calls["substitution"] - short.calls["substitution"]) / ((w.steps - low) * w.n_batches)
                step = sum(per_step.values())
                measures[measure] = {
                    "per_step_cpu_s": per_step,
                    "step_cpu_s": step,
                    "step_over_forward_backward": step / fb_cpu,
                    "model_calls_per_step": calls,
                    "best_gradient_kept": long.kept_best_gradient,
                    "total_cpu_s": {str(low): sum(short.cpu.values()), str(w.steps): sum(long.cpu.values())},
                    "total_wall_s": {str(low): sum(short.wall.values()), str(w.steps): sum(long.wall.values())},
                }
            rows.append({"model": SIZES[w.size].name, "n_params": sum(p.numel() for p in model.parameters()),
                         "workload": vars(w), "symmetry_map": source, "forward_backward_cpu_s": fb_cpu,
                         "measures": measures})
            del model, batches
    finally:
        torch.set_num_threads(threads)
    return {"suite": "step_profile", "stages": list(STAGES), "rows": rows}


def _kept(decisions: list[bool] | None) -> str:
    """The rule's decisions over a row's solves, in a word (results from before the rule have none)."""
    if not decisions:
        return "-"
    return "yes" if all(decisions) else "no" if not any(decisions) else f"{sum(decisions)} of {len(decisions)}"


def _thread_seconds(fn: Callable[[], Any]) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def table(result: dict[str, Any]) -> str:
    lines = ["| model | batch x seq x batches | measure | plain fwd+bwd ms | step ms | step / fwd+bwd | model calls "
             "per step | best gradient kept | " + " | ".join(result["stages"]) + " |",
             "|---|---|---|---|---|---|---|---|" + "---|" * len(result["stages"])]
    for r in result["rows"]:
        w = r["workload"]
        for name, m in r["measures"].items():
            stages = " | ".join(f"{1e3 * m['per_step_cpu_s'][s]:.0f}" for s in result["stages"])
            lines.append(f"| {r['model']} | {w['batch_size']}x{w['seq_len']}x{w['n_batches']} | {name} | "
                         f"{1e3 * r['forward_backward_cpu_s']:.0f} | {1e3 * m['step_cpu_s']:.0f} | "
                         f"{m['step_over_forward_backward']:.3f} | {m['model_calls_per_step']:.2f} | "
                         f"{_kept(m.get('best_gradient_kept'))} | {stages} |")
    lines.append("\nms of the calling thread's CPU per solver step and batch (one torch thread), from the difference "
                 "between two step counts; each stage exclusive of the stages inside it.")
    return "\n".join(lines)
