"""Symmetry coverage over every model type of the installed ``transformers``: mapped, verified, or why not.

For each model type of ``CONFIG_MAPPING_NAMES`` the sweep builds a tiny random instance from its default config
(:func:`experiments.tiny_models.tiny_model`: sizes shrunk generically, the config repaired where its validators
refuse), maps it with :func:`hf_geosharp.map_symmetries`
and runs the functional probe: after ``reparametrize(condition=100)`` every output must agree with the original to
``PROBE_TOL`` (relative). A negative control (the group element applied to ``G`` only, a deliberately wrong action)
must move the outputs by at least ``CONTROL_MIN``; otherwise the probe cannot see the attention and is reported as
inconclusive rather than passed.

Each type runs in a worker process with a per-type alarm, and the parent restarts a worker that crashes or hangs, so
one bad architecture costs at most its timeout. Everything is offline: a type that needs files from the Hub (a timm
backbone, a tokenizer) fails to build and says why.

Run from the repository root: ``nice -n 10 python -m experiments.coverage`` (about 12 minutes on two shared cores;
writes ``docs/results/coverage.json`` and
``docs/coverage.md``); ``--types bert,gpt2`` runs a sample.
"""

from __future__ import annotations

import argparse
import inspect
import json
import logging
import os
import platform
import select
import signal
import subprocess
import sys
import time
import warnings
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from .tiny_models import short_error, tiny_model

logger = logging.getLogger(__name__)

PROBE_TOL = 1e-6  # relative; float64 round-off is ~1e-13, float32 casts inside some eager attentions ~1e-7
CONTROL_MIN = 1e-3  # the wrong action must move the outputs at least this much for the probe to count
TYPE_TIMEOUT_S = 40
ROW, START = "@@ROW ", "@@START "
BATCH, SEQ = 2, 8
DOCS = Path(__file__).resolve().parents[1] / "docs"

def _vision(config: Any) -> Any:
    return getattr(config, "vision_config", None) or config


def _candidate_inputs(model: torch.nn.Module, gen: torch.Generator) -> list[dict[str, Any]]:
    """Input dicts to try, simplest first (main input only, then text + image together)."""
    config = model.config
    sig = inspect.signature(model.forward).parameters
    ids = torch.randint(4, 100, (BATCH, SEQ), generator=gen)
    extra = {k: v for k, v in (("use_cache", False), ("return_dict", True)) if k in sig}
    vision = _vision(config)
    size = getattr(vision, "image_size", 32)
    size = size[0] if isinstance(size, (list, tuple)) else size
    channels = getattr(vision, "num_channels", 3)
    pixels = torch.randn(BATCH, channels, size, size, generator=gen, dtype=torch.float64)
    main = getattr(model, "main_input_name", "input_ids")
    base: dict[str, Any] = {}
    if main == "input_ids" or "input_ids" in sig and main not in sig:
        base["input_ids"] = ids
    elif main == "pixel_values":
        base["pixel_values"] = pixels
    elif main == "input_values":
        base["input_values"] = torch.randn(BATCH, 4000, generator=gen, dtype=torch.float64)
    elif main == "input_features":
        bins = getattr(config, "num_mel_bins", None) or getattr(config, "feature_size", 80)
        frames = 2 * (getattr(config, "max_source_positions", None) or 32)
        base["input_features"] = torch.randn(BATCH, bins, frames, generator=gen, dtype=torch.float64)
    else:
        base[main] = ids
    if "decoder_input_ids" in sig and getattr(config, "is_encoder_decoder", False):
        base["decoder_input_ids"] = ids[:, :5]
    out = [{**base, **extra}]
    if "pixel_values" in sig and "pixel_values" not in base:
        out.append({**base, "input_ids": ids, "pixel_values": pixels, **extra})
    return out


