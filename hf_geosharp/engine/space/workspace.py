"""The one owner of the geometry's scratch memory.

A solver step needs a few pair-sized temporaries (gathered gradients, directions, geodesic corrections). Making them
fresh at every step costs page faults (the C allocator returns large freed blocks to the system). So the
perturbation space carves its temporaries, front to back, from one buffer that this object allocates once and that
nothing else touches, sized by one rule (:meth:`Workspace.plan`): a whole pair group at a time where the memory
allows, else a few heads at a time (:meth:`Workspace.heads_per_chunk`). Every operation of the space starts with
:meth:`Workspace.fresh`, so no scratch tensor outlives the operation that took it.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

#: Default scratch size, in entries of the working dtype (4 Mi entries: 16 MiB in float32, a layer of BERT-base's
#: heads per chunk; a parameter-sized vector of BERT-base is 110 Mi entries).
DEFAULT_ENTRIES = 1 << 22
#: The least scratch :meth:`Workspace.sized_for` gives (1 Mi entries: 4 MiB in float32).
MIN_ENTRIES = 1 << 20


class Workspace:
    """Scratch memory for the perturbation space: ``entries`` floats of ``dtype`` on ``device``, allocated on first use.

    Args:
        entries: the size of the buffer; the space chooses its head chunks so that one operation's temporaries fit.
        dtype, device: of the buffer (the space's working dtype and device).
        limit: the size :meth:`reserve` may grow the buffer to before its first use (default: ``entries``).
    """

    def __init__(self, dtype: torch.dtype, device: torch.device | str, entries: int = DEFAULT_ENTRIES,
                 limit: int | None = None) -> None:
        if entries < 1:
            raise ValueError(f"a workspace needs at least one entry, got {entries}.")
        self.dtype, self.device, self.entries = dtype, torch.device(device), int(entries)
        self.limit = self.entries if limit is None else max(self.entries, int(limit))
        self._buffer: Tensor | None = None
        self._used = 0

    @classmethod
    def sized_for(cls, coordinates: int, dtype: torch.dtype, device: torch.device | str,
                  room: int | None = None) -> Workspace:
        """Scratch for a solve whose vectors have ``coordinates`` entries.

        The rule prefers one head chunk per pair group: every chunk repeats each geometry operation (a few hundred
        small kernels), so the count of operations per step is then independent of the model's depth. It starts at
        a sixteenth of one vector (between :data:`MIN_ENTRIES` and :data:`DEFAULT_ENTRIES`) and may grow, through
        :meth:`reserve`, to ``room`` bytes (the memory the solve's goal leaves free, see
        :meth:`hf_geosharp.engine.placement.single.SingleProcess.workspace`); only where one chunk would need more
        than that are the groups cut into chunks of as many heads as fit."""
        entries = min(DEFAULT_ENTRIES, max(MIN_ENTRIES, coordinates // 16))
        return cls(dtype, device, entries, None if room is None else room // dtype.itemsize)

    def reserve(self, entries: int) -> None:
        """Grow to ``entries`` (at most :attr:`limit`) before the buffer's first use; later a no-op."""
        if self._buffer is None:
            self.entries = max(self.entries, min(self.limit, int(entries)))

    def fresh(self) -> Workspace:
        """Start an operation: everything taken before is free again."""
        self._used = 0
        return self

    def take(self, shape: torch.Size | tuple[int, ...]) -> Tensor:
        """An uninitialised contiguous tensor of ``shape``; fresh memory only if the buffer is used up (a chunk that
        does not fit, e.g. one head larger than the whole workspace). Inside a captured graph (``torch.compile``) a
        fresh tensor: the graph's own temporary, whose memory the compiler plans (writing into a buffer that outlives
        the graph would make every write a copy of the whole buffer there)."""
        if torch.compiler.is_compiling():
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        n = math.prod(shape)
        if self._buffer is None:
            self._buffer = torch.empty(self.entries, dtype=self.dtype, device=self.device)
        if self._used + n > self.entries:
            return torch.empty(shape, dtype=self.dtype, device=self.device)
        view = self._buffer[self._used : self._used + n].view(shape)
        self._used += n
        return view

    def plan(self, group_entries: list[int], temporaries: int, held: int = 0) -> bool:
        """Decide, once, how the pair geometry uses memory, and grow the buffer for it; whether the base point is kept.

        ``group_entries`` are the pair groups' sizes (entries of ``G`` and ``H`` together) and ``temporaries`` the
        group-sized tensors one operation holds at most, the base point among them. The rule prefers one chunk per
        group with the base point kept by the geometry (an operation is then one stacked batch over every layer,
        read nowhere at each step): it is taken when the limit holds ``temporaries - 1`` group-sized temporaries
        of the largest group beside a copy of every group's base point (for one group, the bytes of reading its base
        point into the workspace; the copies count in the space's ``held_bytes``). Otherwise the buffer
        grows to ``temporaries`` of the largest group, as far as the limit allows, and groups are cut into chunks of
        as many heads as fit (:meth:`heads_per_chunk`), each reading its base point from the weights. ``held``
        (entries) is what the geometry holds besides, its ``h x h`` caches: the limit is for all of it."""
        if not group_entries:
            return False
        largest = max(group_entries)
        room = (self.limit if self._buffer is None else self.entries) - held
        keep = (temporaries - 1) * largest + sum(group_entries) <= room
        self.reserve(min((temporaries - 1 if keep else temporaries) * largest, room))
        return keep

    def heads_per_chunk(self, entries_per_head: int, tensors: int) -> int:
        """How many heads fit when an operation holds ``tensors`` head-sized temporaries of ``entries_per_head``."""
        return max(1, self.entries // max(1, entries_per_head * tensors))
