"""``geosharp export-space DIR``: write a self-contained Hugging Face Space (Gradio app + evaluate module) folder.

The repository keeps one folder for the evaluate module (``metric_card/``: loading script and measurement card) and
the app (``spaces_demo/app.py``); the Space is generated from them, never symlinked:

* ``README.md``: the measurement card with the Space's front matter (``sdk: gradio``, ``sdk_version`` = the installed
  gradio, ``app_file``, ``python_version``, ``preload_from_hub`` for the MiniLM weights);
* ``app.py``: the app; ``geodesic_sharpness.py``: the loading script, pinned to this package version;
* ``wheels/hf_geosharp-<version>-py3-none-any.whl``: this package, built from its source (no index serves it);
* ``requirements.txt``: the wheel, the CPU build of the installed torch (PyTorch's CPU index) and the installed
  versions of the libraries the app uses.

The Hub installs ``requirements.txt`` before the Space's files are in place, so on the Hub the wheel must be named
by URL: pass ``--space-id OWNER/NAME`` (the Space you will upload to) and the requirement points at the wheel in that
Space's own repo. Without it the requirement is the relative path ``./wheels/...`` (installs from the folder itself).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path

from huggingface_hub import SpaceCard

from .._version import __version__
from ..durable import staged_dir, write_bytes, write_text
from .common import EXIT_BAD_INPUT, EXIT_OK, error, keep_on_interrupt

MODULE_DIR = Path("metric_card")  # the evaluate module's one folder, in the source
MINILM_REPO = "sentence-transformers/all-MiniLM-L6-v2"
MINILM_FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt",
                "special_tokens_map.json")  # what BertForSequenceClassification and its tokenizer read, no more
PINNED = ("evaluate", "transformers", "pandas")  # what the app imports beside torch; gradio comes from sdk_version
_SOURCE_FILES = ("pyproject.toml", "setup.py", "README.md", "LICENSE")
_SOURCE_DIRS = ("hf_geosharp", str(MODULE_DIR))  # the package and the evaluate module the wheel ships inside it


class ExportError(ValueError):
    """The Space cannot be written; the message says what to change."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``geosharp export-space``."""
    p = subparsers.add_parser(
        "export-space",
        help="write a self-contained Hugging Face Space folder (Gradio app, evaluate module, wheel, requirements)",
        description="Build this package's wheel from its source and write a Space folder that installs on the Hub: "
        "README front matter, app.py, the pinned loading script, requirements with the CPU torch index.",
    )
    p.add_argument("out", type=Path, help="the Space folder to create (must be new or empty)")
    p.add_argument("--space-id", metavar="OWNER/NAME",
                   help="the Space you will upload to: its requirements then name the wheel by URL (needed on the Hub)")
    p.add_argument("--source", type=Path,
                   help="the package source (a checkout with pyproject.toml and spaces_demo/app.py; default: the one "
                   "this package was imported from)")
    p.set_defaults(func=run)


def source_root(explicit: Path | None = None) -> Path:
    """The checkout to build from: it must hold the build files, the package, the evaluate module and the app."""
    root = Path(explicit) if explicit else Path(__file__).resolve().parents[2]
    needed = ("pyproject.toml", "setup.py", "hf_geosharp/__init__.py", str(MODULE_DIR / "README.md"),
              "spaces_demo/app.py")
    missing = [p for p in needed if not (root / p).is_file()]
    if missing:
        raise ExportError(f"{str(root)!r} is not an hf_geosharp source checkout (missing {', '.join(missing)}); the "
                          "Space ships a wheel built from the source, so pass --source CHECKOUT.")
    return root


def build_wheel(root: Path, out_dir: Path) -> Path:
    """This package's wheel, built from a clean copy of the source (nothing is written into the checkout)."""
    with tempfile.TemporaryDirectory(prefix="geosharp-wheel-") as tmp:
        for name in _SOURCE_FILES:
            if (root / name).exists():
                shutil.copy2(root / name, Path(tmp) / name)
        for name in _SOURCE_DIRS:
            shutil.copytree(root / name, Path(tmp) / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        staging = Path(tmp) / "dist"
        proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
                               "--no-index", "-w", str(staging), tmp], capture_output=True, text=True)
        wheels = sorted(staging.glob("hf_geosharp-*.whl"))
        if proc.returncode != 0 or len(wheels) != 1:
            raise ExportError(f"building the wheel failed (it needs setuptools>=77.0.3 in this environment: "
                              f"pip install 'setuptools>=77.0.3'): {proc.stderr.strip()[-2000:]}")
        out_dir.mkdir(parents=True, exist_ok=True)
        return write_bytes(out_dir / wheels[0].name, wheels[0].read_bytes())


