"""What a leaderboard ranks and how: the models (resolved from folders, list files and Hub ids), its columns (measures
of the registry, :mod:`hf_geosharp.measures`, each in a mode) and where each model's generalisation gap comes from.
The solver settings are the registry's :class:`~hf_geosharp.measures.Settings`."""

from __future__ import annotations

import csv
import dataclasses
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ..data import DataError
from ..engine.settings import Mode
from ..measures import MEASURES, Settings, parse_measures

GapMetric = Literal["error", "loss"]
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


@dataclass(frozen=True)
class ModelRef:
    """A model to rank: its display name and where ``from_pretrained`` finds it (a folder or a Hub id)."""

    name: str
    source: str


def resolve_models(specs: Iterable[str]) -> list[ModelRef]:
    """Model folders, folders of checkpoint folders, text files listing models (one per line) and Hub ids.

    Args:
        specs: model folders, folders of checkpoint folders, model-list files or Hub ids, as given.

    Returns:
        One reference per model, in the order given.
    """
    sources: list[str] = []

    def add(spec: str, base: Path, reading: tuple[Path, ...]) -> None:
        path = Path(spec) if Path(spec).is_absolute() else base / spec
        if path.is_file():
            here = path.resolve()
            if here in reading:
                chain = " -> ".join(str(p) for p in (*reading, here))
                raise DataError(f"the model list {str(path)!r} includes itself ({chain}); remove that line.")
            try:
                lines = path.read_text(encoding="utf-8").splitlines()
            except UnicodeDecodeError:
                raise DataError(f"the model list {str(path)!r} is not UTF-8 text; save it as UTF-8, one model per "
                                "line.") from None
            for line in lines:
                if line.strip() and not line.lstrip().startswith("#"):
                    add(line.strip(), path.parent, (*reading, here))
        elif (path / "config.json").is_file():
            sources.append(str(path.resolve()))
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if (p / "config.json").is_file())
            if not found:
                raise DataError(f"folder {str(path)!r} holds no model: neither it nor a sub-folder has a config.json.")
            sources.extend(str(p.resolve()) for p in found)
        elif _HUB_ID.match(spec):
            sources.append(spec)
        else:
            raise DataError(f"{spec!r} is neither a model folder, a folder of checkpoints, a list file nor a Hub id.")

    for spec in specs:
        add(spec, Path.cwd(), ())
    if not sources:
        raise DataError("no models to rank; pass model folders, a folder of checkpoints, a list file or Hub ids.")
    sources = list(dict.fromkeys(sources))
    names = [Path(s).name if os.path.isabs(s) else s for s in sources]
    if len(set(names)) < len(names):  # same folder name in different places: show more of the path
        common = os.path.commonpath([s for s in sources if os.path.isabs(s)] or ["/"])
        names = [os.path.relpath(s, common) if os.path.isabs(s) else s for s in sources]
    return [ModelRef(n, s) for n, s in zip(names, sources)]


@dataclass(frozen=True)
class Column:
    """One column of a leaderboard: a measure of the registry (its key or short form, e.g. ``"inv"``) in one mode
    (``None``: the mode of the leaderboard's settings). Relative flatness has no mode: asked in both, it is one
    column."""

    key: str
    mode: Mode | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", parse_measures([self.key])[0])  # a short form becomes its key

    def settings(self, shared: Settings) -> Settings:
        """The leaderboard's settings in this column's mode: what its measure runs with.

        Args:
            shared: the leaderboard's shared settings.

        Returns:
            The settings this column's measure runs with.
        """
        return shared if self.mode is None else dataclasses.replace(shared, mode=self.mode)

    def name(self, shared: Settings) -> str:
        """The column's name: the engine's name of its measure run with :meth:`settings` (e.g.
        ``geodesic_inv_worst``), also the ``measure`` of its stored results.

        Args:
            shared: the leaderboard's shared settings.

        Returns:
            The column's name.
        """
        return MEASURES[self.key].engine_name(self.settings(shared))


@dataclass
class GapSpec:
    """Where each model's generalisation gap comes from: a file, or its error (or loss) on two splits.

    Attributes:
        file: CSV/TSV with columns ``model`` and ``gap``, or JSON ``{model: gap}``; models match by name or source.
        train_split, test_split: splits of the leaderboard's dataset; gap = test minus train.
        metric: ``"error"`` (paper's ViT setting: test error minus train error) or ``"loss"``.
        n_examples: examples per split (``None``: the whole split).
        batch_size: evaluation batch size.
    """

    file: Path | None = None
    train_split: str = "train"
    test_split: str = "test"
    metric: GapMetric = "error"
    n_examples: int | None = None
    batch_size: int = 256


def read_gap_file(path: Path) -> dict[str, float]:
    """``{model: gap}`` from a JSON mapping or a CSV/TSV with ``model`` and ``gap`` columns.

    Args:
        path: a ``.json``, ``.csv`` or ``.tsv`` file.

    Returns:
        Model -> generalisation gap.
    """
    if not path.is_file():
        raise DataError(f"gap file {str(path)!r} does not exist.")
    try:
        text = path.read_text(encoding="utf-8")
        if path.suffix.lower() == ".json":
            data = json.loads(text)
            if not isinstance(data, dict):
                raise DataError(f"gap file {str(path)!r} must hold a JSON object {{model: gap}}.")
            return {str(k): float(v) for k, v in data.items()}
        rows = list(csv.DictReader(text.splitlines(), delimiter="\t" if path.suffix.lower() == ".tsv" else ","))
        if not rows or not {"model", "gap"} <= set(rows[0]):
            raise DataError(f"gap file {str(path)!r} needs a header with columns 'model' and 'gap'.")
        return {row["model"]: float(row["gap"]) for row in rows}
    except UnicodeDecodeError:
        raise DataError(f"gap file {str(path)!r} is not UTF-8 text; save it as UTF-8.") from None
    except (TypeError, ValueError) as err:  # not JSON, or a gap that is not a number
        if isinstance(err, DataError):
            raise
        raise DataError(f"gap file {str(path)!r} cannot be read: {err}; every gap must be a number.") from None
