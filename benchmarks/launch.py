"""Launch suite: ATen operators, kernels and host syncs per solver step, counted, not timed.

On a GPU the engine's step is bound by the host when it issues many small operations, and stalled whenever the host
waits for the device. Both are counted here, deterministically, on any device, by dispatching every ATen call of a
solve through a :class:`~torch.utils._python_dispatch.TorchDispatchMode`:

- **ops**: every ATen operator call that reaches the dispatcher's Python mode (composite operators appear as the
  operators they decompose into);
- **kernels**: the ops that compute on tensor data: every op except (1) views and other ops whose every output
  aliases an input without writing it (the schema's alias annotations: ``view``, ``slice``, ``as_strided``,
  ``detach``, ``t``, ``expand``, ``lift_fresh`` ...), (2) ops that only allocate or set metadata (``empty*``,
  ``new_empty*``, ``set_``, ``resize_``, ``_reshape_alias``) and (3) syncs (below). In-place ops (``Tensor(a!)``)
  are kernels. A ``torch._foreach_*`` op counts as one kernel (CUDA fuses a list of up to a few hundred tensors into
  one launch per chunk of them);
- **syncs**: the host waiting for the device: ``_local_scalar_dense`` (``.item()``, ``float(t)``, ``bool(t)``),
  ``Tensor.tolist``, ``.cpu()`` and ``.numpy()`` (which never reach the dispatcher on a CPU tensor, so a
  ``TorchFunctionMode`` counts them, one per call), ops whose output size depends on the data (``nonzero``,
  ``masked_select``, ``unique*``, boolean ``index``, ``repeat_interleave`` without ``output_size``), ``equal``,
  and tensors built from host data (``lift_fresh``: ``torch.tensor([...])`` of Python numbers, on CUDA a blocking
  upload from pageable memory), listed by kind.

Each op is attributed to one of three places: **outside** the model (the solver step: the space's geometry, the
solver's vectors, the placement's substitution), **inside** the model's forward (the loss function's call) or
backward (``torch.autograd.backward`` with the gradients streamed into the engine's buffer). The engine adds ops
inside the model's calls too (the embedding lookups answered from the used rows, the streaming hooks), so the
inside counts are set against a plain forward+backward of the same model and batch (``model(**batch).loss``,
``.backward()``) counted the same way.

Per step = (count of a 6-step solve - count of a 2-step solve) / 4: the one-off work (building the space, the clean
point) drops out. Random-init BERT classifiers (:mod:`benchmarks.models`) of three shapes (layers x hidden, heads:
6 x 384 x 12, 12 x 768 x 12, 24 x 1024 x 16), 2 x 16 tokens, one batch, rho 0.1. The stored file's ``reference``
block (counts of released versions, by version) is carried over when the suite rewrites it.
The counts do not depend on the device's speed; on CPU they are what the same solve issues on CUDA (the suite runs
the step as a GPU runs it, its masked copies and blocked products on the device:
:func:`~hf_geosharp.engine.device_paths.gpu_paths`), except that a CUDA library call may launch more than
one kernel.
"""

from __future__ import annotations

import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hf_geosharp.engine.device_paths import gpu_paths
from hf_geosharp.engine.model_function import objective as objective_module
from hf_geosharp.engine.placement import single

from .common import solve
from .config import RunConfig
from .models import ModelSize, bert_batches, bert_classifier, symmetry_map

aten = torch.ops.aten

#: The shapes counted: layers x hidden, heads (MiniLM, BERT-base, BERT-large).
SHAPES = [ModelSize("6x384x12", 6, 384, 12), ModelSize("12x768x12", 12, 768, 12), ModelSize("24x1024x16", 24, 1024, 16)]
MEASURES = ("adaptive_clean", "geodesic_inv", "geodesic_mix")
#: The measures whose workspace the GPU rule changes (clean adaptive has no pair geometry).
GEODESIC = ("geodesic_inv", "geodesic_mix")
BATCH, SEQ = 2, 16
SHORT, LONG = 2, 6

