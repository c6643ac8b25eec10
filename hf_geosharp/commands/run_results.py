"""What ``geosharp run`` prints and writes: the header, the results table and the results file."""

from __future__ import annotations

import dataclasses
import datetime
import math
import os
import platform
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .._version import __version__
from ..data import DataSpec
from ..durable import OutputPathError, write_json
from ..engine.result import certified, shown
from ..leaderboard.store import model_identity, weights_digests
from ..measures import Settings, result_fields

VERSIONED = ("torch", "transformers", "datasets", "accelerate", "huggingface_hub", "evaluate")


@dataclass
class RunContext:
    """One ``geosharp run``: its arguments, what it measures and on what, and where.

    Attributes:
        args: the parsed command line.
        model: the model measured.
        spec: the data it is measured on.
        batches: the batches (every process's).
        n_examples: examples in them.
        keys: the measure keys, in order.
        settings: the measures' settings.
        world_size: processes of the launch.
        device: where the model runs.
        started: when the run started (UTC).
        fsdp: whether the model is FSDP2-sharded.
        model_class: the model's class name.
        symmetry: the symmetry map's summary, once mapped.
    """

    args: Any
    model: Any
    spec: DataSpec
    batches: list
    n_examples: int
    keys: list[str]
    settings: Settings
    world_size: int
    device: Any
    started: datetime.datetime
    fsdp: bool
    model_class: str
    symmetry: dict[str, Any] = field(default_factory=dict)


def count(n: int, word: str) -> str:
    """``1 batch``, ``3 batches``, ``22,713,986 parameters``."""
    plural = word + ("es" if word.endswith(("s", "sh", "ch", "x")) else "s")
    return f"{n:,} {word if n == 1 else plural}"


def _table(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(r, widths))) for r in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def print_header(c: RunContext) -> None:
    """What is measured, on what, with which settings: four lines before the work."""
    args, spec_, symmetry, model = c.args, c.spec, c.symmetry, c.model
    n_params = sum(p.numel() for p in model.parameters())
    where = f"{spec_.dataset}" + (f":{spec_.config}" if spec_.config else "") + f" [{spec_.split}]"
    dtype = next(model.parameters()).dtype
    head = f", new {args.num_labels}-class head seeded {args.seed}" if args.head else ""
    print(f"model    {args.model} ({c.model_class}{head}, {count(n_params, 'parameter')}, {dtype}, "
          f"{c.device})")  # fmt: skip
    print(f"data     {where}: {count(c.n_examples, 'example')} in {count(len(c.batches), 'batch')} of up to "
          f"{spec_.batch_size:,}")  # fmt: skip
    print(
        f"symmetry {count(symmetry['n_pairs_qk'], 'QK head pair')} and {symmetry['n_pairs_vo']:,} VO, head dims "
        f"{symmetry['head_dims']}; {count(len(symmetry['fallbacks']), 'unmapped attention module')}"
    )
    s = c.settings
    solver = f"steps={s.steps}" if s.mode == "worst" else f"n_samples={s.n_samples}"
    print(f"settings rho={s.rho} mode={s.mode} {solver} seed={s.seed} processes={c.world_size}"
          f"{' (FSDP2-sharded)' if c.fsdp else ''}")


def results_table(timed: list[tuple[str, Any, float]]) -> str:
    """One row per finished measure; an uncertified worst case shows as a lower bound (the one display rule)."""
    rows = [["measure", "sharpness", "stderr", "clean loss", "batches", "converged", "solver", "seconds"]]
    for key, res, seconds in timed:
        stderr, converged = getattr(res, "stderr", math.nan), getattr(res, "converged", None)
        rows.append([
            key, shown(res.value, certified(res), digits=6), "-" if not math.isfinite(stderr) else f"{stderr:.2g}",
            f"{res.clean_loss:.6g}",
            f"{len(res.per_batch):,}", {True: "yes", False: "no", None: "-"}[converged], res.measure, f"{seconds:.1f}",
        ])  # fmt: skip
    return _table(rows)


