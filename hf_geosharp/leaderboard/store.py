"""The leaderboard's result store, the lock on its output folder, and the fingerprints that key its results.

Long runs must survive being killed, so every number goes into a :class:`ResultStore` (JSON lines, one complete
record per line, appended with a single ``write`` and ``fsync``) the moment it is computed, and a rerun computes only
what is missing. Reuse is only safe when the key changes whenever the number could: so a result is keyed by a hash of
what determines it, the *content* of the weights, config and tokenizer files (or the Hub revision), the *content* of
the data (or datasets' own fingerprint of a Hub or ``save_to_disk`` dataset), the settings and the library version.
Sizes and modification times are not enough: editing config.json or flipping labels in a CSV keeps both.

One run at a time writes into an output folder (:func:`output_lock`): two runs would compute everything twice and
interleave their lines.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Any

from .._version import __version__

logger = logging.getLogger(__name__)

STORE_FILE = "results.jsonl"
LOCK_FILE = "leaderboard.lock"
# What each kind of leaderboard record must hold to be used; a line without them is damage, skipped and recomputed.
# Records of other kinds (other users of the store, e.g. the hide & seek demo) need only their key.
REQUIRED = {
    "measure": ("value", "clean_loss"),
    "stats": ("param_norm", "clean_loss"),
    "splits": ("train_loss", "train_error", "test_loss", "test_error"),
}
FINITE, NUMBER, FLAG = "a finite number", "a number", "true or false"  # what a field's value must be
#: The type of every field a leaderboard record's numbers are read from (where present; :data:`REQUIRED` says which
#: must be). A value of another type (``NaN`` where a number is ranked, ``null``, a string, a list) makes the line
#: damage like a missing field: ranking it would put the model in a wrong place or fail at the end of every run.
#: NUMBER allows NaN: a standard error of one batch, the error rate of a regression head.
FIELDS = {
    "measure": {"value": FINITE, "clean_loss": FINITE, "stderr": NUMBER, "converged": FLAG,
                "stationarity_gap": NUMBER},
    "stats": {"param_norm": FINITE, "clean_loss": FINITE},
    "splits": {"train_loss": FINITE, "test_loss": FINITE, "train_error": NUMBER, "test_error": NUMBER},
}
MODEL_FILE_SUFFIXES = (".safetensors", ".bin", ".json", ".txt", ".model", ".tiktoken")  # what from_pretrained reads
NOT_MODEL_FILES = ("training_args.bin", "trainer_state.json")  # written by Trainer next to a model; never read
DATASETS_CACHE_FILES = "cache-*.arrow"  # datasets' name for the results of map/filter/shuffle on disk
_CHUNK = 1 << 20


class StoreLockedError(RuntimeError):
    """Another run holds the output folder's lock."""


@dataclass(frozen=True)
class DamagedLine:
    """A store line that is not a usable record: where it is and why."""

    number: int
    reason: str
    key: str | None = None  # the record's key, where the line has one


