"""Dimension audit of chosen attention blocks of a real model: matrix-free, with the prediction term by term.

The block (e.g. ``encoder.layer.0.attention`` of MiniLM) is cut out of the model: its inputs are captured on random
token ids and its output is differentiated with respect to the audited coordinates while everything else stays
frozen. The rank of that Jacobian is measured from a Gaussian sketch ``Psi^T J`` built from vector-Jacobian products
(:func:`hf_geosharp.symmetry.audit.sketch_jacobian`) and compared with the rank the symmetry map predicts::

    predicted = audited coordinates - QK orbit - VO orbit - key bias - value bias - input-subspace directions
                - output-LayerNorm directions

A big block is audited on a *slice*: the first ``dims`` head dimensions of the first ``heads`` pairs of every QK and
VO block (all rows of ``G`` and ``H``) plus the output bias. The subgroup GL(dims) acting on those columns moves only
sliced coordinates, so its orbit lies inside the slice, while a direction mixing sliced and frozen columns does
not, so the slice's symmetry is exactly GL(dims) per pair. See docs/symmetries.md for the derivation of each term.

The rank is numpy's (singular values above ``largest * max(sketch shape) * eps``) and the verdict counts a gap only
where the disputed singular values are clear of that tolerance by two decades (:mod:`.audit_rank`), so rounding
never fails a map. The block must compute in float64 throughout, which is checked before any work.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call

from .audit import SKETCH_OVERSAMPLE, sketch_jacobian, unrotated_columns
from .audit_capture import block_inputs, block_precision, first_tensor
from .audit_rank import DOUBT, judge, numerical_rank, rank_tolerance
from .base import PairBlock, SymmetryMap
from .mapping import map_symmetries

logger = logging.getLogger(__name__)

MAX_BLOCK_PARAMS = 6000  # the sketch is (n + 16) x n float64 and its SVD cubic: 6000 -> 290 MB, about a minute


@dataclass
class BlockAuditResult:
    """Outcome of :func:`block_audit` for one attention block.

    ``gap`` (predicted - measured) counts only disagreements clear of rounding, ``gap_within_rounding`` the others;
    ``verdict`` is ``"PASS"`` iff ``gap == 0``. ``tolerance`` is relative to the largest singular value.
    """

    module: str
    scope: str
    n_params: int
    n_tokens: int
    n_outputs: int
    sketch_rows: int
    input_rank: dict[str, int]
    terms: dict[str, int]
    predicted_rank: int
    rank: int
    n_inactive: int
    singular_values_at_cut: list[float]
    null_space_by_parameter: dict[str, float]
    tolerance: float
    gap: int
    gap_within_rounding: int
    verdict: str
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        """The audit as plain data (for JSON)."""
        return asdict(self)

    def format(self) -> str:
        """The audit as the lines ``geosharp symmetry --audit --layers`` prints."""
        lines = [f"Block audit: {self.module} ({self.scope})",
                 f"  Jacobian: {self.n_outputs:,} outputs ({self.n_tokens} tokens) x {self.n_params:,} audited "
                 f"coordinates, sketched with {self.sketch_rows:,} random vector-Jacobian products",
                 f"  block input: rank {self.input_rank['x']} of {self.input_rank['width']} features, "
                 f"rank {self.input_rank['x1']} with the constant 1 appended",
                 f"  {'audited coordinates':52} {self.n_params:>8,}"]
        lines += [f"  - {name:50} {dim:>8,}" for name, dim in self.terms.items()]
        lines.append(f"  = {'predicted rank':50} {self.predicted_rank:>8,}")
        hi, lo = self.singular_values_at_cut
        lines.append(f"  measured rank {self.rank:,} (singular values > {self.tolerance:.2g} x largest; at the cut "
                     f"{hi:.2e} then {lo:.2e} relative), {self.n_inactive} coordinates with zero gradient")
        lines.append("  null directions by parameter (squared weight, adds up to the nullity): "
                     + ", ".join(f"{k} {v:g}" for k, v in self.null_space_by_parameter.items()))
        if self.gap:
            lines.append(f"  gap {self.gap:+,}: " + (
                "redundancies the prediction does not name" if self.gap > 0 else
                "the map claims more symmetry than the block has (a wrong map)"))
        if self.gap_within_rounding:
            lines.append(f"  {self.gap_within_rounding:+,} more within rounding (singular values within {DOUBT:g}x of "
                         "the tolerance): not told from round-off, not counted")
        lines.append(f"  seconds: {self.seconds:.1f}")
        lines.append(f"verdict: {self.verdict}")
        return "\n".join(lines)


def _layer_of(module: str) -> int | None:
    match = re.search(r"(?:^|\.)(\d+)(?:\.|$)", module)
    return int(match.group(1)) if match else None


def _owner_names(smap: SymmetryMap, index: torch.Tensor) -> list[str]:
    offsets = torch.tensor(smap.offsets)
    owners = torch.searchsorted(offsets, index.reshape(-1).contiguous(), right=True) - 1
    return [smap.param_names[i] for i in owners.tolist()]


def _bias_rows(smap: SymmetryMap, factor: torch.Tensor) -> int:
    """Rows of a ``[n, h]`` factor that hold a bias (their first column is owned by a ``*.bias`` parameter)."""
    return sum(name.endswith(".bias") for name in _owner_names(smap, factor[:, 0]))


@dataclass
class _Piece:
    """The audited part of one pair block: its first ``k`` pairs and first ``t`` columns."""

    block: PairBlock
    k: int
    t: int

    @property
    def coords(self) -> torch.Tensor:
        b = self.block
        return torch.cat([b.G_index[: self.k, :, : self.t].reshape(-1), b.H_index[: self.k, :, : self.t].reshape(-1)])

    @property
    def orbit(self) -> int:
        full = self.t == self.block.head_dim
        return self.k * (self.block.group_dim if full else self.t**2)


def _plan(smap: SymmetryMap, module: str, blocks: list[PairBlock], o_bias: str | None, max_params: int,
          heads: int, dims: int, n_block_params: int) -> tuple[list[_Piece], list[str], str]:
    """The audited pieces, extra parameters and a description: the whole block if it fits, else a slice."""
    if n_block_params <= max_params:
        return [_Piece(b, b.n_pairs, b.head_dim) for b in blocks], [], "whole block"
    if any(b.lie_basis is not None for b in blocks):
        raise ValueError(f"{module}: {n_block_params:,} parameters > max_params={max_params:,}, and a block with a "
                         "reduced group (RoPE commutant) cannot be sliced by head dims; audit a smaller model.")
    pieces = [_Piece(b, min(heads, b.n_pairs), min(dims, b.head_dim)) for b in blocks]
    extras = [o_bias] if o_bias else []
    n = sum(p.coords.numel() for p in pieces) + sum(int(torch.Size(smap.param_shapes[smap.param_names.index(e)])
                                                        .numel()) for e in extras)
    if n > max_params:
        raise ValueError(f"{module}: even the slice of {heads} pair(s) x {dims} head dim(s) has {n:,} coordinates > "
                         f"max_params={max_params:,} (the sketch needs ~{8 * n * n / 2**20:,.0f} MiB and an SVD of "
                         f"that size); pass smaller heads/dims or a larger max_params.")
    scope = (f"slice: head dims 0-{pieces[0].t - 1} of the first {pieces[0].k} pair(s) of each QK and VO block "
             f"(all rows of G and H){', plus the output bias' if extras else ''}; {n_block_params:,} parameters "
             f"in the block")
    return pieces, extras, scope


def _post_layernorm(model: nn.Module, smap: SymmetryMap, vo: PairBlock) -> bool:
    """Whether the output projection's own module ends in an ``nn.LayerNorm`` (BERT's ``output.LayerNorm``)."""
    o_weight = next(n for n in _owner_names(smap, vo.H_index[0, :1, :1]))
    parent = model.get_submodule(o_weight.rsplit(".", 2)[0])
    return any(isinstance(m, nn.LayerNorm) for m in parent.children())


def _predict(smap: SymmetryMap, pieces: list[_Piece], o_bias: str | None, audited_o_bias: bool, post_ln: bool,
             width: int, rank_x: int, rank_x1: int) -> dict[str, int]:
    """The predicted null directions, term by term (each derived in docs/symmetries.md)."""
    terms: dict[str, int] = {}

    def add(name: str, n: int) -> None:
        if n:
            terms[name] = terms.get(name, 0) + n

    for p in pieces:
        b = p.block
        group = f"GL({p.t})" if p.t < b.head_dim or b.lie_basis is None else f"commutant dim {b.group_dim}"
        add(f"{b.kind.upper()} orbit ({p.k} pair(s) x {group})", p.orbit)
        # input-subspace directions: per row block of a factor that reads the block input, n a^T with [X, 1] n = 0
        factors = [b.G_index, b.H_index] if b.kind == "qk" else [b.G_index]
        for factor in factors:
            rows, biased = factor.shape[1], _bias_rows(smap, factor[0])
            blocks_in = biased if biased else rows // width
            if rows != blocks_in * (width + (1 if biased else 0)):
                raise ValueError(f"{b.module}: a {b.kind} factor with {rows} rows does not read the block input "
                                 f"(width {width}) alone (relative-position rows?); the block audit does not cover it")
            per_block = (width + 1 - rank_x1) if biased else (width - rank_x)
            add("input subspace ([X, 1] n = 0) of W_q, W_k, W_v", blocks_in * per_block * p.t * p.k)
        if b.kind == "qk" and "key bias visible" not in b.note:  # RoPE: the unrotated columns only
            columns = p.t if b.lie_basis is None else int(unrotated_columns(b)[: p.t].sum())
            add("key bias (invisible to softmax)", _bias_rows(smap, b.H_index[0]) * columns * p.k)
        if b.kind == "vo" and audited_o_bias:
            add("value bias (absorbed by the output bias)", _bias_rows(smap, b.G_index[0]) * p.t * p.k)
        if b.kind == "vo" and post_ln:
            add("output LayerNorm: W_O rows along 1", (b.H_index.shape[1] // width) * p.t * p.k)
    if post_ln and audited_o_bias and o_bias:
        add("output LayerNorm: output bias along 1", 1)
    return terms


def block_audit(
    model: nn.Module,
    layers: list[int],
    smap: SymmetryMap | None = None,
    *,
    heads: int = 1,
    dims: int = 2,
    max_params: int = MAX_BLOCK_PARAMS,
    rtol: float | None = None,
    seed: int = 0,
    log: Callable[[str], None] = logger.info,
) -> list[BlockAuditResult]:
    """Audit the attention blocks of ``layers`` (indices as in the module paths) one by one.

    Args:
        model: a float64 model (``transformers`` with token or pixel inputs); it is left exactly as it was.
        layers: layer indices, e.g. ``[0]`` for ``encoder.layer.0.attention``.
        smap: its symmetry map; default ``map_symmetries(model)``.
        heads: a block with more than ``max_params`` parameters is audited on its first ``heads`` pairs ...
        dims: ... and their first ``dims`` head dimensions.
        max_params: the most coordinates one sketch may have.
        rtol: singular values below ``rtol`` times the largest count as zero; default numpy's ``matrix_rank``
            tolerance, ``largest * max(sketch shape) * eps``.
        seed: seed of the inputs and the sketch.
        log: where progress and the time estimate go.

    Returns:
        One result per audited block.
    """
    params = list(model.parameters())
    if any(p.dtype != torch.float64 for p in params):
        raise ValueError("the block audit needs a float64 model (numerical rank near float64 round-off): audit "
                         "copy.deepcopy(model).double(), or use `geosharp symmetry MODEL --audit --layers ...`.")
    smap = map_symmetries(model) if smap is None else smap
    by_module: dict[str, list[PairBlock]] = {}
    for b in smap.blocks:
        if b.kind in ("qk", "vo") and _layer_of(b.module) in layers:
            by_module.setdefault(b.module, []).append(b)
    if not by_module:
        known = sorted({i for b in smap.blocks if (i := _layer_of(b.module)) is not None})
        raise ValueError(f"no mapped attention block in layers {layers}; mapped layers: {known or 'none'}")
    modes = {m: m.training for m in model.modules()}
    model.eval()
    try:
        for name in by_module:
            if low := block_precision(model, model.get_submodule(name), seed):
                raise ValueError(
                    f"{name} computes below float64 ({', '.join(low)}): its Jacobian shows float32 round-off where "
                    "float64 shows zero, and no verdict can rest on it. Hugging Face's eager attention runs the "
                    "softmax in float32; audit a copy with sdpa (float64 on float64 inputs): m = "
                    "copy.deepcopy(model); m.set_attn_implementation('sdpa'), or use `geosharp symmetry MODEL "
                    "--audit --layers ...`, which does that.")
        return [_audit_one(model, smap, name, blocks, heads, dims, max_params, rtol, seed, log)
                for name, blocks in by_module.items()]
    finally:
        for m, mode in modes.items():
            m.training = mode


def _output_bias(smap: SymmetryMap, vo: PairBlock | None) -> str | None:
    """The name of the output projection's bias, or ``None`` if it has none (or there is no VO block)."""
    if vo is None:
        return None
    o_weight = _owner_names(smap, vo.H_index[0, :1, :1])[0]
    o_bias = o_weight.removesuffix("weight") + "bias" if o_weight.endswith("weight") else None
    return o_bias if o_bias in smap.param_names else None


