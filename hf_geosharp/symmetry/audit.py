"""Dimension audit: the rank of the parameter-to-output Jacobian against the dimension the symmetry map predicts.

Seen as a neuromanifold, a model's function space near ``theta`` has dimension ``rank J(theta)``. Every continuous
symmetry removes its orbit's dimension from that rank, so ``n_params - orbit_dim`` (the quotient dimension) is an
upper bound, reached only if the map knows every redundancy. The audit measures the rank on random inputs (maximum
over a few draws, because numerical rank on finitely many inputs can only underestimate) and explains the gap:
parameters that do not act on these inputs, the key bias (invisible to softmax) and the value bias (absorbed by
the output bias). What remains is unexplained; a *negative* gap means the map claims a symmetry the model does not
have, i.e. a wrong map.
"""

from __future__ import annotations

import logging
import math
import time
import warnings
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch import nn
from torch.func import functional_call, vjp, vmap

from .audit_rank import lower_precision_ops, numerical_rank
from .base import PairBlock, SymmetryMap
from .flat import flat_vector, parameters_in_order
from .mapping import map_symmetries

logger = logging.getLogger(__name__)

InputFn = Callable[[torch.Generator, int], dict[str, Any]]
MAX_AUDIT_PARAMS = 5000  # the Jacobian is dense (outputs x parameters) and its SVD cubic


@dataclass
class AuditResult:
    """Outcome of :func:`jacobian_rank_audit`; ``gap = predicted_rank - rank`` (0 when everything is explained)."""

    n_params: int
    n_outputs: int
    ranks: list[int]
    rank: int
    n_inactive: int
    inactive_params: list[str]
    orbit_dim: int
    quotient_dim: int
    redundancies: dict[str, int]
    predicted_rank: int
    gap: int

    def to_dict(self) -> dict[str, Any]:
        """The audit as plain data (for JSON)."""
        return asdict(self)

    def format(self) -> str:
        """The audit as the lines ``geosharp symmetry --audit`` prints."""
        lines = [
            f"Dimension audit: Jacobian rank {self.rank} (draws: {self.ranks}) of {self.n_outputs} outputs x "
            f"{self.n_params} parameters",
            f"  quotient dim (n_params - orbit {self.orbit_dim}): {self.quotient_dim}",
            f"  inactive on these inputs: {self.n_inactive}"
            + (f" ({', '.join(self.inactive_params[:6])}{', ...' if len(self.inactive_params) > 6 else ''})"
               if self.inactive_params else ""),
        ]
        lines += [f"  known redundancy, {name}: {dim}" for name, dim in self.redundancies.items()]
        lines.append(f"  predicted rank {self.predicted_rank}, measured {self.rank}: gap {self.gap}")
        if self.gap > 0:
            lines.append("  gap > 0: redundancies the map does not cover (e.g. LayerNorm's shift and scale invariance, "
                         "embedding tables that enter only through their sum)")
        elif self.gap < 0:
            lines.append("  gap < 0: the map claims more symmetry than the model has; the mapping is wrong")
        return "\n".join(lines)


