"""The one memoised store helper: a record is computed once under its key and kept in a result store (the
leaderboard's :class:`~hf_geosharp.leaderboard.store.ResultStore`) the moment it exists, so a rerun computes only what
is missing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol


class Store(Protocol):
    """What :class:`Memo` needs of a store: records by key, appended, and where it lives (to read it again)."""

    path: Path

    def get(self, key: str) -> dict[str, Any] | None: ...  # noqa: D102

    def put(self, record: dict[str, Any]) -> None: ...  # noqa: D102


class Memo:
    """Records by key, computed at most once: the store's record, or ``compute()``'s, stored before it is returned.

    Args:
        store: the result store.
        reread: on a miss, open the store again first (another process may be filling it).
    """

    def __init__(self, store: Store, *, reread: bool = False) -> None:
        self.store = store
        self.reread = reread

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored record of ``key``, or ``None``.

        Args:
            key: the record's key (a fingerprint of everything that determines it).

        Returns:
            The record, or ``None`` when none is stored.
        """
        if self.store.get(key) is None and self.reread:
            self.store = type(self.store)(self.store.path)
        return self.store.get(key)

    def __call__(self, key: str, compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
        """The record of ``key``: stored, or ``compute()``'s fields under ``key``, stored now.

        Args:
            key: the record's key.
            compute: makes the record's fields (without ``key``) when none is stored.

        Returns:
            The record, with its ``key``.
        """
        if (record := self.get(key)) is None:
            record = {"key": key, **compute()}
            self.store.put(record)
        return record
