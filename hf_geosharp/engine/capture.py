"""The ``compile`` choice of a solve: eager, or the step captured by ``torch.compile``.

``"off"`` runs eagerly; ``"default"`` captures the step with inductor; ``"reduce-overhead"`` with inductor and CUDA
graphs (CUDA only); any other value names a ``torch.compile`` backend (``"aot_eager"`` replays the captured graphs
with the eager kernels: the capture checked on a CPU, with the eager path's numbers). What is captured is said in
:meth:`hf_geosharp.engine.space.perturbation_space.PerturbationSpace.captured` and :func:`.solvers.apgd.apgd`.
"""

from __future__ import annotations

import types
from collections.abc import Callable
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


def compiled(fn: Callable[..., Any], compile: str) -> Callable[..., Any]:
    """``fn`` (a function or a bound method) under ``torch.compile(fullgraph=True, dynamic=False)`` for the choice
    ``compile``, traced from its own copy of the code.

    Dynamo keeps its graphs, and counts recompilations against ``recompile_limit``, per code object, and a solve's
    objects (its space, its groups) are new at every call, so compiling the shared function would add graphs at every
    solve until, with ``fullgraph=True``, a later call fails. A copy per solve keeps each solve's graphs to its own
    paths and lets them go with it."""
    target = getattr(fn, "__func__", fn)
    copy = types.FunctionType(target.__code__.replace(), target.__globals__, target.__name__, target.__defaults__,
                              target.__closure__)
    copy.__kwdefaults__ = target.__kwdefaults__
    bound = copy if target is fn else types.MethodType(copy, fn.__self__)
    options: dict[str, Any] = {"backend": compile_backend(compile)}
    if compile == "reduce-overhead":
        options["mode"] = compile
    return torch.compile(bound, fullgraph=True, dynamic=False, **options)