def breakdown_table(key: str, res: Any, top: int = 5) -> str:
    """Where a worst case's perturbation sits: per layer (and group of parameters outside the layers) its share of
    ``||xi||_g^2`` and of the first-order term ``<grad, xi>_g``, then the ``top`` heads by norm share."""
    b = getattr(res, "breakdown", None)
    if b is None:
        return f"{key}: no breakdown (only a worst case in one process has one)"
    rows = [["layer", "norm share", "first-order share"]]
    rows += [[name, f"{norm:.1%}", f"{first:.1%}"] for name, norm, first in b.layer_table()]
    lines = [f"{key} ({res.measure}): shares of ||xi||^2 in its metric and of <grad, xi>, mean over "
             f"{count(len(res.per_batch), 'batch')}", _table(rows)]
    if b.heads:
        heads = [["top heads", "pair", "norm share", "first-order share"]]
        heads += [[h.name, h.kind, f"{h.norm_share:.2%}", f"{h.first_order_share:.2%}"] for h in b.top_heads(top)]
        lines += [f"the {count(len(b.heads), 'attention pair')} hold {1 - b.outside_pairs.norm_share:.1%} of the norm "
                  f"and {1 - b.outside_pairs.first_order_share:.1%} of the first-order term", _table(heads)]
    return "\n".join(lines)


def profile_path(folder: Path, model: str) -> Path:
    """Where ``--profile DIR`` draws a model's figure: ``DIR/<model>_profile.png``."""
    return folder / f"{model_folder_name(model)}_profile.png"


#: Files a saved model is loaded from (config, weights, tokenizer, processor): no output may replace one.
MODEL_FILE = re.compile(r"(.*config\.json|.*\.safetensors|.*\.bin|.*\.index\.json|tokenizer.*|vocab\..*|merges\.txt|"
                        r"special_tokens_map\.json|.*\.model)")


def model_file(name: str) -> bool:
    """Whether a file of a model folder is one the model is loaded from."""
    return MODEL_FILE.fullmatch(name) is not None


def check_distinct(outputs: list[tuple[Path, str]], inputs: list[tuple[Path, str]]) -> None:
    """Refuse, before any work, two outputs of one command that resolve to the same file (the second would silently
    replace the first) and an output that would replace one of the command's inputs.

    Args:
        outputs: (path, the option that names it: ``--json``, ``--profile figure``) per output.
        inputs: (path, what it is: ``--dataset``) per file the command reads.

    Raises:
        OutputPathError: naming both options and the fix.
    """
    seen: dict[Path, str] = {}
    for path, what in outputs:
        where = path.resolve()
        if where in seen:
            raise OutputPathError(f"{seen[where]} and {what} are the same file {str(path)!r}: one would replace the "
                                  "other; choose different paths.")
        seen[where] = what
    for path, what in inputs:
        if path.resolve() in seen:
            raise OutputPathError(f"{seen[path.resolve()]} {str(path)!r} is {what}, which the run reads: it would be "
                                  "replaced; choose another path.")


def model_folder_name(model: str) -> str:
    """A folder name for ``--output-path``: a Hub id as ``org__name`` (as lm-evaluation-harness does), a local
    folder by its own name."""
    path = Path(model)
    name = path.resolve().name if path.exists() else model
    return re.sub(r"[\"<>:/|\\?*\[\]]+", "__", name) or "model"


def _versions() -> dict[str, str | None]:
    from importlib.metadata import PackageNotFoundError, version

    def installed(name: str) -> str | None:
        try:
            return version(name)
        except PackageNotFoundError:
            return None

    return {"hf_geosharp": __version__, **{n: installed(n) for n in VERSIONED}, "python": platform.python_version()}


