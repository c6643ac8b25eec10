"""Where the attention pairs sit in the solver's flat vector: strided boxes, factors and pair groups.

A tangent vector is one flat tensor (see :class:`hf_geosharp.engine.space.perturbation_space.PerturbationSpace`). A pair
group's ``G`` and ``H`` factors are ``[k, n, h]`` tensors whose entries are scattered over that vector; this module
moves them in and out. It holds no geometry and no buffers: callers pass the output tensors (from a
:class:`hf_geosharp.engine.space.workspace.Workspace`), and every operation can act on a range of heads, so that the
geometry can work on a few heads at a time with small scratch buffers.

Under FSDP a factor may also have *shared rows*: rows whose ``h`` entries live on several ranks (a head cut by a
shard boundary, or a bias row). Those rows are assembled on every rank by one sum over the ranks (each rank adds
its own entries to zeros) and written back only where this rank owns the entries (see
:meth:`hf_geosharp.engine.placement.fsdp_layout.ShardedLayout.pair_factors`).
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from ...symmetry.base import PairBlock

Reduce = Callable[[Tensor], Tensor]
ALL_HEADS = slice(None)


@dataclass(frozen=True)
class Piece:
    """A box ``[k, r, :]`` of a factor whose flat indices are ``offset + k s_k + r s_r + c s_c``: a strided view."""

    k: slice
    r: slice
    size: tuple[int, int, int]
    stride: tuple[int, int, int]
    offset: int

    def restricted(self, heads: slice, n_heads: int) -> tuple[Piece, slice] | None:
        """This box cut to the heads ``heads`` (a step-1 slice), and where its heads land in the cut; None if empty."""
        start, stop, _ = heads.indices(n_heads)
        k0, k1 = max(self.k.start, start), min(self.k.stop, stop)
        if k0 >= k1:
            return None
        size = (k1 - k0, *self.size[1:])
        offset = self.offset + (k0 - self.k.start) * self.stride[0]
        return Piece(slice(k0, k1), self.r, size, self.stride, offset), slice(k0 - start, k1 - start)


def strided_pieces(index: Tensor, min_elements: int = 256) -> list[Piece] | None:
    """Cover an index map ``[K, n, m]`` by strided boxes, or ``None`` if it has no such structure.

    Attention factors are slices of weight matrices (transposed or not) plus a bias row, so a handful of boxes per
    layer describe them. Copying through ``as_strided`` views is 2-4x faster than ``index_select``/``index_copy_`` on
    a CPU (no index reads, no scattered read-modify-writes). Rows are split where the pattern of head 0 changes;
    every head is then checked against that split, and heads whose offsets step evenly are merged into one box."""
    K, n, m = index.shape
    if index.numel() == 0:
        return None
    I = index.cpu()
    step_c = I[:, :, 1:2] - I[:, :, :1] if m > 1 else torch.ones_like(I[:, :, :1])
    if m > 1 and not bool((I[:, :, 1:] - I[:, :, :-1] == step_c).all()):
        return None
    base = I[:, :, 0]
    first, steps = base[0].tolist(), step_c[0, :, 0].tolist()  # head 0, as Python ints: the loops are per row
    runs, r0 = [], 0  # row runs of head 0 with one column step and one row step
    for r in range(1, n + 1):
        if r == n or steps[r] != steps[r0] or (r - r0 >= 2 and first[r] - first[r - 1] != first[r0 + 1] - first[r0]):
            runs.append((r0, r))
            r0 = r
    pieces = []
    for r0, r1 in runs:
        s_c, s_r = steps[r0], first[r0 + 1] - first[r0] if r1 - r0 > 1 else 1
        rows = torch.arange(r1 - r0)
        expected = base[:, r0, None, None] + rows[None, :, None] * s_r + torch.arange(m)[None, None, :] * s_c
        if s_c < 0 or s_r < 0 or not bool((I[:, r0:r1] == expected).all()):
            return None
        pieces.extend(_merge_heads(base[:, r0].tolist(), r0, r1, m, s_r, s_c))
    if any(p is None for p in pieces):
        return None
    if index.numel() < min_elements * len(pieces):
        return None  # tiny boxes: one index operation is cheaper than many small copies
    return pieces


def _merge_heads(offsets: list[int], r0: int, r1: int, m: int, s_r: int, s_c: int) -> list[Piece | None]:
    """Boxes of rows ``r0:r1`` for runs of heads whose offsets step evenly (None where a step is negative)."""
    pieces: list[Piece | None] = []
    K, k0 = len(offsets), 0
    for k in range(1, K + 1):
        if k == K or (k - k0 >= 2 and offsets[k] - offsets[k - 1] != offsets[k0 + 1] - offsets[k0]):
            s_k = offsets[k0 + 1] - offsets[k0] if k - k0 > 1 else 1
            pieces.append(None if s_k < 0 else Piece(slice(k0, k), slice(r0, r1), (k - k0, r1 - r0, m),
                                                     (s_k, s_r, s_c), offsets[k0]))
            k0 = k
    return pieces


@dataclass(frozen=True)
class Box:
    """Pieces of equal shape and strides whose heads follow each other and whose offsets step evenly (the same box
    in every layer of a model: layers' parameters lie at one stride in the flat vector), as one 4-D strided view:
    ``[layers, heads per layer, rows, columns]``, heads ``k`` of the factor."""

    k: slice
    r: slice
    size: tuple[int, int, int, int]
    stride: tuple[int, int, int, int]
    offset: int


def merged_boxes(pieces: list[Piece]) -> list[Box]:
    """``pieces`` as few :class:`Box` es: runs of pieces (in head order, per row range) that continue each other."""
    boxes: list[Box] = []
    for rows in dict.fromkeys((p.r.start, p.r.stop) for p in pieces):  # row ranges, in order of appearance
        run: list[Piece] = []
        for piece in sorted((p for p in pieces if (p.r.start, p.r.stop) == rows), key=lambda p: p.k.start):
            if run and (piece.size != run[0].size or piece.stride != run[0].stride or piece.k.start != run[-1].k.stop
                        or piece.offset - run[-1].offset != (run[1].offset - run[0].offset if len(run) > 1
                                                             else piece.offset - run[-1].offset)
                        or piece.offset <= run[-1].offset):
                boxes.append(_box(run))
                run = []
            run.append(piece)
        if run:
            boxes.append(_box(run))
    return boxes


def _box(run: list[Piece]) -> Box:
    first = run[0]
    step = run[1].offset - first.offset if len(run) > 1 else 1
    return Box(slice(first.k.start, run[-1].k.stop), first.r, (len(run), *first.size), (step, *first.stride),
               first.offset)


@dataclass
class SharedRows:
    """Rows of a factor that several ranks hold parts of: ``positions[k, r, c]`` is where this rank keeps entry
    ``(k, r, c)`` of the shared rows in its flat vector, ``-1`` where another rank keeps it."""

    positions: Tensor
    reduce: Reduce

    def assemble(self, x: Tensor, out: Tensor, heads: slice) -> None:
        """Write the full shared rows of ``x`` (this rank's entries plus everyone else's) into ``out``."""
        where = self.positions[heads]
        mine = where >= 0
        rows = torch.zeros(where.shape, dtype=out.dtype, device=out.device)  # contiguous, as collectives need
        rows[mine] = x[where[mine]]
        out.copy_(self.reduce(rows))

    def write(self, out: Tensor, value: Tensor, heads: slice, add: bool) -> None:
        """Write (or, with ``add``, add) the entries of ``heads`` from ``value`` into the flat vector ``out``."""
        where = self.positions[heads]
        mine = where >= 0
        if add:
            out.index_add_(0, where[mine], value[mine])
        else:
            out.index_copy_(0, where[mine], value[mine])


@dataclass
class Factor:
    """One factor (all ``G`` or all ``H``) of a pair group: where its ``[k, n, h]`` entries sit in the flat vector.

    The first ``n_own`` rows are this rank's (all of them without sharding): strided ``pieces`` or, for layouts
    without that structure, a flat ``index`` (int64: twice the memory of the float coordinates it addresses, so it
    is dropped when pieces exist). The remaining rows, if any, are :class:`SharedRows`."""

    shape: torch.Size
    pieces: list[Piece] | None
    index: Tensor | None
    shared: SharedRows | None = None
    #: The pieces merged across layers (:func:`merged_boxes`), for operations on all heads at once: one copy per box
    #: instead of one per layer, so the count of copies does not grow with depth.
    boxes: list[Box] | None = None

    @classmethod
    def of(cls, index: Tensor, device: torch.device, shared: SharedRows | None = None) -> Factor:
        """From the index map of the rows this rank owns, ``[k, n_own, h]``, plus its shared rows."""
        pieces = strided_pieces(index)
        n_shared = 0 if shared is None else shared.positions.shape[1]
        shape = torch.Size((index.shape[0], index.shape[1] + n_shared, index.shape[2]))
        boxes = None if pieces is None else merged_boxes(pieces)
        return cls(shape, pieces, None if pieces is not None else index.to(device), shared, boxes)

    @property
    def n_own(self) -> int:
        """The rows this rank stores itself (all of them outside FSDP; shared rows are assembled, not owned)."""
        return self.shape[1] - (0 if self.shared is None else self.shared.positions.shape[1])

    def rows(self, heads: slice = ALL_HEADS) -> torch.Size:
        """The shape of the factor restricted to ``heads``."""
        return torch.Size((len(range(*heads.indices(self.shape[0]))), *self.shape[1:]))

    def _regions(self, heads: slice) -> list[tuple[slice, slice, tuple[int, ...], tuple[int, ...], int]]:
        """``(heads of the output, rows, size, stride, offset)`` per strided region of the flat vector that ``heads``
        cover: one per box (``[layers, heads, rows, h]``, all heads at once) or one per piece (``[heads, rows, h]``)."""
        if self.boxes is not None and heads.indices(self.shape[0])[:2] == (0, self.shape[0]):
            return [(b.k, b.r, b.size, b.stride, b.offset) for b in self.boxes]
        regions = []
        for piece in self.pieces:
            cut = piece.restricted(heads, self.shape[0])
            if cut is not None:
                p, where = cut
                regions.append((where, p.r, p.size, p.stride, p.offset))
        return regions

    def _views(self, x: Tensor, heads: slice) -> list[tuple[slice, slice, Tensor]]:
        """``(heads of the output, rows, strided view of x)`` per region (:meth:`_regions`); the view is
        ``[layers, heads, rows, h]`` for a box, so the output's heads are viewed the same way (:func:`_shaped`)."""
        return [(where, rows, _strided(x, size, stride, offset))
                for where, rows, size, stride, offset in self._regions(heads)]

    def segment_views(self, segments: list[Tensor]) -> list[tuple[Piece, Tensor]] | None:
        """Each piece as a strided view into the segment (a 1-D tensor, e.g. a parameter) of the flat layout
        ``cat(segments)`` that holds it, so that the base point's own rows can be read from the weights themselves
        (shared rows are not covered); None where a factor has no pieces, or a piece that spans two segments."""
        if self.pieces is None:
            return None
        starts = [0, *itertools.accumulate(s.numel() for s in segments)]
        views = []
        for piece in self.pieces:
            last = piece.offset + sum((n - 1) * st for n, st in zip(piece.size, piece.stride))
            i = bisect.bisect_right(starts, piece.offset) - 1  # the segment that holds the piece's first entry
            if last >= starts[i + 1]:
                return None
            seg = segments[i]
            views.append((piece, seg.as_strided(piece.size, piece.stride, seg.storage_offset() + piece.offset
                                                - starts[i])))
        return views

    def gather_views(self, views: list[tuple[Piece, Tensor]], out: Tensor, heads: slice = ALL_HEADS) -> Tensor:
        """``out <-`` this factor's own rows for ``heads``, read from :meth:`segment_views`."""
        for piece, view in views:
            cut = piece.restricted(heads, self.shape[0])
            if cut is not None:
                p, where = cut
                first = p.k.start - piece.k.start
                out[where, p.r].copy_(view[first : first + p.size[0]])
        return out

    def _own_index(self, heads: slice) -> Tensor:
        return self.index[heads].reshape(-1)

    def gather(self, x: Tensor, out: Tensor, heads: slice = ALL_HEADS) -> Tensor:
        """``out <- x`` at this factor's entries for ``heads`` (``out``: ``[len(heads), n, h]``)."""
        own = out[:, : self.n_own]
        if self.pieces is None:
            own.copy_(x[self._own_index(heads)].view(own.shape))
        else:
            for where, rows, view in self._views(x, heads):
                _shaped(own[where, rows], view).copy_(view)
        if self.shared is not None:
            self.shared.assemble(x, out[:, self.n_own :], heads)
        return out

    def write(self, out: Tensor, value: Tensor, heads: slice = ALL_HEADS, add: bool = False) -> None:
        """Put (or add, with ``add``) ``value`` (``[len(heads), n, h]``) at this factor's entries of ``out``."""
        own = value[:, : self.n_own]
        if self.pieces is None:
            index = self._own_index(heads)
            (out.index_add_ if add else out.index_copy_)(0, index, own.reshape(-1))
        elif torch.compiler.is_compiling():  # a captured graph cannot write through as_strided views
            for where, rows, size, stride, offset in self._regions(heads):
                index = _strided_index(size, stride, offset, out.device)
                part = own[where, rows].reshape(-1)
                (out.index_add_ if add else out.index_copy_)(0, index, part)
        else:
            for where, rows, view in self._views(out, heads):
                (view.add_ if add else view.copy_)(_shaped(own[where, rows], view))
        if self.shared is not None:
            self.shared.write(out, value[:, self.n_own :], heads, add)


def _strided(x: Tensor, size: tuple[int, ...], stride: tuple[int, ...], offset: int) -> Tensor:
    """The strided view of the flat vector ``x`` (1-D, stride 1) at ``offset`` entries from its start; made relative to
    ``x`` (no read of its storage offset), so that it traces under ``torch.compile``."""
    return x[offset:].as_strided(size, stride)


def _strided_index(size: tuple[int, ...], stride: tuple[int, ...], offset: int, device: torch.device) -> Tensor:
    """The flat indices of the strided region ``(size, stride, offset)``, in its row-major order (int64, 1-D): made
    inside a captured graph from its shape alone, so nothing is kept (a compiler folds it into the write)."""
    index = torch.full((), offset, dtype=torch.int64, device=device)
    for dim, (n, st) in enumerate(zip(size, stride)):
        shape = [1] * len(size)
        shape[dim] = n
        index = index + (torch.arange(n, dtype=torch.int64, device=device) * st).view(shape)
    return index.reshape(-1)


def _shaped(part: Tensor, view: Tensor) -> Tensor:
    """``part`` (``[heads, rows, h]``) with its heads split as those of ``view`` (``[layers, heads, rows, h]``)."""
    return part if view.dim() == part.dim() else part.unflatten(0, view.shape[:2])


def stack_alike(blocks: list[PairBlock]) -> list[tuple[Tensor, Tensor, Tensor | None]]:
    """Stack the index maps of blocks with equal pair shapes and group into one ``[sum k, n, h]`` block.

    Every formula of :class:`~hf_geosharp.engine.geometry.gl_quotient.GLQuotient` is batched over the leading (head)
    dimension, so the twelve layers of a BERT become two geometry objects (QK, VO) instead of 24."""
    groups: dict[tuple, list[PairBlock]] = {}
    for b in blocks:
        basis = None if b.lie_basis is None else (tuple(b.lie_basis.shape), tuple(b.lie_basis.flatten().tolist()))
        groups.setdefault((tuple(b.G_index.shape[1:]), tuple(b.H_index.shape[1:]), basis), []).append(b)
    return [
        (torch.cat([b.G_index for b in members]), torch.cat([b.H_index for b in members]), members[0].lie_basis)
        for members in groups.values()
    ]


def pair_parameters(blocks: list[PairBlock], sizes: list[int]) -> set[int]:
    """The positions of the parameters that hold pair coordinates."""
    ends = torch.tensor(sizes).cumsum(0)
    found: set[int] = set()
    for b in blocks:
        for index in (b.G_index, b.H_index):
            found.update(torch.bucketize(index.reshape(-1).cpu(), ends, right=True).unique().tolist())
    return found