def random_inputs(model: nn.Module, seq_len: int = 8) -> InputFn:
    """Random inputs for a ``transformers`` model from its config (token ids in sequences of up to ``seq_len``, or
    pixels for vision models)."""
    config = getattr(model, "config", None)
    main = getattr(model, "main_input_name", None)
    if config is None or main not in ("input_ids", "pixel_values"):
        raise ValueError(f"cannot draw random inputs for {type(model).__name__}; pass inputs=... to the audit.")
    if main == "input_ids":
        seq = min(seq_len, getattr(config, "max_position_embeddings", None) or seq_len)

        def text(gen: torch.Generator, n_tokens: int) -> dict[str, Any]:
            shape = (math.ceil(n_tokens / seq), seq)
            batch = {"input_ids": torch.randint(0, config.vocab_size, shape, generator=gen)}
            if getattr(config, "is_encoder_decoder", False):
                batch["decoder_input_ids"] = torch.randint(0, config.vocab_size, shape, generator=gen)
            return batch

        return text
    vision = getattr(config, "vision_config", config)
    size, channels = vision.image_size, getattr(vision, "num_channels", 3)
    tokens_per_image = (size // getattr(vision, "patch_size", size)) ** 2 + 1
    dtype = next(model.parameters()).dtype

    def pixels(gen: torch.Generator, n_tokens: int) -> dict[str, Any]:
        n = math.ceil(n_tokens / tokens_per_image)
        return {"pixel_values": torch.randn(n, channels, size, size, generator=gen, dtype=dtype)}

    return pixels


def _first_tensor(outputs: Any) -> torch.Tensor:
    if isinstance(outputs, torch.Tensor):
        return outputs
    items = outputs.values() if isinstance(outputs, dict) else outputs
    for item in items:
        if isinstance(item, torch.Tensor):
            return item
    raise ValueError("the model returned no tensor to audit; pass output=... to select one.")


def _owner_ids(smap: SymmetryMap, index: torch.Tensor) -> torch.Tensor:
    """For each flat index, the position of its parameter in ``smap.param_names``."""
    return torch.searchsorted(torch.tensor(smap.offsets), index.reshape(-1), right=True) - 1


def _owners(smap: SymmetryMap, index: torch.Tensor) -> set[str]:
    return {smap.param_names[i] for i in _owner_ids(smap, index).unique().tolist()}


def _owned_by(smap: SymmetryMap, index: torch.Tensor, suffix: str) -> torch.Tensor:
    """The flat indices among ``index`` whose parameter's name ends with ``suffix``."""
    flat = index.reshape(-1)
    wanted = torch.tensor([n.endswith(suffix) for n in smap.param_names])
    return flat[wanted[_owner_ids(smap, flat)]]


def unrotated_columns(block: PairBlock) -> torch.Tensor:
    """Which of a pair's ``h`` columns its group leaves unrotated: all for GL(h), the pass-through columns of a
    partial RoPE (column ``j`` is unrotated iff the scaling ``E_jj`` lies in the Lie algebra of the group).

    Args:
        block: a pair block.

    Returns:
        A boolean mask of length ``h``.
    """
    h = block.head_dim
    if block.lie_basis is None:
        return torch.ones(h, dtype=torch.bool)
    q, _ = torch.linalg.qr(block.lie_basis.reshape(-1, h * h).T.to(torch.float64))
    diag = torch.arange(h) * (h + 1)  # E_jj's flat positions
    residual = 1.0 - q[diag].square().sum(1)  # |e - Q Q^T e|^2 for the unit vector e = E_jj
    return residual < 1e-9


def known_redundancies(smap: SymmetryMap) -> dict[str, torch.Tensor]:
    """Redundancies beyond the GL orbits implied by the map's structure: name -> the flat coordinates involved.

    * key bias: ``q . b_k`` is the same for every key, so softmax never sees ``b_k``; each coordinate is one
      redundant direction. Not so where RoPE rotates ``b_k`` differently per key (the rotated columns; a partial
      RoPE's pass-through columns stay invisible), or an extra key token (``add_bias_kv``) does not carry it.
    * value bias: softmax rows sum to 1, so ``b_v`` only adds the constant ``b_v W_O^T`` to the output, which the
      output bias can absorb; each coordinate is one redundant direction (when the output bias exists and values
      are neither rotated nor joined by an extra value token).

    Args:
        smap: the symmetry map.

    Returns:
        Name -> flat coordinates.
    """
    key_bias, value_bias = [], []
    names = set(smap.param_names)
    for block in smap.blocks:
        if block.kind == "qk" and not any(n.endswith("bias_k") for n in _owners(smap, block.H_index)):
            key_bias.append(_owned_by(smap, block.H_index[:, :, unrotated_columns(block)], "bias"))
        elif (block.kind == "vo" and block.lie_basis is None
              and not any(n.endswith("bias_v") for n in _owners(smap, block.G_index))):
            o_biases = {n[: -len("weight")] + "bias" for n in _owners(smap, block.H_index) if n.endswith("weight")}
            if o_biases & names:
                value_bias.append(_owned_by(smap, block.G_index, "bias"))
    out = {}
    for name, parts in (("key bias (invisible to softmax)", key_bias),
                        ("value bias (absorbed by the output bias)", value_bias)):
        if parts and sum(p.numel() for p in parts):
            out[name] = torch.cat(parts)
    return out


SKETCH_OVERSAMPLE = 16  # extra random probes: the sketch's rank then equals the Jacobian's with probability ~1
VJP_CHUNK = 32  # cotangents per vmap call: bounds the memory to ~32 backward passes at once


def sketch_jacobian(f: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor, *,
                    generator: torch.Generator, oversample: int = SKETCH_OVERSAMPLE, chunk: int = VJP_CHUNK,
                    on_first_chunk: Callable[[float, int], None] | None = None) -> tuple[torch.Tensor, int]:
    """``Psi^T J`` for the Jacobian ``J`` of ``f`` at ``theta`` and a Gaussian ``Psi`` (outputs x (n + oversample)).

    Matrix-free: one forward pass, then vector-Jacobian products in chunks, so the memory is the sketch
    (``(n + oversample) x n`` float64) plus ``chunk`` backward passes, never outputs x parameters. A Gaussian
    sketch keeps the rank: ``rank(Psi^T J) = rank(J)`` with probability 1 when ``Psi`` has at least ``rank(J)``
    columns. ``on_first_chunk(seconds, n_chunks)`` is called after the first chunk (for a time estimate).
    Returns the sketch and the number of outputs.
    """
    with warnings.catch_warnings():  # sdpa's backward has no vmap rule: a loop, correct, and fine at audit sizes
        warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
        return _sketch(f, theta, generator, oversample, chunk, on_first_chunk)


def _sketch(f: Callable[[torch.Tensor], torch.Tensor], theta: torch.Tensor, generator: torch.Generator,
            oversample: int, chunk: int, on_first_chunk: Callable[[float, int], None] | None
            ) -> tuple[torch.Tensor, int]:
    out, pullback = vjp(f, theta)
    n, rows = theta.numel(), out.numel()
    m = n + oversample
    sketch = torch.empty(m, n, dtype=torch.float64)
    batched = vmap(pullback)
    n_chunks = -(-m // chunk)
    for i, start in enumerate(range(0, m, chunk)):
        t0 = time.perf_counter()
        size = min(chunk, m - start)
        psi = torch.randn(size, rows, generator=generator, dtype=out.dtype).view(size, *out.shape)
        (grads,) = batched(psi)
        sketch[start:start + size] = grads.reshape(size, n).to(torch.float64)
        if i == 0 and on_first_chunk is not None:
            on_first_chunk(time.perf_counter() - t0, n_chunks)
    return sketch, rows


def jacobian_rank_audit(
    model: nn.Module,
    smap: SymmetryMap | None = None,
    *,
    inputs: InputFn | None = None,
    output: Callable[[Any], torch.Tensor] = _first_tensor,
    n_draws: int = 3,
    oversample: float = 1.5,
    rtol: float | None = None,
    max_params: int = MAX_AUDIT_PARAMS,
    seed: int = 0,
) -> AuditResult:
    """Numerical rank of d(output)/d(parameters) on random inputs, against the map's predicted dimension.

    Args:
        model: a tiny model (the sketch of the Jacobian is dense: about n_params x n_params, in float64).
        smap: its symmetry map; default ``map_symmetries(model)``.
        inputs: ``inputs(generator, n_tokens) -> kwargs`` for ``model(**kwargs)``; default :func:`random_inputs`.
        output: picks the tensor to differentiate from the model's outputs (default: the first tensor).
        n_draws: independent input draws; the rank is the maximum over them.
        oversample: draw enough tokens for about ``oversample * n_params`` outputs per draw.
        rtol: singular values below ``rtol * largest`` count as zero; default numpy's ``matrix_rank`` tolerance,
            ``largest * max(sketch shape) * eps`` (see :mod:`hf_geosharp.symmetry.audit_rank`).
        max_params: refuse bigger models (the audit is quadratic in memory, cubic in time).
        seed: seed of the inputs.

    Returns:
        The :class:`AuditResult`: the numerical rank, the predicted dimension and whether they agree.
    """
    smap = map_symmetries(model) if smap is None else smap
    params = parameters_in_order(model, smap)
    n_params = smap.n_params
    if n_params > max_params:
        raise ValueError(f"the dimension audit is for tiny models: {n_params:,} parameters > max_params={max_params:,}."
                         " Build a tiny config of the same architecture (1 layer, hidden 16) and audit that.")
    inputs = random_inputs(model) if inputs is None else inputs
    if any(p.dtype != torch.float64 for p in params):
        raise ValueError("the dimension audit needs a float64 model (numerical rank near float64 round-off): audit "
                         "copy.deepcopy(model).double(), or use `geosharp symmetry MODEL --audit`.")
    low = lower_precision_ops(model, kwargs=inputs(torch.Generator().manual_seed(seed), 1))
    if low:  # e.g. a decoder's RMSNorm in float32: no verdict rests on it here, so a warning, not a refusal
        logger.warning("%s computes below float64 (%s): singular values near float32 round-off may count in the "
                       "rank", type(model).__name__, ", ".join(low))
    theta = flat_vector(params).to(params[0].dtype)
    names, shapes = smap.param_names, [tuple(s) for s in smap.param_shapes]
    sizes = [math.prod(s) for s in shapes]

    n_tokens = 1  # grow the input until one draw has about ``oversample * n_params`` outputs
    with torch.no_grad():
        while output(model(**inputs(torch.Generator().manual_seed(seed), n_tokens))).numel() < oversample * n_params:
            n_tokens *= 2

    generator = torch.Generator().manual_seed(seed)
    ranks, active = [], torch.zeros(n_params, dtype=torch.bool)
    for _ in range(n_draws):
        kwargs = inputs(generator, n_tokens)

        def f(flat: torch.Tensor, kwargs: dict[str, Any] = kwargs) -> torch.Tensor:
            tensors = {n: t.view(s) for n, t, s in zip(names, flat.split(sizes), shapes)}
            return output(functional_call(model, tensors, args=(), kwargs=kwargs)).reshape(-1)

        sketch, n_outputs = sketch_jacobian(f, theta, generator=generator)
        col_norms = sketch.norm(dim=0)
        active |= col_norms > 1e-12 * col_norms.max()
        sv = torch.linalg.svdvals(sketch)
        ranks.append(numerical_rank(sv, rtol, tuple(sketch.shape)))
        logger.debug("audit draw: sketch %s of %d outputs, rank %d", tuple(sketch.shape), n_outputs, ranks[-1])
    redundancies = known_redundancies(smap)
    explained = torch.zeros(n_params, dtype=torch.bool)
    for coords in redundancies.values():
        explained[coords] = True
    inactive = (~active & ~explained).nonzero().reshape(-1)  # the key bias is inactive too, but already named
    orbit_dim = sum(b.n_pairs * b.group_dim for b in smap.blocks)
    dims = {name: int(coords.numel()) for name, coords in redundancies.items()}
    predicted = n_params - int(inactive.numel()) - orbit_dim - sum(dims.values())
    rank = max(ranks)
    return AuditResult(n_params, n_outputs, ranks, rank, int(inactive.numel()),
                       sorted(_owners(smap, inactive)) if inactive.numel() else [], orbit_dim, n_params - orbit_dim,
                       dims, predicted, predicted - rank)