def _environment(device: Any) -> dict[str, Any]:

    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or platform.machine()
    return {"device": str(device), "device_name": name, "platform": platform.platform(),
            "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads()}  # fmt: skip


def _model_source(model_id: str) -> dict[str, Any]:
    """Which weights were measured: the content hash of the model folder's files and each weight file's sha256,
    or the Hub revision."""
    identity = model_identity(model_id)
    if Path(model_id).is_dir():
        identity["weights_sha256"] = weights_digests(Path(model_id))
    return identity


def payload(c: RunContext, timed: list[tuple[str, Any, float]], *, interrupted: bool = False) -> dict[str, Any]:
    """The results file's contents (see :mod:`hf_geosharp.commands.run`)."""
    args, s = c.args, c.settings
    results = {}
    for key, res, seconds in timed:
        entry = res.to_dict()
        entry["clean_loss_per_batch"] = entry.pop("per_batch_clean_loss")  # one name across every face
        fields = result_fields(key, res)
        if not math.isfinite(fields[f"{key}_stderr"]):  # one batch has no spread: JSON null, not NaN
            fields[f"{key}_stderr"] = None
        entry.setdefault("converged", getattr(res, "converged", None))  # (older engines: no convergence report)
        results[key] = {**fields, **entry, "seconds": seconds}
    settings = {k: v for k, v in s.as_dict().items() if not (k == "n_samples" and s.mode == "worst")
                and not (k == "steps" and s.mode == "average")} | {"ball": s.ball}  # fmt: skip
    now = datetime.datetime.now(datetime.timezone.utc)
    return {
        "results": results,
        "higher_is_better": {key: False for key, _, _ in timed},  # flatter is lower
        "config": {
            "model": args.model,
            "model_class": c.model_class,
            "dtype": str(next(c.model.parameters()).dtype),
            "device": str(c.device),
            "head": {"num_labels": args.num_labels, "seed": args.seed} if args.head else None,
            "measures": c.keys,
            "settings": settings,
            "trust_remote_code": args.trust_remote_code,
        },  # fmt: skip
        "data": {**dataclasses.asdict(c.spec), "n_examples_used": c.n_examples},
        "n_batches": len(c.batches),
        "world_size": c.world_size,
        "fsdp": c.fsdp,
        "symmetry": c.symmetry,
        "model_class": c.model_class,
        "model_name": args.model,
        "model_source": _model_source(args.model),
        "versions": _versions(),
        "date": now.isoformat(),
        "start_time": c.started.isoformat(),
        "total_evaluation_time_seconds": (now - c.started).total_seconds(),
        "environment": _environment(c.device),
        **({"interrupted": True} if interrupted else {}),
    }


def write_results(c: RunContext, timed: list[tuple[str, Any, float]], outputs: list[Path], show: bool) -> str | None:
    """Warn about unmapped attention, print the table and write every results file (rank 0 only); the error
    message when a file could not be written."""
    for fallback in c.symmetry["fallbacks"]:  # warnings go to stderr even with --quiet
        print(
            f"warning: attention module {fallback['module']!r} could not be mapped ({fallback['reason']}); its "
            "parameters are perturbed elementwise, so the geodesic numbers are not symmetry-invariant there.",
            file=sys.stderr,
        )
    if show or not outputs:  # --quiet without a results file still says what it measured
        print(results_table(timed))
    args = c.args
    if getattr(args, "by_layer", False):
        for key, res, _ in timed:
            print("\n" + breakdown_table(key, res))
    content, problem, written = payload(c, timed), None, []
    for path in outputs:  # the results first, each tried: a later output that fails loses no measurement
        try:
            write_json(path, content)  # durable: a failed write leaves the previous file intact
        except OSError as err:  # disk full, quota, a file-size limit: the old file is intact
            problem = problem or (f"could not write {path} ({err.strerror or err}); its previous contents are "
                                  "unchanged. Free space or choose another path.")
            continue
        written.append(path)
        if show:
            print(f"wrote {path}")
    if getattr(args, "profile", None) is not None:
        from ..plots import model_label, profile_figure, save_figure

        path = profile_path(args.profile, args.model)
        kept = f" (the results are in {written[0]})" if written else ""
        try:
            save_figure(profile_figure({key: res for key, res, _ in timed}, model_label(args.model)), path)
        except ValueError as err:
            return problem or f"--profile: {err}{kept}"
        except OSError as err:
            return problem or f"could not write {path} ({err.strerror or err}); choose another --profile folder{kept}."
        if show:
            print(f"wrote {path}")
    return problem