def _local_offsets(local: dict[str, nn.Parameter]) -> dict[str, int]:
    """Where each of the block's parameters starts in the block's own flat vector."""
    sizes = [p.numel() for p in local.values()]
    return dict(zip(local, [0] + list(torch.cumsum(torch.tensor(sizes), 0)[:-1].tolist())))


def _local_coords(smap: SymmetryMap, name: str, local: dict[str, nn.Parameter], pieces: list[_Piece],
                  extras: list[str], whole: bool) -> torch.Tensor:
    """The audited coordinates as indices into the block's own flat vector (the model's map indexes the model's)."""
    if whole:
        coords = torch.arange(sum(p.numel() for p in local.values()))
    else:
        offsets = _local_offsets(local)
        shift = {name + "." + n: offsets[n] - smap.offsets[smap.param_names.index(name + "." + n)] for n in local}
        flat = torch.cat([p.coords for p in pieces] + [smap.index_of(e).reshape(-1) for e in extras])
        coords = torch.tensor([g + shift[o] for g, o in zip(flat.tolist(), _owner_names(smap, flat))])
    if coords.unique().numel() != coords.numel():
        raise ValueError(f"{name}: audited coordinates overlap (a parameter in two pairs)")
    return coords


def _block_function(block: nn.Module, local: dict[str, nn.Parameter], coords: torch.Tensor, args: tuple,
                    kwargs: dict) -> tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]:
    """The block's flat output as a function of the audited coordinates (all else frozen), and their values now."""
    base = torch.cat([p.detach().reshape(-1) for p in local.values()])
    shapes = [p.shape for p in local.values()]
    sizes = [p.numel() for p in local.values()]

    def f(v: torch.Tensor) -> torch.Tensor:
        flat = base.index_put((coords,), v)
        tensors = {k: t.view(s) for k, t, s in zip(local, flat.split(sizes), shapes)}
        return first_tensor(functional_call(block, tensors, args=args, kwargs=kwargs)).reshape(-1)

    return f, base[coords].clone()


