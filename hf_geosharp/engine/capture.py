"""The ``compile`` choice of a solve: eager, or the step captured by ``torch.compile``.

``"off"`` runs eagerly; ``"default"`` captures the step with inductor; ``"reduce-overhead"`` with inductor and CUDA
graphs (CUDA only); any other value names a ``torch.compile`` backend (``"aot_eager"`` replays the captured graphs
with the eager kernels: the capture checked on a CPU, with the eager path's numbers). What is captured is said in
:meth:`hf_geosharp.engine.space.perturbation_space.PerturbationSpace.captured` and :func:`.solvers.apgd.apgd`.
"""

from __future__ import annotations

import types
from collections.abc import Callable, Hashable
from typing import Any

import torch

#: The named choices (besides a backend's name).
COMPILE_CHOICES = ("off", "default", "reduce-overhead")


def compile_backend(compile: str) -> str | None:
    """The ``torch.compile`` backend of a ``compile`` choice (None for ``"off"``)."""
    return None if compile == "off" else "inductor" if compile in ("default", "reduce-overhead") else compile


def capture_choice(compile: str, device: torch.device | None = None) -> str:
    """``compile`` checked (before any work): ``"off"``, ``"default"``, ``"reduce-overhead"`` (CUDA only: refused
    where ``device`` is given and is not CUDA) or a registered ``torch.compile`` backend; returns it."""
    if not isinstance(compile, str) or not compile:
        raise ValueError(f"compile must be 'off', 'default', 'reduce-overhead' or a torch.compile backend name, got "
                         f"{compile!r}.")
    if compile == "reduce-overhead" and device is not None and device.type != "cuda":
        raise ValueError(f"compile='reduce-overhead' captures the step as CUDA graphs, which need a CUDA device; the "
                         f"vectors are on {device}. Use compile='default' (or 'off') there.")
    if compile not in COMPILE_CHOICES:
        known = torch._dynamo.list_backends(exclude_tags=())
        if compile not in known:
            raise ValueError(f"compile={compile!r} is no torch.compile backend; use 'off', 'default', "
                             f"'reduce-overhead' or one of {', '.join(known)}.")
    return compile


#: The compiled copies of the step's functions, one per (function, choice, key): made on first use, kept for the
#: process (dynamo keeps each one's graphs).
_COPIES: dict[tuple[Callable[..., Any], str, Hashable], Callable[..., Any]] = {}


def compiled(fn: Callable[..., Any], compile: str, key: Hashable | None = None) -> Callable[..., Any]:
    """The function ``fn`` under ``torch.compile(fullgraph=True, dynamic=False)`` for the choice ``compile``, traced
    from its own copy of the code: one per ``key``, or a new one at each call without a key.

    Dynamo keeps its graphs, and counts recompilations against ``recompile_limit``, per code object: a function
    compiled once for every model and measure of a process would add graphs until, with ``fullgraph=True``, a call
    fails. ``key`` names what changes the traced graph (the caller's shapes and kinds): calls with the same key share
    the copy and its graphs (a solve over the same model reuses them), calls with another key get their own. Without
    a key the caller owns the copy, and its graphs go with it: for a function whose graphs do not outlive one solve
    (the solver's scalar updates, traced under the solve's own ``TorchFunctionMode``, whose graphs dynamo drops with
    the solve's tensors but still counts)."""
    if key is not None and (fn, compile, key) in _COPIES:
        return _COPIES[fn, compile, key]
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__ = fn.__kwdefaults__
    options: dict[str, Any] = {"backend": compile_backend(compile)}
    if compile == "reduce-overhead":
        options["mode"] = compile
    graphs = torch.compile(copy, fullgraph=True, dynamic=False, **options)
    if key is not None:
        _COPIES[fn, compile, key] = graphs
    return graphs
