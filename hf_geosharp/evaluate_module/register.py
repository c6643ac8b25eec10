"""Where the published evaluate module lies, and making the bare name ``evaluate.load("geodesic_sharpness")`` resolve
from any working directory.

The module (loading script and measurement card) is one folder, :data:`MODULE_DIR`: the repository's top-level
``metric_card/``, which a wheel installs inside the package as ``hf_geosharp/metric_card/``. evaluate loads a folder
only when it is named after its script, so a path load names the script itself: ``evaluate.load(str(SCRIPT))``.

evaluate has no plugin or entry-point hook. For a bare name it tries the cwd, then the Hub's ``evaluate-*`` orgs (which
belong to Hugging Face), and then falls back to its module cache, taking any 64-character sub-folder of
``$HF_MODULES_CACHE/evaluate_modules/metrics/evaluate-measurement--geodesic_sharpness/`` (the newest ``.py`` wins).
Registering therefore means writing our loading script there, which is what a Hub download would have left behind.
The script is a one-line shim that imports
:class:`hf_geosharp.evaluate_module.measurement.GeodesicSharpness`, so upgrading the package upgrades the module
without re-registering.

Registration happens only on request (``geosharp register``, run by ``scripts/install.sh``): importing the package
writes nothing.
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

from ..durable import write_bytes, write_text

logger = logging.getLogger(__name__)

NAME = "geodesic_sharpness"
CACHE_FOLDER = f"evaluate-measurement--{NAME}"


def _metric_card_folder() -> Path:
    """``metric_card/`` inside the installed package (a wheel puts it there), else beside the package (a checkout)."""
    package = Path(__file__).parents[1]
    installed = package / "metric_card"
    return installed if installed.is_dir() else package.parent / "metric_card"


MODULE_DIR = _metric_card_folder()
SCRIPT = MODULE_DIR / f"{NAME}.py"


def modules_cache() -> Path:
    """evaluate's ``HF_MODULES_CACHE``, resolved from the environment exactly as ``evaluate.config`` does."""
    xdg = os.getenv("XDG_CACHE_HOME", "~/.cache")
    hf_home = os.path.expanduser(os.getenv("HF_HOME", os.path.join(xdg, "huggingface")))
    return Path(os.getenv("HF_MODULES_CACHE", os.path.join(hf_home, "modules")))


def registered_script() -> Path:
    """Where :func:`register_evaluate_module` puts the loading script for the current environment."""
    digest = hashlib.sha256(SCRIPT.read_bytes()).hexdigest()  # evaluate accepts any 64-character folder name
    return modules_cache() / "evaluate_modules" / "metrics" / CACHE_FOLDER / digest / f"{NAME}.py"


def register_evaluate_module() -> Path:
    """Write (or refresh) the loading script in evaluate's module cache; idempotent and safe to run concurrently.

    Returns the path of the registered script. A script that is already there gets its mtime refreshed, so that after an
    up- or downgrade the installed version's script is the newest and evaluate picks it.
    """
    target = registered_script()
    if target.exists():
        os.utime(target)
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    root = modules_cache()
    for folder in (root, *target.parents[: len(target.relative_to(root).parts) - 1]):
        if not (folder / "__init__.py").exists():  # evaluate imports the script as a package member
            write_text(folder / "__init__.py", "")
    write_bytes(target, SCRIPT.read_bytes())  # atomic: ranks launched together never see a half-written script
    logger.debug("registered %s at %s", NAME, target)
    return target


class _CacheNoticeFilter(logging.Filter):
    """Drops evaluate's "Using the latest cached version of the module ..." warning for this module only: after
    registration the cache is where the module is meant to come from, so the notice is noise, not a warning."""

    def filter(self, record: logging.LogRecord) -> bool:
        return CACHE_FOLDER not in record.getMessage()


def quiet_cache_notice() -> None:
    """Install the filter on evaluate's loader logger (once), when evaluate builds the module: importing the package
    leaves evaluate's logging alone, so the first bare-name load in a process shows evaluate's notice, the next ones
    do not."""
    loader = logging.getLogger("evaluate.loading")
    if not any(isinstance(f, _CacheNoticeFilter) for f in loader.filters):
        loader.addFilter(_CacheNoticeFilter())