def _estimator(name: str, n: int, log: Callable[[str], None]) -> Callable[[float, int], None]:
    """Logs the time the sketch and its SVD will take, from the first chunk's time and a small timed SVD."""

    def estimate(seconds: float, n_chunks: int) -> None:
        probe = torch.randn(max(n // 4, 1), max(n // 4, 1), dtype=torch.float64)  # the SVD is cubic: x 64
        t0 = time.perf_counter()
        torch.linalg.svd(probe, full_matrices=False)
        svd = (time.perf_counter() - t0) * 64
        log(f"{name}: estimated {seconds * n_chunks:,.0f} s for the sketch and ~{svd:,.0f} s for its SVD")

    return estimate


def _null_shares(vh: torch.Tensor, rank: int, coords: torch.Tensor, local: dict[str, nn.Parameter]) -> dict[str, float]:
    """Where the null directions live: each null basis vector has unit norm, so the shares add up to n - rank."""
    null = vh[rank:].square().sum(0)
    local_owner = torch.searchsorted(torch.tensor(list(_local_offsets(local).values())), coords, right=True) - 1
    shares: dict[str, float] = {}
    for i, k in enumerate(local):
        share = float(null[local_owner == i].sum())
        if share > 1e-6:
            shares[k] = round(share, 3)
    return shares


def _audit_one(model: nn.Module, smap: SymmetryMap, name: str, blocks: list[PairBlock], heads: int, dims: int,
               max_params: int, rtol: float | None, seed: int, log: Callable[[str], None]) -> BlockAuditResult:
    start = time.perf_counter()
    block = model.get_submodule(name)
    local = dict(block.named_parameters())
    vo = next((b for b in blocks if b.kind == "vo"), None)
    o_bias = _output_bias(smap, vo)
    pieces, extras, scope = _plan(smap, name, blocks, o_bias, max_params, heads, dims,
                                  sum(p.numel() for p in local.values()))
    coords = _local_coords(smap, name, local, pieces, extras, scope == "whole block")
    n = coords.numel()
    audited_o_bias = o_bias is not None and (scope == "whole block" or o_bias in extras)

    gen = torch.Generator().manual_seed(seed)
    args, kwargs, x, out_width = block_inputs(model, block, n, gen)
    width = x.shape[1]
    ones = torch.ones(x.shape[0], 1, dtype=torch.float64)
    x1 = torch.cat([x, ones], 1)
    rank_x = numerical_rank(torch.linalg.svdvals(x), rtol, tuple(x.shape))
    rank_x1 = numerical_rank(torch.linalg.svdvals(x1), rtol, tuple(x1.shape))
    post_ln = vo is not None and _post_layernorm(model, smap, vo)
    terms = _predict(smap, pieces, o_bias, audited_o_bias, post_ln, width, rank_x, rank_x1)

    f, theta = _block_function(block, local, coords, args, kwargs)
    n_outputs = x.shape[0] * out_width
    log(f"{name}: {scope}; {n:,} coordinates, {x.shape[0]} tokens -> {n_outputs:,} outputs; sketch of "
        f"{n + SKETCH_OVERSAMPLE:,} vector-Jacobian products ({8 * (n + SKETCH_OVERSAMPLE) * n / 2**20:,.0f} MiB)")
    sketch, _ = sketch_jacobian(f, theta, generator=gen, on_first_chunk=_estimator(name, n, log))
    _, sv, vh = torch.linalg.svd(sketch, full_matrices=False)
    predicted = n - sum(terms.values())
    tolerance = rank_tolerance(sv, tuple(sketch.shape)) if rtol is None else rtol * float(sv[0])
    judged = judge(sv, predicted, tolerance)
    rank = judged.rank
    col = sketch.norm(dim=0)
    n_inactive = int((col <= 1e-12 * col.max()).sum())
    cut = [float(sv[rank - 1] / sv[0]) if rank else 0.0, float(sv[rank] / sv[0]) if rank < sv.numel() else 0.0]
    return BlockAuditResult(name, scope, n, x.shape[0], n_outputs, sketch.shape[0],
                            {"width": width, "x": rank_x, "x1": rank_x1}, terms, predicted, rank, n_inactive, cut,
                            _null_shares(vh, rank, coords, local), tolerance / float(sv[0]), judged.gap,
                            judged.gap_within_rounding, judged.verdict, time.perf_counter() - start)
