"""One start of Auto-PGD with its bookkeeping on the device: the host never waits for the device inside a step.

A step's inner products, step size, momentum coefficients, the best point's bookkeeping (which row holds it, its
loss, squared norm and Frank-Wolfe gap), the halving rule's count of improvements and ``steps="auto"``'s stopping
test are 0-dim float64 tensors on the vectors' device, computed with the operations, in the order, of the host
reference (:class:`.climb.Climb`), so they are the same float64 numbers and every comparison decides the same way.
The host reads them once per check: at each step-size checkpoint (where it halves and restarts), at the end of a
block, and under ``steps="auto"`` at least every :data:`CHECK_STEPS` steps; there it records the losses, checks
that they are finite and calls ``on_step``.

Where the best point sits is a device index (:data:`AT_X`, :data:`AT_P`, :data:`AT_B`): the new iterate is
combined over the previous one, whose row is first copied into the best point's row where it holds the best
point (a masked copy, one pass). A start that stops between two checks (``steps="auto"``) freezes its best point,
and the host drops the losses of the steps it ran past the stop (at most ``CHECK_STEPS - 1`` model calls)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..checks import non_finite_loss
from .certificate import PRECISION_FACTOR
from .climb import Best, Climb
from .schedule import StepSchedule

#: Under ``steps="auto"``, the most steps between two reads of the device's state (a start that stops in between
#: runs on, its best point frozen, until the read).
CHECK_STEPS = 5
#: Where the best point sits: the iterate's row, the previous iterate's row, or the best point's own row.
AT_X, AT_P, AT_B = 0, 1, 2


@dataclass
class _Rows:
    """The rows of the pool that the climb's roles name: iterate, previous iterate (the same row after a start or a
    restart), the best point's row (the same as both after a restart), and whether the iterate is known to be 0."""

    x: Tensor
    p: Tensor
    b: Tensor
    zero_x: bool

    def at(self, where: int) -> Tensor:
        """The row that holds the best point, where it is ``where``."""
        return (self.x, self.p, self.b)[where]


@dataclass
class _State:
    """The climb's state on the device: ``||xi||^2``, ``||xi_prev||^2``, ``<xi, xi_prev>``, the best point's loss,
    squared norm and gap (float64), where it sits, the improvements since the last checkpoint, and under auto
    whether (and at which step) the start stopped."""

    sq: Tensor
    sq_prev: Tensor
    cross: Tensor
    best_loss: Tensor
    best_sq: Tensor
    best_gap: Tensor
    at: Tensor
    updates: Tensor
    done: Tensor
    stop: Tensor


@dataclass
class _Read:
    """What a check reads of :class:`_State`."""

    best_loss: float
    best_sq: float
    best_gap: float
    at: int
    updates: int
    done: bool
    stop: int