class ResultStore:
    """Append-only JSON-lines store of finished results, keyed by a fingerprint of everything that determines them.

    Appends are one ``os.write`` of a whole line on an ``O_APPEND`` descriptor followed by ``fsync``, so a record is
    either entirely on disk or (if the process dies inside the write) a torn last line, which :meth:`__init__` cuts
    off. Any other damaged line (bad bytes, not JSON, a record without its key or values, a value of the wrong type:
    see :data:`FIELDS`) is skipped, listed in :attr:`damaged` with its line number and left in the file; the rest of
    the store is used, and the damaged results are computed again (a good line with the same key supersedes the
    damaged one).
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.records: dict[str, dict[str, Any]] = {}
        self.damaged: list[DamagedLine] = []
        if not self.path.exists():
            return
        raw = self.path.read_bytes()
        complete = raw[: raw.rfind(b"\n") + 1]
        if len(complete) < len(raw):
            logger.warning("%s: dropping a torn last line (%d bytes) left by an interrupted run", self.path,
                           len(raw) - len(complete))
            with open(self.path, "r+b") as f:
                f.truncate(len(complete))
                os.fsync(f.fileno())
        for number, line in enumerate(complete.split(b"\n")[:-1], 1):
            record, reason = _parse(line)
            if record is None:
                self.damaged.append(DamagedLine(number, reason, _record_key(line)))
            else:
                self.records[record["key"]] = record
        if self.damaged:
            logger.warning("%s", self.damage_report())

    def damage_report(self) -> str:
        """One paragraph naming the file, each damaged line (the first ten) and why, and what happens to them."""
        shown = "; ".join(f"line {d.number}: {d.reason}" for d in self.damaged[:10])
        more = f"; and {len(self.damaged) - 10} more" if len(self.damaged) > 10 else ""
        superseded = [d.number for d in self.damaged if d.key is not None and d.key in self.records]
        todo = len(self.damaged) - len(superseded)
        what = []
        if todo:
            what.append(f"{'its result' if todo == 1 else 'their results'} will be recomputed")
        if superseded:
            what.append(f"line {', '.join(map(str, superseded[:10]))}{' ...' if len(superseded) > 10 else ''} "
                        "already has a good record with the same key (delete that line to silence this)")
        return (f"{self.path}: skipped {len(self.damaged)} damaged line(s) ({shown}{more}); they stay in the file "
                f"and are never ranked; {'; '.join(what)}")

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored record of ``key`` (the fingerprint of a model and its settings), or None."""
        return self.records.get(key)

    def put(self, record: dict[str, Any]) -> None:
        """Persist one record durably before returning."""
        line = (json.dumps(record, sort_keys=True, allow_nan=True) + "\n").encode()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)  # minus the umask, like every file
        try:
            os.write(fd, line)
            os.fsync(fd)
        finally:
            os.close(fd)
        self.records[record["key"]] = record


def _parse(line: bytes) -> tuple[dict[str, Any] | None, str]:
    """A usable record from one line, or ``None`` and why not."""
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError:
        return None, "not UTF-8"
    except ValueError:
        return None, "not JSON"
    if not isinstance(record, dict) or not isinstance(record.get("key"), str):
        return None, "no 'key'"
    missing = [k for k in REQUIRED.get(record.get("kind"), ()) if k not in record]  # other users store other kinds
    if missing:
        return None, f"no {', '.join(repr(k) for k in missing)}"
    for name, kind in FIELDS.get(record.get("kind"), {}).items():
        if name in record and not _is(record[name], kind):
            return None, f"{name!r} is {_shown(record[name])}, not {kind}"
    return record, ""


def _is(value: Any, kind: str) -> bool:
    if kind == FLAG:
        return isinstance(value, bool)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return kind == NUMBER or math.isfinite(value)


def _shown(value: Any) -> str:
    """A JSON value as the store's line spells it (``null``, ``NaN``, a string in quotes)."""
    text = json.dumps(value, allow_nan=True)
    text = text if len(text) <= 40 else text[:37] + "..."
    kind = {str: "a string ", list: "a list ", dict: "an object "}.get(type(value), "")
    return f"{kind}{text}"


def _record_key(line: bytes) -> str | None:
    """The key of a line that is JSON with a string key (also a damaged one), else None."""
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:  # UnicodeDecodeError is a ValueError
        return None
    key = record.get("key") if isinstance(record, dict) else None
    return key if isinstance(key, str) else None


@contextlib.contextmanager
def output_lock(folder: str | Path) -> Iterator[Path]:
    """Hold ``folder/leaderboard.lock`` for the block; fail at once (no waiting) when another run holds it.

    The lock is an OS file lock (``filelock``), so it is released when its holder exits, even when it is killed."""
    from filelock import FileLock, Timeout

    path = Path(folder) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(path), timeout=0)
    try:
        lock.acquire()
    except Timeout:
        raise StoreLockedError(
            f"another geosharp leaderboard is writing into {str(folder)!r} (it holds the lock {str(path)!r}); wait "
            "for it to finish, or pass a different --out."
        ) from None
    try:
        yield path
    finally:
        lock.release()


