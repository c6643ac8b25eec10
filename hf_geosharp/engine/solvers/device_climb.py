"""One start of Auto-PGD with its bookkeeping on the device: the host never waits for the device inside a step.

The climb's state is one float64 vector on the vectors' device (the lanes below): the iterate's and the previous
iterate's squared norms and product, the best point's loss and squared norm, the Gram entries its Frank-Wolfe gap
is computed from (NaN until the best point is an iterate that a step starts from), where the best point sits, and
under ``steps="auto"`` whether (and at which step) the start stopped. A step rebuilds the vector from a handful of
vector operations on its direction's Gram matrix (``(xi, d, xi_prev)``, 3 x 3): the step size, the two radial
projections and the next iterate's coefficients are quadratic forms of it, a few kernels whatever the model.

What decides is computed as the host reference (:class:`.climb.Climb`) computes it, on the same float64 numbers:
whether a loss is higher than the best (the loss itself), the best point's gap (from the same Gram entries, by
:func:`.certificate.relative_gap` on the host, at the check) and under ``steps="auto"`` the stopping test (the
reference's operations in its order). The coefficients of the next iterate are the reference's to rounding (a
quadratic form summed in another order).

The host reads the vector once per check: at each step-size checkpoint (where it halves and restarts), at the end
of a block, and under ``steps="auto"`` at least every :data:`CHECK_STEPS` steps; there it records the losses,
checks that they are finite, counts the improvements (the same comparisons again) and calls ``on_step``.

Where the best point sits is a device index (:data:`AT_X`, :data:`AT_P`, :data:`AT_B`): the new iterate is
combined over the previous one, whose row is first copied into the best point's row where it holds the best
point (a masked copy, one pass). On a CPU a mask is read on the host instead (:class:`HostMasks`): a read there
is a load from memory, not a wait for a device, and each masked pass over a vector becomes a copy or nothing; the
step's bandwidth, the CPU's bound, drops by two to four vector passes, with the same numbers bit for bit.

A start that stops between two checks (``steps="auto"``) freezes its best point, and the host drops the losses of
the steps it ran past the stop (at most ``CHECK_STEPS - 1`` model calls)."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from ..capture import compiled
from ..checks import non_finite_loss
from ..device_paths import host_paths
from .certificate import PRECISION_FACTOR, relative_gap
from .climb import Agreement, Best, Climb
from .interface import PendingFn
from .schedule import StepSchedule

#: Under ``steps="auto"``, the most steps between two reads of the device's state (a start that stops in between
#: runs on, its best point frozen, until the read).
CHECK_STEPS = 5
#: Where the best point sits: the iterate's row, the previous iterate's row, or the best point's own row.
AT_X, AT_P, AT_B = 0, 1, 2

#: The lanes of the state vector. ``SQ`` and ``SQ_PREV`` (``||xi||^2``, ``||xi_prev||^2``) sit at 2 and 4, with
#: ``||xi_prev||^2`` again at 0 and ones between them: one comparison ``state[:5] > 0`` gives the masks of the
#: products in either pool order (``[2::2]``, ``[0:3:2]``) and of the coefficients (``[2:5]``). ``ONE_C, ETA,
#: ZERO_C`` are the numerators of the step sizes ``(1, c, 0)`` of ``(xi, d, xi_prev)``. The best point's Gram
#: entries are ``<d, xi>, <d, d>`` at the step that started from it. ``AGREE_LOW, AGREE_HIGH``: a checking start's
#: agreement window (:class:`.climb.Agreement`; empty, ``[inf, -inf]``, for a first start).
PREV_A, ONE_A, SQ, ONE_B, SQ_PREV, CROSS, BEST_LOSS, BEST_SQ, BEST_DXI, BEST_SQD, AT, DONE, STOP, STEP, ONE_C, ETA, \
    ZERO_C, AGREE_LOW, AGREE_HIGH = range(19)
LANES = 19
#: The constants' vector: the momentum's base coefficients (3), 0, 1, 2, NaN, the step-size denominators' offsets,
#: the clean loss (a value of the batch, so a tensor: a graph would be traced again for every batch's constant).
_BASE, _ZERO, _ONE, _TWO, _NAN, _OFFSET, _CLEAN = slice(0, 3), 1, 3, 4, 5, slice(6, 9), 9


class DeviceMasks:
    """Masked copies as device selections (``torch.where``): the host never reads a mask (a GPU's step)."""

    def select(self, mask: Tensor, a: Tensor, b: Tensor, out: Tensor) -> None:
        """``out <- a`` where ``mask`` (0-dim bool) holds, else ``b``; ``out`` is ``a`` or ``b``."""
        torch.where(mask, a, b, out=out)


class HostMasks(DeviceMasks):
    """Masked copies decided on the host: the mask is read, and ``out`` receives one vector, or nothing when it
    holds that one already. Where reading costs no wait (a CPU), this spares the passes of a selection."""

    def select(self, mask: Tensor, a: Tensor, b: Tensor, out: Tensor) -> None:
        """As :meth:`DeviceMasks.select`, one copy at most."""
        src = a if bool(mask) else b
        if src is not out:
            out.copy_(src)


def masks_for(device: torch.device) -> DeviceMasks:
    """How a climb on ``device`` makes its masked copies: on the host where reading a mask is free (a CPU), else on
    the device (always inside :func:`~hf_geosharp.engine.device_paths.gpu_paths`)."""
    return HostMasks() if host_paths(device) else DeviceMasks()


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
    """The climb's state on the device (a float64 vector of :data:`LANES`, replaced by each update), the step size
    it holds, and the best loss the host read last (where its count of improvements starts)."""

    vec: Tensor
    eta: float
    best_read: float


@dataclass
class _Read:
    """What a check reads of the state."""

    best_loss: float
    best_sq: float
    best_gap: float
    at: int
    updates: int
    done: bool
    stop: int


class DeviceClimb(Climb):
    """Auto-PGD from one start at a time, its step free of host reads (see the module's docstring)."""

    def __init__(self, *args: Any, compile_backend: str | None = None, pending: PendingFn | None = None,
                 **kwargs: Any) -> None:
        """As :class:`.climb.Climb`; with ``compile_backend`` (a ``torch.compile`` backend: ``"inductor"``, or
        ``"aot_eager"`` to check the capture on a CPU) the step's state updates run as captured graphs
        (``fullgraph=True``); with ``pending`` (the objective with its gradient left pending,
        :meth:`~hf_geosharp.engine.model_function.objective.Objective.pending`) the last iterate of a fixed-step
        climb takes its gradient only where it is the best point (:meth:`last_point`)."""
        super().__init__(*args, **kwargs)
        self.pending = pending
        self.masks = masks_for(self.work.device)
        m = self.momentum
        self.constants = _filled([2 * (1 - m), 0.0, -(1 - m), 1.0, 2.0, math.nan, 0.0, 1e-12, 0.0, self.clean_loss],
                                 self.work.device)
        self.scalars: Callable[..., tuple[Tensor, Tensor]] = _step_state
        self.book: Callable[..., Tensor] = _bookkeep
        self.book_pending: Callable[..., Tensor] = _bookkeep  # inside the objective's row-lookup mode
        if compile_backend is not None:
            self.scalars = _Captured(_step_state, compile_backend, shared=True)
            self.book = _Captured(_bookkeep, compile_backend, shared=True)
            self.book_pending = _Captured(_bookkeep, compile_backend, shared=False)

    def run(self, xi: Tensor, sq_xi: float, loss: float, egrad: Tensor | None, *, steps: int, budget: int,
            auto: bool, agreement: Agreement | None = None) -> Best:
        """As :meth:`.climb.Climb.run`: the best point found, with its gap."""
        rows = _Rows(xi, xi, xi, sq_xi == 0.0)
        schedule = StepSchedule(2.0 * self.rho, steps, self.min_update_ratio, loss)
        state = self.state(sq_xi, loss, schedule.eta, agreement)
        if steps <= 0:
            return self.finish(rows, _Read(loss, sq_xi, math.nan, AT_X, 0, False, 0), egrad)
        pending: list[Tensor] = []
        total, k, last, block_start, stalled = steps, 0, -1, loss, False
        while True:
            self.step(rows, state, egrad, k, auto, stalled)
            stalled = False
            if not auto and k == total - 1 and self.pending is not None:  # the last iterate: its gradient if best
                read, egrad = self.last_point(rows, state, pending, k)
            else:
                value, egrad = self.objective(rows.x, auto or k < total - 1, out=self.work)
                pending.append(self.bookkeep(state, value, auto))
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
                stalled, block_start = self.stalled(read.best_loss, block_start), read.best_loss
                block = min(total, budget - total)
                schedule.extend(total, block, eta=2.0 * self.rho)
                total += block
                egrad = self.restart(rows, state, read, egrad)
            if k == total - 1:
                break
            if schedule.eta != state.eta:
                state.eta = schedule.eta
                state.vec[ETA].fill_(state.eta)
            k += 1
        return self.finish(rows, read, egrad)

    def last_point(self, rows: _Rows, state: _State, pending: list[Tensor], k: int) -> tuple[_Read, Tensor | None]:
        """The last step of a fixed-step climb: the iterate's loss, checked with its forward's graph kept, and its
        gradient (in the working row) taken from that graph only where the iterate is the best point, whose gap
        :meth:`finish` needs: one forward and backward there instead of a forward and then both again."""
        with self.pending(rows.x, self.work) as (value, take):
            pending.append(self.bookkeep(state, value, False, self.book_pending))
            read = self.check(state, pending, k)
            at_x = read.at == AT_X
            if at_x:
                take()
        return read, self.work if at_x else None

    def state(self, sq_xi: float, loss: float, eta: float, agreement: Agreement | None = None) -> _State:
        """The device state at a start's first point (its best point so far), with a checking start's
        ``agreement`` window."""
        window = (agreement.low, agreement.high) if agreement is not None else (math.inf, -math.inf)
        vec = torch.zeros((LANES,), dtype=torch.float64, device=self.work.device)
        for lanes, value in ((slice(PREV_A, SQ_PREV + 1, 2), sq_xi), (slice(ONE_A, ONE_B + 1, 2), 1.0),
                             (slice(CROSS, CROSS + 1), sq_xi), (slice(BEST_LOSS, BEST_LOSS + 1), loss),
                             (slice(BEST_SQ, BEST_SQ + 1), sq_xi), (slice(BEST_DXI, BEST_SQD + 1), math.nan),
                             (slice(ONE_C, ONE_C + 1), 1.0), (slice(ETA, ETA + 1), eta),
                             (slice(AGREE_LOW, AGREE_LOW + 1), window[0]),
                             (slice(AGREE_HIGH, AGREE_HIGH + 1), window[1])):
            vec[lanes].fill_(value)
        return _State(vec, eta, loss)

    def step(self, rows: _Rows, state: _State, egrad: Tensor | None, k: int, auto: bool, stalled: bool = False
             ) -> None:
        """Step ``k`` from ``rows.x``: its direction (consuming the gradient), the best point's Gram entries where
        the iterate is the best point (and under ``auto`` whether to stop there; ``stalled``: the first step after a
        block that stalled, :meth:`.climb.Climb.stop_fractions`), and the next iterate in its row."""
        start_stop, slope_stop = self.stop_fractions(stalled)
        if egrad is None:  # after a restart from an earlier best point
            egrad = self.best_gradient(rows.b)
        at_x = state.vec[AT] == AT_X
        if self.keep_best_gradient:  # the gradient at the best point, for a restart from it
            kept = self.kept_gradient()
            self.masks.select(at_x, egrad, kept, out=kept)
        scale_sq = None
        if self.step_normalization == "euclidean":  # read before the direction consumes the gradient
            scale_sq = torch.dot(egrad, egrad).double().clamp_min(0.0)
        sq_d, products, order = self.direction_sums(rows, egrad)
        case = "C" if rows.p is rows.x else "A" if rows.b is rows.p else "B"
        at_p = state.vec[AT] == AT_P if case == "B" else None  # (before the step moves the best point's index)
        state.vec, coefs = self.scalars(
            state.vec, self.constants, at_x, sq_d, products, scale_sq, order=order, case=case, first=k == 0,
            auto=auto, normalization=self.step_normalization, rho=self.rho, momentum=self.momentum, tol=self.tol,
            start_stop=start_stop, slope_stop=slope_stop,
            floor_eps=PRECISION_FACTOR * torch.finfo(getattr(torch, self.dtype)).eps)
        self.advance_on_device(rows, at_x if at_p is None else at_p, case, coefs.unbind(0), first=k == 0)

    def direction_sums(self, rows: _Rows, egrad: Tensor) -> tuple[Tensor, Tensor, str]:
        """The direction into the working row, ``<d, d>`` and the products ``<d, v>`` with the rows it is taken
        against (pool order), and which rows those are: ``""`` none, ``"x"`` the iterate (the previous one is the
        same row), ``"p"`` the previous iterate (the iterate is 0), ``"xp"`` or ``"px"`` both."""
        known = [rows.x] if not rows.zero_x else []
        if rows.p is not rows.x:
            known.append(rows.p)
        vectors = self.pool.stacked(known)
        if getattr(self.space, "sums_on_device", False):
            _, sq_d, products = self.space.ascent_direction(egrad, vectors, out=self.work, host=False)
        else:  # a space that answers on the host
            _, square, listed = self.space.ascent_direction(egrad, vectors, out=self.work)
            sq_d, products = (torch.tensor(v, dtype=torch.float64, device=self.work.device) for v in (square, listed))
        if len(known) == 2:
            order = "xp" if self.pool.position(rows.x) < self.pool.position(rows.p) else "px"
        else:
            order = "" if not known else "x" if known[0] is rows.x else "p"
        return sq_d.double(), products.double(), order

    def advance_on_device(self, rows: _Rows, at: Tensor, case: str, coefs: tuple[Tensor, ...], first: bool) -> None:
        """Write the next iterate ``a xi + b d + g xi_prev`` (no ``g`` at step 0) into the previous iterate's row
        (its best point moved to the best row first), or, where that row is the iterate's (``case`` C), into a free
        row; rotate the roles. ``at``, before the step: whether the best point is the iterate (cases A and C), or
        the previous iterate (case B)."""
        a, b, g = coefs
        terms = [(a, rows.x), (b, self.work)]
        if case != "C":  # combine over xi_prev, its best point (if it is) moved to the best row first
            if case == "A":  # (the row of a start or a restart): the best row moves to a free one
                rows.b = self.pool.free(rows.x, rows.p, self.work)
                self.masks.select(at, rows.b, rows.p, out=rows.b)  # unless at the iterate, the best point is at p
            else:
                self.masks.select(at, rows.p, rows.b, out=rows.b)
            new, scale = rows.p, g
        else:  # xi_prev is xi: into a free row
            new, scale = self.pool.free(rows.x, rows.b, self.work), None
            if not first:
                terms.append((g, rows.p))
        self.pool.combine_on_device(new, scale, terms)
        rows.p, rows.x, rows.zero_x = rows.x, new, False

    def bookkeep(self, state: _State, value: Tensor | float, auto: bool,
                 book: Callable[..., Tensor] | None = None) -> Tensor:
        """Take the loss at the new iterate: the best point moves there where it is higher (unless stopped);
        ``book``: the captured bookkeeping to use (default :attr:`book`)."""
        loss = value.detach().double() if isinstance(value, Tensor) else state.vec.new_full((), value)
        state.vec = (book or self.book)(state.vec, self.constants, loss, auto=auto)
        return loss

    def check(self, state: _State, pending: list[Tensor], k: int) -> _Read:
        """Read the state and the losses of the steps since the last check (one read); record the losses of the
        steps before a stop, refused where one is not finite, and count those that improved on the best."""
        values = torch.cat([state.vec, *(loss.reshape(1) for loss in pending)]).tolist()
        s, losses = values[:LANES], values[LANES:]
        done, stop = s[DONE] != 0.0, int(s[STOP])
        gap = math.nan if math.isnan(s[BEST_SQD]) else relative_gap(self.rho, s[BEST_SQD], s[BEST_DXI],
                                                                    s[BEST_LOSS] - self.clean_loss)
        first, updates, best = k - len(pending) + 1, 0, state.best_read
        for i, loss in enumerate(losses):
            if done and first + i >= stop:
                break
            if not math.isfinite(loss):
                raise non_finite_loss(loss, self.rho)
            self.record(loss)
            if loss > best:  # the device's comparison, on the same numbers
                updates, best = updates + 1, loss
        state.best_read = s[BEST_LOSS]
        return _Read(s[BEST_LOSS], s[BEST_SQ], gap, int(s[AT]), updates, done, stop)

    def restart(self, rows: _Rows, state: _State, read: _Read, egrad: Tensor | None) -> Tensor | None:
        """Continue from the best point (its gradient is taken, or copied, when the next step needs it)."""
        row = rows.at(read.at)
        if row is not rows.x:
            egrad = None
        rows.x = rows.p = rows.b = row
        rows.zero_x = read.best_sq == 0.0
        vec = state.vec
        vec[PREV_A:SQ_PREV + 1:2].fill_(read.best_sq)  # (the host's copy of the device's number)
        vec[CROSS].fill_(read.best_sq)
        vec[AT].fill_(AT_X)
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


class _Captured:
    """``fn`` under ``torch.compile(fullgraph=True)``, one graph per value of its keyword (static) arguments, each
    from its own copy of the code (:func:`~hf_geosharp.engine.capture.compiled`: dynamo counts recompilations per
    code object, and a step's paths are a dozen). ``shared``: the copy serves every climb with the same static
    values (the process traces each path once); else this climb owns it, for calls inside the objective's
    ``TorchFunctionMode`` (the embedding rows), whose graphs dynamo drops with the solve's tensors but still
    counts."""

    def __init__(self, fn: Callable[..., Any], backend: str, shared: bool) -> None:
        self.fn, self.backend, self.shared = fn, backend, shared
        self.graphs: dict[tuple, Callable[..., Any]] = {}

    def __call__(self, *args: Any, **static: Any) -> Any:
        key = tuple(sorted(static.items()))
        if key not in self.graphs:
            self.graphs[key] = compiled(self.fn, self.backend, key if self.shared else None)
        return self.graphs[key](*args, **static)


def _filled(values: list[float], device: torch.device) -> Tensor:
    """A float64 vector of ``values`` written on the device (no upload of host data)."""
    vec = torch.empty((len(values),), dtype=torch.float64, device=device)
    for i, value in enumerate(values):
        vec[i].fill_(value)
    return vec


def _step_state(vec: Tensor, const: Tensor, at_x: Tensor, sq_d: Tensor, products: Tensor, scale_sq: Tensor | None, *,
                order: str, case: str, first: bool, auto: bool, normalization: str, rho: float, momentum: float,
                tol: float, start_stop: float, slope_stop: float, floor_eps: float) -> tuple[Tensor, Tensor]:
    """The state after a step and the coefficients ``(a, b, g)`` of the next iterate ``a xi + b d + g xi_prev``,
    from the direction's ``<d, d>`` and its ``products`` with the rows ``order`` names (see
    :meth:`DeviceClimb.direction_sums`; products of zero rows count as 0, as in the reference). ``case``: where the
    next iterate goes (:meth:`DeviceClimb.advance_on_device`). A pure function of tensors
    (``torch.compile(fullgraph=True)`` captures it)."""
    positive = vec[:SQ_PREV + 1] > 0  # ||xi_prev||^2, 1, ||xi||^2, 1, ||xi_prev||^2
    zero = const[_ZERO]
    d_xi = d_prev = zero
    if order == "x":
        d_xi = d_prev = torch.where(positive[SQ], products[0], 0.0)
    elif order == "p":
        d_prev = torch.where(positive[SQ_PREV], products[0], 0.0)
    elif order:
        d_xi, d_prev = torch.where(positive[SQ::2] if order == "xp" else positive[PREV_A:SQ + 1:2], products, 0.0
                                   ).unbind(0)[:: 1 if order == "xp" else -1]
    sq, sq_prev, cross = vec[SQ], vec[SQ_PREV], vec[CROSS]
    # the Gram matrix of (xi, d, xi_prev), then what the step sizes' denominators take the square root of
    denominators = [const[_ONE], sq_d if normalization == "riemannian" else scale_sq, const[_ONE]]
    entries = [sq, d_xi, cross, d_xi, sq_d, d_prev, cross, d_prev, sq_prev]
    stacked = torch.stack(entries + (denominators if normalization != "none" else []))
    gram = stacked[:9].view(3, 3)
    live = at_x if not auto else at_x & (vec[DONE] == 0)  # the iterate is the best point, not stopped
    best_entries = torch.where(live, stacked[3:5], vec[BEST_DXI:BEST_SQD + 1])  # <d, xi>, <d, d>
    numerators = vec[ONE_C:ZERO_C + 1]  # 1, eta, 0
    if normalization == "none":
        sizes = numerators
    else:  # (1, eta / (sqrt(s) + 1e-12), 0), rounded as the reference rounds it
        sizes = numerators / (stacked[9:].sqrt() + const[_OFFSET])
    sq_z = torch.dot(sizes, torch.mv(gram, sizes))  # ||xi + c d||^2
    radial = torch.rsqrt(sq_z.clamp_min(rho * rho)) * rho  # P_S's scaling (1 inside the ball)
    if first:
        coefs, sq_new = sizes * radial, sq_z.clamp(0.0, rho * rho)
    else:  # the momentum point xi + m (z - xi) + (1 - m)(xi - xi_prev), then P_S
        point = torch.addcmul(const[_BASE], sizes, radial, value=momentum)
        sq_y = torch.dot(point, torch.mv(gram, point))
        coefs = point * (torch.rsqrt(sq_y.clamp_min(rho * rho)) * rho)
        sq_new = sq_y.clamp(0.0, rho * rho)
    new_cross = torch.dot(coefs, gram[:, 0])  # <xi_new, xi>
    coefs = torch.where(positive[SQ:], coefs, 0.0)  # zero rows drop out, as in the reference
    if case == "C":
        at = torch.where(at_x, const[_ONE], vec[AT])  # AT_X -> AT_P; AT_B stays
    else:
        at = torch.where(at_x, const[_ONE], const[_TWO])  # AT_X -> AT_P; else the best row
    done, stop, step = vec[DONE], vec[STOP], vec[STEP]
    if auto:  # Climb.stationary_enough at the best point (the iterate), the reference's operations
        agreed = (vec[BEST_LOSS] >= vec[AGREE_LOW]) & (vec[BEST_LOSS] <= vec[AGREE_HIGH])
        halt = live & _stationary(rho, sq_d, d_xi, vec[BEST_LOSS], vec[BEST_SQ], const[_CLEAN], tol, start_stop,
                                  slope_stop, floor_eps, agreed)
        done = torch.where(halt, const[_ONE], done)
        stop = torch.where(halt, step, stop)
        step = step + 1
    best_dxi, best_sqd = best_entries.unbind(0)
    lanes = [sq, const[_ONE], sq_new, const[_ONE], sq, new_cross, vec[BEST_LOSS], vec[BEST_SQ], best_dxi,
             best_sqd, at, done, stop, step, vec[ONE_C], vec[ETA], vec[ZERO_C], vec[AGREE_LOW],
             vec[AGREE_HIGH]]  # the iterate becomes xi_prev
    return torch.stack(lanes), coefs


def _bookkeep(vec: Tensor, const: Tensor, loss: Tensor, *, auto: bool) -> Tensor:
    """The state after the loss at the new iterate: the best point moves there where the loss is higher (unless
    stopped), its gap unknown. A pure function of tensors."""
    better = loss > vec[BEST_LOSS]
    if auto:
        better = better & (vec[DONE] == 0)
    lanes = list(vec.unbind(0))
    lanes[BEST_LOSS], lanes[BEST_SQ], lanes[BEST_DXI], lanes[BEST_SQD] = loss, vec[SQ], const[_NAN], const[_NAN]
    lanes[AT] = const[_ZERO]
    return torch.where(better, torch.stack(lanes), vec)


def _stationary(rho: float, sq_d: Tensor, d_xi: Tensor, best_loss: Tensor, best_sq: Tensor, clean: Tensor,
                tol: float, start_stop: float, slope_stop: float, floor_eps: float, agreed: Tensor) -> Tensor:
    """:meth:`.climb.Climb.stationary_enough` at the best point (the iterate) from its direction's Gram entries,
    with the operations of the reference, in its order; where ``agreed`` (the best loss in a checking start's
    window), the certificate's own test: the gap within ``tol``, or within the resolution."""
    sharpness = best_loss - clean
    gap = _relative_gap(rho, sq_d, d_xi, sharpness)
    tangential = torch.where(best_sq > 0, sq_d - d_xi * d_xi / best_sq, sq_d)
    slope = torch.where(sharpness > 0, rho * tangential.clamp_min(0.0).sqrt() / sharpness, math.inf)
    scaled = slope * slope_stop
    measure = torch.where(scaled > gap, scaled, gap)
    floor = floor_eps * torch.maximum(best_loss.abs(), clean.abs())
    strict = (measure <= tol * start_stop) | ((sharpness > 0) & (measure * sharpness <= start_stop * floor))
    checked = agreed & ((gap <= tol) | ((sharpness > 0) & (gap * sharpness <= floor)))
    return strict | checked


def _relative_gap(rho: float, sq_d: Tensor, d_xi: Tensor, sharpness: Tensor) -> Tensor:
    """:func:`.certificate.relative_gap` on the device."""
    gap = (rho * sq_d.clamp_min(0.0).sqrt() - d_xi).clamp_min(0.0)
    return torch.where(gap == 0, 0.0, torch.where(sharpness > 0, gap / sharpness, math.inf))