class DeviceClimb(Climb):
    """Auto-PGD from one start at a time, its step free of host reads (see the module's docstring)."""

    def __init__(self, *args: Any, compile_backend: str | None = None, **kwargs: Any) -> None:
        """As :class:`.climb.Climb`; with ``compile_backend`` (a ``torch.compile`` backend: ``"inductor"``, or
        ``"aot_eager"`` to check the capture on a CPU) the step's scalar updates run as captured graphs
        (``fullgraph=True``): a few fused kernels instead of about a hundred tiny ones."""
        super().__init__(*args, **kwargs)
        self.clean = torch.full((), self.clean_loss, dtype=torch.float64, device=self.work.device)
        self.scalars: Callable[..., tuple[Tensor, ...]] = _step_scalars
        self.book: Callable[..., tuple[Tensor, ...]] = _bookkeep
        if compile_backend is not None:
            self.scalars = torch.compile(_step_scalars, fullgraph=True, backend=compile_backend)
            self.book = torch.compile(_bookkeep, fullgraph=True, backend=compile_backend)

    def run(self, xi: Tensor, sq_xi: float, loss: float, egrad: Tensor | None, *, steps: int, budget: int,
            auto: bool) -> Best:
        """As :meth:`.climb.Climb.run`: the best point found, with its gap."""
        rows = _Rows(xi, xi, xi, sq_xi == 0.0)
        state = self.state(sq_xi, loss)
        schedule = StepSchedule(2.0 * self.rho, steps, self.min_update_ratio, loss)
        if steps <= 0:
            return self.finish(rows, _Read(loss, sq_xi, math.nan, AT_X, 0, False, 0), egrad)
        pending: list[Tensor] = []
        total, k, last = steps, 0, -1
        while True:
            self.step(rows, state, egrad, schedule.eta, k, auto)
            value, egrad = self.objective(rows.x, auto or k < total - 1, out=self.work)
            pending.append(self.bookkeep(state, value))
            if not (k in schedule.checkpoints or k == total - 1 or (auto and k - last >= CHECK_STEPS)):
                k += 1
                continue
            read = self.check(state, pending, k)
            pending, last = [], k
            if read.done:
                return Best(rows.at(read.at), read.best_loss, read.best_sq, read.best_gap)
            schedule.n_updates += read.updates
            if schedule.halve(k, read.best_loss):
                egrad = self.restart(rows, state, read, egrad)
            if auto and k == total - 1 and total < budget:  # one more block, from the best point
                block = min(total, budget - total)
                schedule.extend(total, block, eta=2.0 * self.rho)
                total += block
                egrad = self.restart(rows, state, read, egrad)
            if k == total - 1:
                break
            k += 1
        return self.finish(rows, read, egrad)

    def state(self, sq_xi: float, loss: float) -> _State:
        """The device state at a start's first point (its best point so far)."""
        f64 = dict(dtype=torch.float64, device=self.work.device)
        scalar = torch.full((6,), sq_xi, **f64).unbind(0)
        scalar[3].fill_(loss)
        scalar[5].fill_(math.nan)
        counts = torch.zeros((3,), dtype=torch.int64, device=self.work.device).unbind(0)
        return _State(*scalar, counts[0], counts[1], counts[2].bool(), counts[2])

    def step(self, rows: _Rows, state: _State, egrad: Tensor | None, eta: float, k: int, auto: bool) -> None:
        """Step ``k`` from ``rows.x``: its direction (consuming the gradient), the best point's gap where the iterate
        is the best point (and under ``auto`` whether to stop there), and the next iterate in its row."""
        if egrad is None:  # after a restart from an earlier best point
            egrad = self.best_gradient(rows.b)
        if self.keep_best_gradient:  # the gradient at the best point, for a restart from it
            kept = self.kept_gradient()
            torch.where(state.at == AT_X, egrad, kept, out=kept)
        grad_norm = None
        if self.step_normalization == "euclidean":  # read before the direction consumes the gradient
            grad_norm = torch.dot(egrad, egrad).double().clamp_min(0.0).sqrt()
        sq_d, d_xi, d_prev = self.direction_sums(rows, state, egrad)
        device = dict(dtype=torch.float64, device=sq_d.device)
        gap, done, stop, a, b, g, sq_new, cross = self.scalars(
            state.sq, state.sq_prev, state.cross, state.best_loss, state.best_sq, state.best_gap, state.at,
            state.done, state.stop, sq_d, d_xi, d_prev, grad_norm, torch.full((), eta, **device),
            torch.full((), k, dtype=torch.int64, device=sq_d.device), self.clean, first=k == 0, auto=auto,
            normalization=self.step_normalization, rho=self.rho, momentum=self.momentum, tol=self.tol,
            start_stop=self.start_stop, slope_stop=self.slope_stop,
            floor_eps=PRECISION_FACTOR * torch.finfo(getattr(torch, self.dtype)).eps)
        state.best_gap.copy_(gap)
        state.done.copy_(done)
        state.stop.copy_(stop)
        self.advance_on_device(rows, state, (a, b, None if k == 0 else g), sq_new, cross)

    def direction_sums(self, rows: _Rows, state: _State, egrad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """The direction into the working row, and ``<d, d>``, ``<d, xi>``, ``<d, xi_prev>`` (0 for a zero row)."""
        known = [rows.x] if not rows.zero_x else []
        if rows.p is not rows.x:
            known.append(rows.p)
        vectors = self.pool.stacked(known)
        if getattr(self.space, "sums_on_device", False):
            _, sq_d, products = self.space.ascent_direction(egrad, vectors, out=self.work, host=False)
        else:  # a space that answers on the host
            _, square, listed = self.space.ascent_direction(egrad, vectors, out=self.work)
            sq_d, products = (torch.tensor(v, dtype=torch.float64, device=self.work.device) for v in (square, listed))
        sq_d, products = sq_d.double(), products.double()
        positions = sorted({self.pool.position(row) for row in known})  # stacked() order
        zero = sq_d.new_zeros(())

        def product(row: Tensor, sq: Tensor) -> Tensor:
            if row is rows.x and rows.zero_x:
                return zero
            return torch.where(sq > 0, products[positions.index(self.pool.position(row))], 0.0)

        return sq_d, product(rows.x, state.sq), product(rows.p, state.sq_prev)

    def advance_on_device(self, rows: _Rows, state: _State, coefs: tuple[Tensor, Tensor, Tensor | None],
                          sq_new: Tensor, new_cross: Tensor) -> None:
        """Write the next iterate ``a xi + b d + g xi_prev`` (``g`` None at step 0) into the previous iterate's row
        (its best point moved to the best row first), or, where that row is the iterate's, into a free row; rotate
        the roles."""
        a, b, g = coefs
        terms = [(a, rows.x), (b, self.work)]
        if rows.p is not rows.x:  # combine over xi_prev, its best point (if it is) moved to the best row first
            if rows.b is rows.p:  # (the row of a start or a restart): the best row moves to a free one
                state.at.copy_(torch.where(state.at == AT_B, AT_P, state.at))
                rows.b = self.pool.free(rows.x, rows.p, self.work)
            torch.where(state.at == AT_P, rows.p, rows.b, out=rows.b)
            state.at.copy_(torch.where(state.at == AT_X, AT_P, AT_B))
            new, scale = rows.p, g
        else:  # xi_prev is xi: into a free row
            new, scale = self.pool.free(rows.x, rows.b, self.work), None
            if g is not None:
                terms.append((g, rows.p))
            state.at.copy_(torch.where(state.at == AT_X, AT_P, state.at))
        self.pool.combine_on_device(new, scale, terms)
        rows.p, rows.x, rows.zero_x = rows.x, new, False
        state.sq_prev.copy_(state.sq)
        state.sq.copy_(sq_new)
        state.cross.copy_(new_cross)

    def bookkeep(self, state: _State, value: Tensor | float) -> Tensor:
        """Take the loss at the new iterate: the best point moves there where it is higher (unless stopped)."""
        loss = value.detach().double() if isinstance(value, Tensor) else state.sq.new_tensor(value)
        updated = self.book(loss, state.sq, state.best_loss, state.best_sq, state.best_gap, state.at, state.updates,
                            state.done)
        for target, new in zip((state.best_loss, state.best_sq, state.best_gap, state.at, state.updates), updated):
            target.copy_(new)
        return loss

    def check(self, state: _State, pending: list[Tensor], k: int) -> _Read:
        """Read the state and the losses of the steps since the last check (one read); record the losses of the
        steps before a stop, refused where one is not finite."""
        scalars = [state.best_loss, state.best_sq, state.best_gap, state.at, state.updates, state.done, state.stop]
        values = torch.cat([torch.stack(pending), torch.stack([s.double() for s in scalars])]).tolist()
        losses, tail = values[: len(pending)], values[len(pending):]
        read = _Read(tail[0], tail[1], tail[2], int(tail[3]), int(tail[4]), bool(tail[5]), int(tail[6]))
        state.updates.zero_()  # counted again from this check
        first = k - len(pending) + 1
        for i, loss in enumerate(losses):
            if read.done and first + i >= read.stop:
                break
            if not math.isfinite(loss):
                raise non_finite_loss(loss, self.rho)
            self.record(loss)
        return read

    def restart(self, rows: _Rows, state: _State, read: _Read, egrad: Tensor | None) -> Tensor | None:
        """Continue from the best point (its gradient is taken, or copied, when the next step needs it)."""
        row = rows.at(read.at)
        if row is not rows.x:
            egrad = None
        rows.x = rows.p = rows.b = row
        rows.zero_x = read.best_sq == 0.0
        state.at.fill_(AT_X)
        for target in (state.sq, state.sq_prev, state.cross):
            target.copy_(state.best_sq)
        return egrad

    def finish(self, rows: _Rows, read: _Read, egrad: Tensor | None) -> Best:
        """The best point after the last step, with its gap (one more gradient where it is not known yet)."""
        best = Best(rows.at(read.at), read.best_loss, read.best_sq, read.best_gap)
        if math.isnan(best.gap):
            if egrad is None or best.row is not rows.x:  # (kept only once a step began at the best point)
                egrad = self.best_gradient(best.row, kept=read.at != AT_X)
            _, sq_d, products = self.space.ascent_direction(
                egrad, self.pool.stacked([best.row] if best.sq > 0 else []), out=self.work)
            best.gap = self.gap(best, sq_d, products[0] if best.sq > 0 else 0.0)
        return best

    def kept_gradient(self) -> Tensor:
        """The buffer that holds the best point's gradient (a fifth vector, allocated once)."""
        if self.kept is None:
            self.kept = (Best(self.work, math.nan, math.nan), self.space.empty())
        return self.kept[1]

    def best_gradient(self, row: Tensor, kept: bool = True) -> Tensor:
        """The gradient at the best point (in ``row``) in the working row: the kept copy (where ``kept``: a step
        began at the best point, and copied its gradient), or one more forward and backward."""
        if self.keep_best_gradient and kept:
            return self.work.copy_(self.kept_gradient())
        return self.objective(row, True, out=self.work)[1]


def _over(number: float, tensor: Tensor) -> Tensor:
    """``number / tensor``, rounded once as the host divides (``number / tensor`` in torch multiplies by the
    reciprocal, rounded twice)."""
    return torch.full_like(tensor, number).div_(tensor)


def _step_scalars(sq: Tensor, sq_prev: Tensor, cross: Tensor, best_loss: Tensor, best_sq: Tensor, best_gap: Tensor,
                  at: Tensor, done: Tensor, stop: Tensor, sq_d: Tensor, d_xi: Tensor, d_prev: Tensor,
                  grad_norm: Tensor | None, eta: Tensor, k: Tensor, clean: Tensor, *, first: bool, auto: bool,
                  normalization: str, rho: float, momentum: float, tol: float, start_stop: float, slope_stop: float,
                  floor_eps: float) -> tuple[Tensor, ...]:
    """A step's scalars from its direction's Gram entries, as the host reference computes them: the best point's
    gap (where the iterate is the best point), under ``auto`` whether the start stops there (and at step ``k``),
    and the coefficients ``(a, b, g)`` of the next iterate with its squared norm and its product with the iterate.
    A pure function of tensors (``torch.compile(fullgraph=True)`` captures it)."""
    sharpness = best_loss - clean
    live = (at == AT_X) & ~done
    best_gap = torch.where(live, _relative_gap(rho, sq_d, d_xi, sharpness), best_gap)
    if auto:  # Climb.stationary_enough at the best point (the iterate)
        tangential = torch.where(best_sq > 0, sq_d - d_xi * d_xi / best_sq, sq_d)
        slope = torch.where(sharpness > 0, rho * tangential.clamp_min(0.0).sqrt() / sharpness, math.inf)
        scaled = slope * slope_stop
        measure = torch.where(scaled > best_gap, scaled, best_gap)
        floor = floor_eps * best_loss.abs().clamp_min(clean.abs())
        halt = live & ((measure <= tol * start_stop) | ((sharpness > 0) & (measure * sharpness <= start_stop * floor)))
        stop = torch.where(halt, k, stop)
        done = done | halt
    c = eta
    if normalization == "riemannian":
        c = eta / (sq_d.sqrt() + 1e-12)
    elif normalization == "euclidean":
        c = eta / (grad_norm + 1e-12)
    a, b, g, sq_new = _momentum(first, c, rho, momentum, sq, sq_d, sq_prev, d_xi, d_prev, cross)
    new_cross = a * sq + b * d_xi + g * cross  # <xi_new, xi>
    a = torch.where(sq > 0, a, 0.0)
    g = torch.where(sq_prev > 0, g, 0.0)
    return best_gap, done, stop, a, b, g, sq_new, new_cross


def _bookkeep(loss: Tensor, sq: Tensor, best_loss: Tensor, best_sq: Tensor, best_gap: Tensor, at: Tensor,
              updates: Tensor, done: Tensor) -> tuple[Tensor, ...]:
    """The best point after the loss at the new iterate (it moves there where the loss is higher, unless stopped),
    and the count of improvements. A pure function of tensors."""
    better = (loss > best_loss) & ~done
    return (torch.where(better, loss, best_loss), torch.where(better, sq, best_sq),
            torch.where(better, math.nan, best_gap), torch.where(better, AT_X, at), updates + better)


def _relative_gap(rho: float, sq_d: Tensor, d_xi: Tensor, sharpness: Tensor) -> Tensor:
    """:func:`.certificate.relative_gap` on the device."""
    gap = (rho * sq_d.clamp_min(0.0).sqrt() - d_xi).clamp_min(0.0)
    return torch.where(gap == 0, 0.0, torch.where(sharpness > 0, gap / sharpness, math.inf))


def _momentum(first: bool, c: Tensor, rho: float, momentum: float, sq_xi: Tensor, sq_d: Tensor, sq_prev: Tensor,
              d_xi: Tensor, d_prev: Tensor, cross: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """:func:`.climb._momentum_step` on the device (the same operations in the same order; ``first``: step 0)."""
    sq_z = (sq_xi + 2 * c * d_xi + c * c * sq_d).clamp_min(0.0)
    s1 = torch.where(sq_z > rho * rho, _over(rho, sq_z.sqrt()), 1.0)
    if first:
        return s1, s1 * c, torch.zeros_like(s1), s1 * s1 * sq_z
    a, b, g = 2 * (1 - momentum) + momentum * s1, momentum * s1 * c, -(1 - momentum)
    sq_y = (a * a * sq_xi + b * b * sq_d + g * g * sq_prev + 2 * (a * b * d_xi + a * g * cross + b * g * d_prev)
            ).clamp_min(0.0)
    s2 = torch.where(sq_y > rho * rho, _over(rho, sq_y.sqrt()), 1.0)
    return s2 * a, s2 * b, s2 * g, s2 * s2 * sq_y