def fingerprint(**parts: Any) -> str:
    """A stable key for a result: any change in model, data, settings or library version gives a new key (and a
    recomputation)."""
    payload = json.dumps({**parts, "hf_geosharp": __version__}, sort_keys=True, default=str)
    return hashlib.sha256(payload.encode()).hexdigest()[:20]


def file_digest(path: Path) -> str:
    """sha256 of a file's content, streamed (weights can be gigabytes)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            digest.update(block)
    return digest.hexdigest()


def tree_digest(folder: Path, files: list[Path]) -> str:
    """One sha256 over the names and contents of ``files`` (relative to ``folder``)."""
    digest = hashlib.sha256()
    for path in sorted(files):
        digest.update(str(path.relative_to(folder)).encode() + b"\0" + file_digest(path).encode() + b"\n")
    return digest.hexdigest()


def model_identity(source: str) -> dict[str, Any]:
    """What determines a model's results: the content of the files ``from_pretrained`` reads from its folder
    (weights, config, tokenizer or image processor; not the README), or the Hub revision a Hub id resolves to."""
    folder = Path(source)
    if folder.is_dir():
        files = [p for p in folder.iterdir() if p.is_file() and p.suffix in MODEL_FILE_SUFFIXES
                 and p.name not in NOT_MODEL_FILES]
        return {"source": source, "content": tree_digest(folder, files)}
    return {"source": source, "revision": hub_revision(source)}


#: The files that hold a model's weights: what ``geosharp run`` records the sha256 of, and ``geosharp card`` checks.
WEIGHT_SUFFIXES = (".safetensors", ".bin")


def weights_digests(folder: Path) -> dict[str, str]:
    """Each weight file's sha256 in a model folder, by file name (empty for a folder without weights, or none).

    Args:
        folder: the model folder.

    Returns:
        File name -> sha256 of its content.
    """
    if not folder.is_dir():
        return {}
    return {p.name: file_digest(p) for p in sorted(folder.iterdir()) if p.is_file() and p.suffix in WEIGHT_SUFFIXES}


def hub_revision(repo_id: str) -> str | None:
    """The commit sha a Hub model id resolves to: from the local cache (offline), else from the Hub."""
    from huggingface_hub import constants, model_info, try_to_load_from_cache

    cached = try_to_load_from_cache(repo_id, "config.json")
    if isinstance(cached, str):  # .../snapshots/<commit sha>/config.json
        return Path(cached).parent.name
    if constants.HF_HUB_OFFLINE:
        return None  # not cached and offline: loading the model will fail with the fix
    try:
        return model_info(repo_id).sha
    except Exception as err:  # noqa: BLE001 - a missing repo is reported by the loader, with its own message
        logger.debug("no revision for %s: %s", repo_id, err)
        return None


def data_identity(spec: Any, dataset: Any = None) -> dict[str, Any]:
    """What determines the batches: the data settings plus the content of local data files (any files under a
    folder), or ``datasets``' own fingerprint of the loaded split for a Hub dataset."""
    path = Path(spec.dataset)
    key: dict[str, Any] = {"spec": asdict(spec)}
    if path.is_file():
        key["content"] = file_digest(path)
    elif path.is_dir():  # not the cache-*.arrow files datasets writes beside the data when another tool maps it
        files = [p for p in path.rglob("*") if p.is_file() and not fnmatch(p.name, DATASETS_CACHE_FILES)]
        key["content"] = tree_digest(path, files)
    elif dataset is not None:
        key["fingerprint"] = getattr(dataset, "_fingerprint", None)
    return key