def _version(dist: str) -> str:
    return metadata.version(dist).split("+")[0]  # torch 2.15.0+cu132 -> 2.15.0 (the CPU index serves 2.15.0+cpu)


def requirements(wheel: str, space_id: str | None) -> str:
    """requirements.txt: the CPU torch index, the wheel (by URL with ``space_id``), pinned libraries."""
    location = (f"hf_geosharp @ https://huggingface.co/spaces/{space_id}/resolve/main/wheels/{wheel}" if space_id
                else f"./wheels/{wheel}")
    lines = [f"# Generated by `geosharp export-space` (hf_geosharp {__version__}); the Space's gradio is "
             "sdk_version in README.md.",
             "--extra-index-url https://download.pytorch.org/whl/cpu", f"torch=={_version('torch')}", location,
             *(f"{dist}=={_version(dist)}" for dist in PINNED)]
    return "\n".join(lines) + "\n"


def loading_script() -> str:
    """The evaluate loading script, pinned: it refuses to run against another hf_geosharp version."""
    return f'''"""evaluate loading script for ``geodesic_sharpness``, generated for hf_geosharp {__version__}.

The measurement lives in the hf_geosharp package (``hf_geosharp.evaluate_module.measurement``); this script only
checks that the installed package is the version it was generated for (the wheel in this Space's ``wheels/``).
"""

from hf_geosharp import __version__ as _installed

if _installed != "{__version__}":
    raise ImportError(f"this geodesic_sharpness module needs hf_geosharp=={__version__}, not {{_installed}}: install "
                      "the wheel from this Space's wheels/ folder.")

from hf_geosharp.evaluate_module.measurement import GeodesicSharpness  # noqa: E402

__all__ = ["GeodesicSharpness"]
'''


def space_readme(root: Path) -> str:
    """The measurement card with the Space's front matter."""
    card = SpaceCard((root / MODULE_DIR / "README.md").read_text())
    try:
        import gradio
    except ImportError:
        raise ExportError("the Space needs gradio: pip install 'hf_geosharp[space]'") from None

    card.data.sdk, card.data.sdk_version, card.data.app_file = "gradio", gradio.__version__, "app.py"
    card.data.python_version = f"{sys.version_info.major}.{sys.version_info.minor}"
    card.data.pinned = False
    # the MiniLM choice: its weights are fetched into the Space's Hub cache at build time and read from there
    card.data.preload_from_hub = [f"{MINILM_REPO} {','.join(MINILM_FILES)}"]
    return str(card)


def export_space(out: Path, *, space_id: str | None = None, source: Path | None = None) -> list[Path]:
    """Write the Space folder ``out`` (new or empty); returns the files written."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{str(out)!r} exists and is not an empty folder; pass a new folder (nothing is "
                          "overwritten).")
    if space_id is not None and space_id.count("/") != 1:
        raise ExportError(f"--space-id {space_id!r} is not OWNER/NAME.")
    root = source_root(source)
    done = f"the Space folder {out} is complete"  # what Ctrl-C reports once it is in place
    with staged_dir(out, on_commit=lambda: keep_on_interrupt(done)) as staging:  # a failure leaves ``out`` untouched
        wheel = build_wheel(root, staging / "wheels")
        write_text(staging / "README.md", space_readme(root))
        write_text(staging / "app.py", (root / "spaces_demo" / "app.py").read_text())
        write_text(staging / "geodesic_sharpness.py", loading_script())
        write_text(staging / "requirements.txt", requirements(wheel.name, space_id))
    return sorted(p for p in out.rglob("*") if p.is_file())


def run(args: argparse.Namespace) -> int:
    """Build the Space's folder; the exit code."""
    try:
        files = export_space(args.out, space_id=args.space_id, source=args.source)
    except ExportError as err:
        error(str(err))
        return EXIT_BAD_INPUT
    print("\n".join(str(f) for f in files))
    hint = "" if args.space_id else " (pass --space-id OWNER/NAME before uploading to the Hub)"
    target = args.space_id or "OWNER/NAME"
    print(f"wrote the Space to {args.out}{hint}; upload it with `hf upload {target} {args.out} --repo-type space`")
    return EXIT_OK