def _tensors(obj: Any, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every floating tensor in a model output, except caches (keys and values move with the group)."""
    if isinstance(obj, torch.Tensor):
        return {prefix: obj} if obj.is_floating_point() else {}
    out: dict[str, torch.Tensor] = {}
    if isinstance(obj, dict):
        items = obj.items()
    elif isinstance(obj, (list, tuple)):
        items = ((str(i), v) for i, v in enumerate(obj))
    else:
        return out
    for key, value in items:
        if "past_key" in str(key) or "cache" in str(key):
            continue
        out.update(_tensors(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def _forward(model: torch.nn.Module, inputs: dict[str, Any]) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)  # models that draw noise in forward (ViT-MAE masking) draw the same noise each time
    with torch.no_grad():
        return {k: v.detach().clone() for k, v in _tensors(model(**inputs)).items()}


def relative_deviation(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    """``max`` over output tensors of ``||b - a|| / ||a||`` (a zero tensor counts by its absolute change)."""
    worst = 0.0
    for key, ref in a.items():
        diff = float((b[key] - ref).norm())
        scale = float(ref.norm())
        worst = max(worst, diff / scale if scale > 0 else diff)
    return worst


def _wrong_action(model: torch.nn.Module, smap: Any, seed: int) -> None:
    """The negative control: ``G <- G A^{-1}`` with ``H`` left alone, which no symmetry allows."""
    from hf_geosharp.engine.geometry.lie import random_group_element
    from hf_geosharp.symmetry.flat import flat_vector, parameters_in_order

    params = parameters_in_order(model, smap)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        flat = flat_vector(params)
        for block in smap.blocks:
            a = random_group_element(block.n_pairs, block.head_dim, lie_basis=block.lie_basis, condition=100.0,
                                     generator=gen)
            flat[block.G_index] = torch.linalg.solve(a, flat[block.G_index], left=False)
        for p, offset in zip(params, smap.offsets):
            p.copy_(flat[offset:offset + p.numel()].view_as(p))


def probe(model: torch.nn.Module, smap: Any) -> dict[str, Any]:
    """Reparametrise at condition 100 and compare all outputs; the wrong action is the control."""
    import hf_geosharp as gs

    gen = torch.Generator().manual_seed(0)
    errors = []
    for inputs in _candidate_inputs(model, gen):
        try:
            out0 = _forward(model, inputs)
            break
        except Exception as exc:  # noqa: BLE001 - any architecture-specific forward error is a finding
            errors.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    else:
        return {"status": "not_run", "reason": "forward with generic inputs failed: " + " | ".join(errors)}
    if not out0:
        return {"status": "not_run", "reason": "the model returned no floating tensor"}
    if not all(bool(torch.isfinite(t).all()) for t in out0.values()):
        return {"status": "not_run", "reason": "outputs are not finite at the random init"}
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    noise = relative_deviation(out0, _forward(model, inputs))
    try:
        gs.reparametrize(model, seed=1, condition=100.0, symmetry_map=smap)
        deviation = relative_deviation(out0, _forward(model, inputs))
        _restore(model, saved)
        _wrong_action(model, smap, seed=1)
        control = relative_deviation(out0, _forward(model, inputs))
    finally:
        _restore(model, saved)
    if noise > PROBE_TOL:
        status = "nondeterministic"
    elif deviation > PROBE_TOL or deviation != deviation:
        status = "failed"
    elif control < CONTROL_MIN:
        status = "inconclusive"
    else:
        status = "passed"
    return {"status": status, "max_rel_deviation": deviation, "control_rel_deviation": control,
            "rerun_rel_deviation": noise, "inputs": sorted(k for k in inputs if k not in ("use_cache", "return_dict"))}


def _restore(model: torch.nn.Module, saved: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(saved[n])




def examine(model_type: str) -> dict[str, Any]:
    """One row of the coverage table for ``model_type``."""
    from hf_geosharp.pipeline import symmetry_map

    row: dict[str, Any] = {"model_type": model_type}
    start = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            model = tiny_model(model_type)
    except Exception as exc:  # noqa: BLE001 - why a type cannot be built is the finding
        row.update(status="not_built", reason=short_error(exc), seconds=round(time.perf_counter() - start, 2))
        return row
    row["model_class"] = type(model).__name__
    row["n_params"] = sum(p.numel() for p in model.parameters())
    try:
        smap = symmetry_map(model)
    except Exception as exc:  # noqa: BLE001 - a crash of the mapper is a bug to report, not to hide
        row.update(status="map_error", reason=short_error(exc), seconds=round(time.perf_counter() - start, 2))
        return row
    modules = sorted({b.module for b in smap.blocks if b.kind in ("qk", "vo")})
    fallbacks = [{"module": f.module, "reason": f.reason[:160]} for f in smap.fallbacks]
    row.update(
        n_attention_modules=len(set(modules) | {f["module"] for f in fallbacks}),
        n_mapped_modules=len(modules),
        n_pairs_qk=sum(b.n_pairs for b in smap.blocks if b.kind == "qk"),
        n_pairs_vo=sum(b.n_pairs for b in smap.blocks if b.kind == "vo"),
        n_reduced_blocks=sum(b.lie_basis is not None for b in smap.blocks),
        layouts=sorted({b.note.split(";")[0] for b in smap.blocks}),
        n_fallbacks=len(fallbacks),
        fallbacks=fallbacks[:1],
        fallback_reasons=sorted({f["reason"].split(":")[0] for f in fallbacks}),
        notes=[n[:160] for n in smap.notes][:1],
    )
    if not smap.blocks:
        row["status"] = "fallback" if fallbacks else "no_attention"
    else:
        row["status"] = "partial" if fallbacks else "mapped"
        try:
            row["probe"] = probe(model, smap)
        except Exception as exc:  # noqa: BLE001
            row["probe"] = {"status": "not_run", "reason": "probe raised " + short_error(exc)}
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


class _Timeout(Exception):
    pass


def _alarm(signum: int, frame: Any) -> None:
    raise _Timeout


def worker(types: list[str], timeout: int) -> None:
    """Examine ``types`` in order, one JSON line each on stdout; a per-type alarm bounds the time."""
    logging.disable(logging.WARNING)
    torch.set_num_threads(1)
    signal.signal(signal.SIGALRM, _alarm)
    for model_type in types:
        print(START + model_type, flush=True)
        signal.alarm(timeout)
        try:
            row = examine(model_type)
        except _Timeout:
            row = {"model_type": model_type, "status": "timeout", "reason": f"over {timeout} s"}
        except Exception as exc:  # noqa: BLE001 - e.g. the alarm landing inside an except clause
            row = {"model_type": model_type, "status": "crashed", "reason": short_error(exc)}
        finally:
            signal.alarm(0)
        print(ROW + json.dumps(row, default=str), flush=True)


def sweep(types: list[str], timeout: int = TYPE_TIMEOUT_S) -> list[dict[str, Any]]:
    """Run :func:`worker` in a subprocess, restarting it after a crash or a hang, and collect the rows."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PYTHONWARNINGS": "ignore"}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    rows: dict[str, dict[str, Any]] = {}
    todo = list(types)
    while todo:
        cmd = [sys.executable, "-m", "experiments.coverage", "--worker", "--timeout", str(timeout),
               "--types", ",".join(todo)]
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
        current, last = None, time.monotonic()
        assert proc.stdout is not None
        while True:
            ready, _, _ = select.select([proc.stdout], [], [], 5.0)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    break
                if line.startswith(START):
                    current, last = line[len(START):].strip(), time.monotonic()
                elif line.startswith(ROW):
                    row = json.loads(line[len(ROW):])
                    rows[row["model_type"]] = row
                    logger.info("%4d/%d %-40s %s", len(rows), len(types), row["model_type"],
                                row.get("probe", {}).get("status", row["status"]))
                    current = None
            elif current is not None and time.monotonic() - last > timeout + 30:
                proc.kill()  # stuck where the alarm cannot reach (inside C code)
                break
        proc.wait()
        if current is not None and current not in rows:
            rows[current] = {"model_type": current, "status": "timeout" if proc.returncode < 0 else "crashed",
                             "reason": f"worker exit code {proc.returncode} while examining it"}
        todo = [t for t in types if t not in rows]
    return [rows[t] for t in types]