#: Ops that only allocate or set metadata: no kernel.
_NO_KERNEL = {"empty", "empty_like", "empty_strided", "new_empty", "new_empty_strided", "set_", "resize_",
              "_reshape_alias", "lift_fresh", "lift_fresh_copy_", "alias", "_unsafe_view", "sym_size",
              "sym_stride", "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}
#: Ops whose output size depends on the data: the host waits for the device to learn it.
_DATA_DEPENDENT = {"nonzero", "masked_select", "unique", "_unique", "_unique2", "unique_consecutive",
                   "unique_dim", "equal", "nonzero_numpy", "argwhere"}


def _aliasing(op: Any) -> bool:
    """Whether every output of ``op`` aliases an input without writing it (a view)."""
    returns = op._schema.returns
    return bool(returns) and all(r.alias_info is not None and not r.alias_info.is_write for r in returns)


def classify(op: Any, args: tuple, kwargs: dict) -> str:
    """``"sync"``, ``"upload"``, ``"kernel"`` or ``"view"`` (see the module docstring)."""
    name = op._schema.name.split("::")[-1]
    if name == "_local_scalar_dense":
        return "sync"
    if name in _DATA_DEPENDENT:
        return "sync"
    if name == "repeat_interleave" and kwargs.get("output_size") is None and len(args) == 1:
        return "sync"
    if name == "index" and any(isinstance(i, torch.Tensor) and i.dtype == torch.bool
                               for i in (args[1] if len(args) > 1 else [])):
        return "sync"
    if name in ("lift_fresh", "lift_fresh_copy"):
        return "upload"
    if name in _NO_KERNEL or _aliasing(op):
        return "view"
    return "kernel"


class OpCounter(TorchDispatchMode):
    """Counts ops by place (``outside``, ``forward``, ``backward``), kind, and (outside) engine file."""

    def __init__(self) -> None:
        super().__init__()
        self.place = "outside"
        self.ops: Counter = Counter()  # (place, kind) -> count
        self.syncs: Counter = Counter()  # (place, op name) -> count
        self.files: Counter = Counter()  # engine file of outside kernels -> count
        self.model_calls = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        kind = classify(func, args, kwargs)
        self.ops[self.place, kind] += 1
        if kind in ("sync", "upload"):
            self.syncs[self.place, func._schema.name.split("::")[-1]] += 1
        if kind == "kernel" and self.place == "outside":
            self.files[_engine_file()] += 1
        return func(*args, **kwargs)

    def __enter__(self) -> OpCounter:
        super().__enter__()
        self._reads = _HostReads(self)
        self._reads.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._reads.__exit__(*exc)
        super().__exit__(*exc)

    @contextlib.contextmanager
    def at(self, place: str) -> Iterator[None]:
        previous, self.place = self.place, place
        try:
            yield
        finally:
            self.place = previous


class _HostReads(TorchFunctionMode):
    """Counts the reads of tensor data into the host that no ATen op shows on a CPU tensor."""

    READS = {"tolist", "cpu", "numpy"}

    def __init__(self, counter: OpCounter) -> None:
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        name = getattr(func, "__name__", "")
        if name in self.READS:
            self.counter.ops[self.counter.place, "sync"] += 1
            self.counter.syncs[self.counter.place, name] += 1
        return func(*args, **(kwargs or {}))


def _engine_file() -> str:
    """The innermost hf_geosharp file on the Python stack (where an outside op comes from)."""
    frame = sys._getframe(2)
    while frame is not None:
        name = frame.f_code.co_filename
        if "hf_geosharp" in name:
            return name.split("hf_geosharp/", 1)[-1]
        frame = frame.f_back
    return "other"


@contextlib.contextmanager
def placed(counter: OpCounter) -> Iterator[None]:
    """The engine with each objective's loss function counted as ``forward`` and the placement's backward as
    ``backward``."""
    init, stream = objective_module.Objective.__init__, single.SingleProcess.stream_backward

    def counted_init(self: Any, *args: Any, **kwargs: Any) -> None:
        init(self, *args, **kwargs)
        loss_fn = self.loss_fn

        def forward(*a: Any, **k: Any) -> Any:
            counter.model_calls += 1
            with counter.at("forward"):
                return loss_fn(*a, **k)

        self.loss_fn = forward

    def counted_stream(self: Any, *args: Any, **kwargs: Any) -> None:
        with counter.at("backward"):
            return stream(self, *args, **kwargs)

    objective_module.Objective.__init__ = counted_init
    single.SingleProcess.stream_backward = counted_stream
    try:
        yield
    finally:
        objective_module.Objective.__init__ = init
        single.SingleProcess.stream_backward = stream


def _count(measure: str, model: torch.nn.Module, batches: list, smap: Any, steps: int, rho: float) -> OpCounter:
    counter = OpCounter()
    with placed(counter), gpu_paths(), counter:  # a GPU's step, also on a CPU
        solve(measure, model, batches, smap, steps, rho)
    return counter


def _plain(model: torch.nn.Module, batch: dict) -> dict[str, int]:
    counter = OpCounter()
    with counter:
        loss = model(**batch).loss
        loss.backward()
    model.zero_grad(set_to_none=True)
    return _summary(counter.ops, "outside", 1)


def _summary(ops: Counter, place: str, per: float) -> dict[str, float]:
    kinds = ("kernel", "view", "sync", "upload")
    counts = {k: ops[place, k] / per for k in kinds}
    return {"ops": sum(counts.values()), "kernels": counts["kernel"], "syncs": counts["sync"] + counts["upload"],
            "uploads": counts["upload"]}


def _difference(long: Counter, short: Counter, steps: int) -> Counter:
    return Counter({k: (long[k] - short[k]) / steps for k in set(long) | set(short)})


#: The free memory the suite simulates for the GPU rule's row (an H100's 80 GB): on CUDA the workspace may grow into
#: a share of it (:func:`hf_geosharp.engine.solvers.memory.workspace_room`); on the CPU the bytes goal alone sizes it.
SIMULATED_FREE = 80 * 10**9


@contextlib.contextmanager
def free_memory(free: int | None) -> Iterator[None]:
    """Inside, the single-process placement sizes its workspace as on a device with ``free`` bytes free (None: as
    the device itself says). Only the workspace's size depends on it, so the counts are those of a GPU with that
    much room."""
    if free is None:
        yield
        return
    probe = single.device_free_bytes
    single.device_free_bytes = lambda device: free
    try:
        yield
    finally:
        single.device_free_bytes = probe


def count_shape(size: ModelSize, measures: tuple[str, ...] = MEASURES, device: str = "cpu",
                rho: float = 0.1, free: int | None = None) -> dict[str, Any]:
    """The counts of one shape: the plain forward+backward and, per measure, per step outside and inside (with
    ``free``, the workspace sized as on a device with that much free memory, :func:`free_memory`)."""
    model = bert_classifier(size, device=device)
    batches = bert_batches(model, n_batches=1, batch_size=BATCH, seq_len=SEQ)
    smap, _ = symmetry_map(model)
    plain = _plain(model, batches[0])
    row: dict[str, Any] = {"shape": size.name, "n_params": sum(p.numel() for p in model.parameters()),
                           "plain_forward_backward": plain, "measures": {}}
    if free is not None:
        row["simulated_free_bytes"] = free
    for measure in measures:
        with free_memory(free):
            short = _count(measure, model, batches, smap, SHORT, rho)
            long = _count(measure, model, batches, smap, LONG, rho)
        ops = _difference(long.ops, short.ops, LONG - SHORT)
        calls = (long.model_calls - short.model_calls) / (LONG - SHORT)
        inside = Counter()
        for (place, kind), n in ops.items():
            if place != "outside":
                inside["inside", kind] += n
        files = _difference(long.files, short.files, LONG - SHORT)
        syncs = _difference(long.syncs, short.syncs, LONG - SHORT)
        row["measures"][measure] = {
            "outside": _summary(ops, "outside", 1),
            "inside": _summary(inside, "inside", 1),
            "model_calls_per_step": calls,
            "syncs_by_op": {f"{p}:{name}": n for (p, name), n in sorted(syncs.items()) if n},
            "outside_kernels_by_file": {f: n for f, n in sorted(files.items(), key=lambda kv: -kv[1]) if n},
        }
    del model
    return row


def stored_reference(device: str) -> dict[str, Any]:
    """The ``reference`` block of the stored results for ``device``: counts of released versions, by version, kept
    when the suite rewrites the file (empty if there is none)."""
    path = Path(__file__).parent / "results" / f"launch-{device.split(':')[0]}.json"
    if not path.exists():
        return {}
    return json.loads(path.read_text()).get("reference", {})


def run(cfg: RunConfig) -> dict[str, Any]:
    shapes = cfg.pick(SHAPES, SHAPES[:2])
    result = {"suite": "launch", "batch": [BATCH, SEQ], "steps": [SHORT, LONG],
              "rows": [count_shape(s, device=cfg.device, rho=cfg.rho) for s in shapes]}
    if cfg.device == "cpu" and len(shapes) == len(SHAPES):  # the deeper shapes' workspace as on a GPU with room
        result["rows"] += [count_shape(s, GEODESIC, device=cfg.device, rho=cfg.rho, free=SIMULATED_FREE)
                           for s in shapes[1:]]
        result["depth"] = depth(shapes, cfg.device)
    reference = stored_reference(cfg.device)
    if reference:
        result["reference"] = reference
    return result


#: The radius of the depth comparison, smaller than the suite's: fewer of the shapes' 6-step solves restart from their
#: best point there (a restart costs a pair-geometry pass). Which path each solve took is recorded beside its count
#: (its model calls a step), so that counts are compared on the same path.
DEPTH_RHO = 0.01


def depth(shapes: list[ModelSize], device: str) -> dict[str, Any]:
    """Geodesic inv's kernels a step outside the model at :data:`DEPTH_RHO` for every shape, each with its workspace
    as on a GPU with room (one head chunk per pair group: the rule whose count should not grow with depth), with the
    model calls a step that say which path each solve took."""
    rows = []
    for size in shapes:
        free = SIMULATED_FREE
        m = count_shape(size, ("geodesic_inv",), device=device, rho=DEPTH_RHO, free=free)["measures"]["geodesic_inv"]
        rows.append({"shape": size.name, "kernels": m["outside"]["kernels"],
                     "model_calls_per_step": m["model_calls_per_step"], "simulated_free_bytes": free})
    return {"rho": DEPTH_RHO, "measure": "geodesic_inv", "rows": rows}


#: Engine files of the pair geometry (for the table's split of the outside kernels).
PAIR_FILES = ("engine/geometry/gl_quotient.py", "engine/geometry/lie.py", "engine/space/coordinates.py",
              "engine/space/pair_group.py", "engine/space/workspace.py")


def table(result: dict[str, Any]) -> str:
    lines = ["| shape | plain fwd+bwd ops (kernels) | measure | outside ops | outside kernels | of which elementwise | "
             "of which pairs | outside syncs | inside ops (kernels) | inside syncs | model calls |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        p = r["plain_forward_backward"]
        shape = r["shape"] + (f", GPU rule ({r['simulated_free_bytes'] / 1e9:.0f} GB free)"
                              if "simulated_free_bytes" in r else "")
        for name, m in r["measures"].items():
            o, i, files = m["outside"], m["inside"], m["outside_kernels_by_file"]
            elementwise = files.get("engine/geometry/elementwise.py", 0.0)
            pairs = sum(files.get(f, 0.0) for f in PAIR_FILES)
            lines.append(f"| {shape} | {p['ops']:.0f} ({p['kernels']:.0f}) | {name} | {o['ops']:.0f} | "
                         f"{o['kernels']:.0f} | {elementwise:g} | {pairs:g} | {o['syncs']:g} | "
                         f"{i['ops']:.0f} ({i['kernels']:.0f}) | {i['syncs']:g} | {m['model_calls_per_step']:g} |")
    lines.append("\nper solver step (6 steps - 2 steps, / 4), 2 x 16 tokens; outside = the solver step outside the "
                 "model's forward and backward (elementwise: engine/geometry/elementwise.py; pairs: the pair "
                 "geometry's files); inside = within them (model and engine together; compare the plain "
                 "forward+backward); syncs include uploads of host data. GPU rule: the workspace sized as on a device "
                 "with that much free memory (simulated on the CPU; only the workspace's size depends on it).")
    return "\n".join(lines)