def headline(rows: list[dict[str, Any]]) -> dict[str, int]:
    """The counts the docs quote."""
    probe = Counter(r.get("probe", {}).get("status") for r in rows if r["status"] in ("mapped", "partial"))
    status = Counter(r["status"] for r in rows)
    verified = sum(1 for r in rows if r["status"] == "mapped" and r.get("probe", {}).get("status") == "passed")
    return {
        "tried": len(rows),
        "built": len(rows) - status["not_built"] - status["timeout"] - status["crashed"],
        "fully_mapped": status["mapped"],
        "fully_mapped_probe_verified": verified,
        "partially_mapped": status["partial"],
        "fallback_only": status["fallback"],
        "no_attention_found": status["no_attention"],
        "not_built": status["not_built"],
        "timeout_or_crash": status["timeout"] + status["crashed"],
        "map_error": status["map_error"],
        "probe_passed": probe["passed"],
        "probe_failed": probe["failed"],
        "probe_inconclusive": probe["inconclusive"],
        "probe_not_run": probe["not_run"],
        "probe_nondeterministic": probe["nondeterministic"],
    }


def _cell(text: str, width: int = 90) -> str:
    text = text.replace("|", "/").replace("\n", " ")
    text = text if len(text) <= width else text[: width - 3] + "..."
    return text.replace("][", "]\\[")  # `x["a"]["b"]` in an error is text, not a Markdown reference link


def markdown(payload: dict[str, Any]) -> str:
    """``docs/coverage.md``: headline numbers, then one row per model type."""
    head, rows = payload["headline"], payload["rows"]
    lines = [
        "# Symmetry coverage over the installed transformers",
        "",
        f"Generated by `python -m experiments.coverage` (transformers {payload['transformers']}, torch "
        f"{payload['torch']}, {payload['seconds']:.0f} s). Every model type of `CONFIG_MAPPING_NAMES` was built as a "
        "tiny random float64 model from its default config (hidden 32, 4 heads of 8, 2 KV heads where the config has "
        "them, 2 layers, vocabulary 128, eager attention; per-layer lists cut to the layers kept; a field that a "
        "config validator or the constructor refuses is repaired as its message asks, and `OVERRIDES` holds the few "
        "fields with no generic default), mapped with `map_symmetries`, and probed: after "
        f"`reparametrize(condition=100)` every output tensor must agree to {PROBE_TOL:g} relative, and a deliberately "
        f"wrong action (`G A^-1` with `H` unchanged) must move them by at least {CONTROL_MIN:g}, otherwise the probe "
        "is inconclusive. Raw rows: `docs/results/coverage.json`.",
        "",
        "| | model types |",
        "|---|---|",
    ]
    labels = {
        "tried": "tried", "built": "built offline from the default config",
        "fully_mapped": "every attention module mapped",
        "fully_mapped_probe_verified": "... and probe-verified (invariant, control visible)",
        "partially_mapped": "partially mapped (some modules fall back)",
        "fallback_only": "attention found, none mapped",
        "no_attention_found": "no attention module found (convnets, SSMs, ...)",
        "not_built": "not built (needs files, special config or inputs)", "timeout_or_crash": "timeout or crash",
        "map_error": "map_symmetries raised", "probe_passed": "probe passed (mapped + partial)",
        "probe_failed": "**probe failed (wrong map)**", "probe_inconclusive": "probe inconclusive (control invisible)",
        "probe_not_run": "probe not run (generic inputs rejected)",
        "probe_nondeterministic": "outputs nondeterministic",
    }
    lines += [f"| {labels[k]} | {v} |" for k, v in head.items()]
    lines += ["", "Statuses: `mapped` (all attention mapped), `partial`, `fallback` (attention found, nothing mapped), "
              "`no_attention`, `not_built`. Probe: deviation after the symmetry / after the wrong control.", "",
              "| model type | status | layouts | QK / VO pairs (reduced blocks) | probe | dev / control | reason |",
              "|---|---|---|---|---|---|---|"]
    for r in rows:
        p = r.get("probe", {})
        pairs = f"{r['n_pairs_qk']} / {r['n_pairs_vo']} ({r['n_reduced_blocks']})" if "n_pairs_qk" in r else ""
        dev = (f"{p['max_rel_deviation']:.1e} / {p['control_rel_deviation']:.1e}"
               if "max_rel_deviation" in p else "")
        fallback = r["fallbacks"][0]["reason"] if r.get("fallbacks") else ""
        reason = r.get("reason") or p.get("reason") or fallback
        lines.append(f"| {r['model_type']} | {r['status']} | {_cell(', '.join(r.get('layouts', [])), 60)} | {pairs} "
                     f"| {p.get('status', '')} | {dev} | {_cell(reason or '', 120)} |")
    return "\n".join(lines) + "\n"


def all_types() -> list[str]:
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

    return list(CONFIG_MAPPING_NAMES)


def main(argv: list[str] | None = None) -> int:
    from hf_geosharp.commands.common import Parser, file_path, positive
    from hf_geosharp.durable import OutputPathError, check_writable, write_json, write_text

    parser = Parser(prog="python -m experiments.coverage", description=__doc__.splitlines()[0])
    parser.add_argument("--types", help="comma-separated model types (default: all of the installed transformers)")
    parser.add_argument("--timeout", type=positive(int), default=TYPE_TIMEOUT_S, help="seconds per model type")
    parser.add_argument("--json", type=file_path, default=DOCS / "results" / "coverage.json")
    parser.add_argument("--markdown", type=file_path, default=DOCS / "coverage.md")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    types = [t.strip() for t in args.types.split(",") if t.strip()] if args.types else all_types()
    if unknown := [t for t in types if t not in all_types()]:
        parser.error(f"--types: unknown model type(s) {', '.join(unknown)} (not in the installed transformers)")
    if not types:
        parser.error("--types: name at least one model type")
    if args.worker:
        worker(types, args.timeout)
        return 0
    try:
        check_writable(args.json)
        check_writable(args.markdown)
    except OutputPathError as err:
        parser.error(str(err))
    logger.addHandler(logging.StreamHandler())
    logger.setLevel(logging.INFO)
    import transformers

    start = time.perf_counter()
    rows = sweep(types, args.timeout)
    payload = {"transformers": transformers.__version__, "torch": torch.__version__,
               "python": platform.python_version(),
               "probe_tol": PROBE_TOL, "control_min": CONTROL_MIN, "timeout_s": args.timeout,
               "seconds": round(time.perf_counter() - start, 1), "headline": headline(rows), "rows": rows}
    write_json(args.json, payload, indent=None)
    write_text(args.markdown, markdown(payload))
    print(json.dumps(payload["headline"], indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
