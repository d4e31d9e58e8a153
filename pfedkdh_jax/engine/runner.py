"""The host loop that runs rounds and evaluations of any algorithm: :class:`RoundRunner`.

It compiles the pure pieces of :mod:`pfedkdh_jax.engine.round` and :mod:`pfedkdh_jax.engine.evaluate`
once each and calls them in the plan the layout asks for, chaining device values without host
synchronisation:

* ``vmap`` + ``scan``: the whole round is one compiled call (the pure round itself);
* ``vmap`` + ``unrolled``: start all selected clients, call a compiled chunk of ``chunk_steps`` steps
  as often as the largest selected client needs (its last steps one at a time), finish them, update;
* ``sequential``: the same client by client, with one compiled function per piece reused by every
  client (a client of a few steps in one call, ``Layout.fused_steps``), then the updates stacked for
  the server; with ``client_devices`` > 1 (and no mesh) the
  clients are spread over that many local devices, which work at the same time (:class:`_Spread`).
  For a method that splits its uploads (:func:`~pfedkdh_jax.engine.protocol.splits_uploads`) only
  the rests are stacked: each device adds its clients' averaged parts, weighted, into a running sum as
  they finish (:class:`_Means`), and the server step is given their mean;
* ``vmap`` + ``scan`` with ``lanes``: one compiled call whose local work, of every repetition at once,
  is packed into lanes (:mod:`pfedkdh_jax.engine.packing`).

Evaluations follow the same layout (features in compiled chunks or one ``lax.map``). ``traces`` counts
how often each piece was traced, so tests can assert that nothing recompiles after the first round.

With ``reps=R`` every piece is additionally ``vmap``-ed over a leading repetition axis ``[R, ...]``
(states, selected clients ``[R, C]``, keys ``[R]``; the data are shared), so R Monte Carlo
repetitions run as one program, whatever the method. The data may be stacked partitions
(:func:`~pfedkdh_jax.data.device.stack_partitions`, one per repetition: other α values or data seeds),
vmapped with the repetitions; a host plan then counts each repetition's steps in its own partition. With a ``mesh``, that axis (or else the client
axis of the one-call round) is split over the mesh's devices. :class:`PhasedRunner` holds one
runner per phase of a method of several phases (FedFed) and enters each phase at its first round.
(Over 300 lines: the four plans, their repetition axis and the phases are one host loop.)
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import numbers
import warnings
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.engine.protocol import (Algorithm, ProtocolError, check_algorithm, check_pieces, prepares_rounds, splits_uploads,
                                         check_floating, server_step_result, state_change, upload_weight_of)
from pfedkdh_jax.data.device import FederatedData, check_data, data_axes
from pfedkdh_jax.engine import client_rows, scoring
from pfedkdh_jax.engine.evaluate import adapted_clients, evaluation, image_problem, make_evaluate, spread_to_all
from pfedkdh_jax.engine.layout import AUTO_GRANULE, Layout, Workload, local_training_compiler_options
from pfedkdh_jax.engine.local import (LocalState, LocalTrainer, fused_plan_pays, paying_widths, step_widths,
                                      width_runs)
from pfedkdh_jax.engine.packing import make_packed_round
from pfedkdh_jax.engine.round import (LocalProblem, check_one_phase, check_state_clients, checked_selection, make_round,
                                      max_local_steps, select_clients, train_local_problem)
from pfedkdh_jax.engine.sharding import leading_axis_sharding, per_device, replicated

PyTree = Any


def sample_schedule(key: jax.Array, num_rounds: int, num_clients: int, per_round: int) -> np.ndarray:
    """Selected clients of every round ``[T, C]``: uniformly, without replacement (a host copy, for
    host loops; row t is :func:`~pfedkdh_jax.engine.round.select_clients` of ``fold_in(key, t)``).
    The three counts are Python (or NumPy) integers; anything else is a ``TypeError`` naming it."""
    for name, value in (("num_rounds", num_rounds), ("num_clients", num_clients), ("per_round", per_round)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise TypeError(f"sample_schedule: {name} must be an int; got {type(value).__name__} {value!r}")

    def one(r):
        return select_clients(jax.random.fold_in(key, r), num_clients, per_round)
    return np.asarray(jax.vmap(one)(jnp.arange(num_rounds)), dtype=np.int32)


class _ClientCalls:
    """Compiled pieces of one local problem for the host plans (per client, or all vmapped).

    ``prefix`` tells the round's problem ("") from a personalization's in ``traces``.
    """

    def __init__(self, compiled, layout: Layout, problem_of, host_problem: LocalProblem, max_size: int,
                 prefix: str, d=None, visits: float | None = None):
        # problem_of(algo) -> the LocalProblem (rebuilt inside a trace with stacked hyperparameters);
        # host_problem: the one the host counts steps with; max_size: the largest client (static step
        # count of a scan); d: the data's repetition in_axes; visits: about how often each client
        # will train over the run (Layout.slot_granule "auto"; None: not known, full batches)
        self.layout, self.problem, self.visits = layout, host_problem, visits
        g = layout.slot_granule
        self._granule = AUTO_GRANULE if g == "auto" else g   # the granule of the step widths
        self._sizes: dict[int, tuple] = {}   # id(train_n) -> (train_n, its host copy)
        self._kept: dict[int, tuple] = {}    # id(train_n) -> (train_n, the narrow widths that pay)
        self.max_steps = int(host_problem.trainer.num_steps(host_problem.size(max_size)))

        def train_of(n, vmapped=False, width=None):   # n steps of one client (or of every client, vmapped)
            def make(a):                                # on ``width`` slots a step (None: a full batch)
                problem = problem_of(a)
                train = (problem if width is None else problem.narrowed(width)).train
                if vmapped:
                    train = jax.vmap(train, in_axes=(0, None, None, 0, None))
                return lambda s, c, dt, k: train(s, c, dt, k, n)
            return make

        self.start_one = compiled(f"{prefix}client_start", lambda a: problem_of(a).start, (0, d, 0, 0))
        self.start_all = compiled(f"{prefix}client_start_vmap",
                                  lambda a: jax.vmap(problem_of(a).start, in_axes=(None, None, 0, None)),
                                  (0, d, 0, 0))
        ctx_axes = (0, 0, d, 0)
        self._make = (compiled, train_of, ctx_axes, prefix)

        def whole_of(plan):   # one client from start to finish in one program: its steps as ``plan`` says
            return lambda a: lambda s, c, dt, sel, k: problem_of(a).client_in_runs(s, c, dt, sel, k, plan)

        def tag(plan):   # client_whole@4x2: two steps on 4 slots (64x1: one full batch of 64)
            b = host_problem.trainer.batch_size
            return "+".join(f"{w or b}x{n}" for w, n in plan)
        self._whole_of = lambda plan: compiled(f"{prefix}client_whole@{tag(plan)}", whole_of(plan), (0, 0, d, 0, 0),
                                               steps=True)

        def whole_mean_of(plan):   # the same, adding its averaged part into a running sum (_Means)
            return lambda a: lambda acc, s, c, dt, sel, k: _mean_add(
                a, acc, problem_of(a).client_in_runs(s, c, dt, sel, k, plan), dt, sel)
        self._whole_mean_of = lambda plan: compiled(f"{prefix}client_whole_mean@{tag(plan)}", whole_mean_of(plan),
                                                    (0, 0, 0, d, 0, 0), steps=True, donate=0)
        self._wholes: dict[tuple, Any] = {}   # (a step plan, summed) -> its one-call client (made when first met)
        self._fused: dict[int, tuple] = {}    # id(train_n) -> (train_n, the plans run as one call)
        self._narrow: dict[tuple[int, bool], tuple] = {}   # (width, vmapped) -> (chunk, single step)
        self._warmed: set = set()                            # (id(train_n), vmapped) already warmed
        self._plans: dict[tuple, tuple] = {}                  # (kept widths, one client's size) -> its plan
        if layout.step_loop == "scan":
            m = self.max_steps
            self.train_one = compiled(f"{prefix}train_scan", train_of(m), ctx_axes, steps=True)
            self.train_all = compiled(f"{prefix}train_scan_vmap", train_of(m, True), ctx_axes, steps=True)
            self.step_one = self.step_all = None   # one scan call takes every step: no tail steps
        else:
            n = layout.chunk_steps
            self.train_one = compiled(f"{prefix}train_chunk", train_of(n), ctx_axes, steps=True)
            self.train_all = compiled(f"{prefix}train_chunk_vmap", train_of(n, True), ctx_axes, steps=True)
            # a client's last (steps mod chunk) steps, one at a time: no chunk computes idle steps
            self.step_one = compiled(f"{prefix}train_step", train_of(1), ctx_axes, steps=True)
            self.step_all = compiled(f"{prefix}train_step_vmap", train_of(1, True), ctx_axes, steps=True)
        if host_problem.finish is not None:
            self.finish_one = compiled(f"{prefix}client_finish", lambda a: problem_of(a).finish, (0, d, 0, 0, 0))
            self.finish_all = compiled(
                f"{prefix}client_finish_vmap",
                lambda a: jax.vmap(problem_of(a).finish, in_axes=(None, None, 0, 0, None)), (0, d, 0, 0, 0))
        else:
            self.finish_one = self.finish_all = None   # the local states are the result

    def calls(self, clients: np.ndarray, data: FederatedData) -> "Sequence[tuple[int | None, int]] | None":
        """The plan of ``clients`` taking their steps together (one client, one per repetition, or
        all vmapped) in ``data``: runs ``[(width, steps), ...]`` of consecutive steps computing the
        same slots (``None``: a full batch; :func:`~pfedkdh_jax.engine.local.step_widths`, with
        ``Layout.slot_granule``), so a client's partial last batch of an epoch computes its own size
        rounded up, not a full batch. ``None`` with a scan (one call takes every step). The sizes
        are read from the data given (any partition of the stacked shape)."""
        if self.layout.step_loop == "scan":
            return None
        clients, sizes, kept = np.asarray(clients), self._host_sizes(data), self._kept_widths(data)
        if sizes.ndim == 2:   # stacked partitions: each repetition's clients in its own partition
            ns = np.take_along_axis(sizes, clients.reshape(sizes.shape[0], -1), axis=1).ravel()
        else:
            ns = sizes[np.ravel(clients)]
        if len(ns) == 1:
            return self._size_plan(int(ns[0]), kept)
        return width_runs(self._widths([self.problem.size(int(n)) for n in ns], kept))

    def _widths(self, sizes: list[int], kept: frozenset | None) -> list:
        t = self.problem.trainer
        return step_widths(sizes, t.epochs, t.batch_size, self._granule, t.max_steps, kept)

    def _size_plan(self, n: int, kept: frozenset | None) -> tuple[tuple[int | None, int], ...]:
        """The plan of one client of ``n`` train samples (made once per size, reused every round)."""
        plan = self._plans.get((kept, n))
        if plan is None:
            plan = self._plans[kept, n] = tuple(width_runs(self._widths([self.problem.size(n)], kept)))
        return plan

    def _kept_widths(self, data: FederatedData) -> frozenset | None:
        """The narrow widths compiled for ``data``'s clients: with ``slot_granule="auto"`` those
        worth it over the run (:func:`~pfedkdh_jax.engine.local.paying_widths`, found once per data
        object; none when the runner was told no workload); ``None`` (all) with a granule given."""
        if self.layout.slot_granule != "auto":
            return None
        if self.visits is None:
            return frozenset()
        cached = self._kept.get(id(data.train_n))
        if cached is None or cached[0] is not data.train_n:
            t = self.problem.trainer
            sizes, inverse = np.unique(self._host_sizes(data), return_inverse=True)
            samples = np.asarray([self.problem.size(int(n)) for n in sizes])[inverse]
            kept = paying_widths(samples, self.visits, t.epochs, t.batch_size, self._granule,
                                 t.max_steps, self.layout.chunk_steps)
            cached = self._kept[id(data.train_n)] = (data.train_n, kept)
        return cached[1]

    @staticmethod
    def plan_steps(plan) -> int:
        return 1 if plan is None else sum(n for _, n in plan)

    def _steps(self, width: int | None, vmapped: bool) -> tuple:
        """The (chunk, single step) calls computing ``width`` slots a step (``None``: the full-batch
        pieces); each width's pieces are made, and compiled, the first time a client needs them."""
        if width is None:
            return (self.train_all, self.step_all) if vmapped else (self.train_one, self.step_one)
        if (width, vmapped) not in self._narrow:
            compiled, train_of, axes, prefix = self._make
            tag = f"{'_vmap' if vmapped else ''}@{width}"
            self._narrow[width, vmapped] = (
                compiled(f"{prefix}train_chunk{tag}", train_of(self.layout.chunk_steps, vmapped, width), axes, steps=True),
                compiled(f"{prefix}train_step{tag}", train_of(1, vmapped, width), axes, steps=True))
        return self._narrow[width, vmapped]

    def _fused_plans(self, data: FederatedData) -> frozenset:
        """The step plans of one client that run as one compiled call (``Layout.fused_steps``): those
        of at most ``fused_steps`` steps (``"auto"``: ``chunk_steps``, and only plans whose clients'
        visits over the run pay the call's compile, :func:`~pfedkdh_jax.engine.local.fused_plan_pays`;
        none when the runner was told no workload). Found once per data object."""
        limit = self.layout.fused_steps
        if self.layout.step_loop == "scan" or not limit or (limit == "auto" and self.visits is None):
            return frozenset()
        cached = self._fused.get(id(data.train_n))
        if cached is None or cached[0] is not data.train_n:
            sizes, counts = np.unique(self._host_sizes(data), return_counts=True)
            kept, clients = self._kept_widths(data), collections.Counter()
            for n, count in zip(sizes, counts):
                clients[tuple(self._size_plan(int(n), kept))] += int(count)
            most = self.layout.chunk_steps if limit == "auto" else limit
            plans = frozenset(plan for plan, count in clients.items()
                              if 0 < self.plan_steps(plan) <= most
                              and (limit != "auto" or fused_plan_pays(count * self.visits, self.plan_steps(plan))))
            cached = self._fused[id(data.train_n)] = (data.train_n, plans)
        return cached[1]

    def _whole(self, plan, data: FederatedData, summed: bool = False):
        """The one-call client of ``plan`` where it is one of ``data``'s fused plans, else ``None``;
        ``summed``: the form that adds into a running sum (``(acc, ...) -> (acc, rest)``)."""
        if plan is None:
            return None
        plan = tuple(plan)   # a one-client plan is already one (made once per size)
        if plan not in self._fused_plans(data):
            return None
        if (plan, summed) not in self._wholes:
            self._wholes[plan, summed] = (self._whole_mean_of if summed else self._whole_of)(plan)
        return self._wholes[plan, summed]

    def _warm(self, vmapped: bool, data: FederatedData, start, state, ctx, sel, key, means=None) -> None:
        """Compile, at the first call on ``data``, the step pieces of every width its clients' plans
        use and its one-call clients (found from their sizes, each run once on this client's values
        and discarded), so that what later clients meet does not compile inside later rounds: the
        compile time moves to the first round, and round times stay comparable from the second on."""
        tag = (id(data.train_n), vmapped)
        if self.layout.step_loop == "scan" or tag in self._warmed:
            return
        self._warmed.add(tag)
        chunk, kept = self.layout.chunk_steps, self._kept_widths(data)
        needed, wholes = set(), set()
        for n in np.unique(self._host_sizes(data)):
            plan = self._size_plan(int(n), kept)
            if not vmapped and self._whole(plan, data) is not None:
                wholes.add(tuple(plan))
                continue
            for width, count in plan:
                if count >= chunk:
                    needed.add((width is not None, width or 0, 0))
                if count % chunk:
                    needed.add((width is not None, width or 0, 1))
        for plan in sorted(wholes, key=str):
            if means is None:
                self._whole(plan, data)(state, ctx, data, sel, key)
            else:
                self._whole(plan, data, True)(means.zeros(state, data, sel, key), state, ctx, data, sel, key)
        if needed:
            local = start(state, data, sel, key)
            for narrow, width, single in sorted(needed):
                self._steps(width if narrow else None, vmapped)[single](local, ctx, data, sel)

    def _host_sizes(self, data: FederatedData) -> np.ndarray:
        """``data.train_n`` on the host, read once per data object (not once per client and round)."""
        cached = self._sizes.get(id(data.train_n))
        if cached is None or cached[0] is not data.train_n:
            cached = self._sizes[id(data.train_n)] = (data.train_n, np.asarray(data.train_n))
        return cached[1]

    def _drive(self, start, vmapped, finish, state, ctx, data, sel, clients, key, plan=None, means=None, device=0):
        """One plan for both layouts: start, the steps of each width (whole chunks, then single
        steps), finish (``plan``: :meth:`calls` of ``clients``, if already made); a sequential
        client of a fused plan (:meth:`_fused_plans`) in one call. With ``means`` (:class:`_Means`),
        the result's averaged part is added into ``device``'s running sum (inside a fused client's
        call) and its rest is returned."""
        self._warm(vmapped, data, start, state, ctx, sel, key, means)
        plan = self.calls(clients, data) if plan is None else plan
        whole = None if vmapped else self._whole(plan, data, means is not None)
        if whole is not None:   # a client of a few steps: one call from start to finish
            if means is None:
                return whole(state, ctx, data, sel, key)
            acc, rest = whole(means.take(device, state, data, sel, key), state, ctx, data, sel, key)
            means.keep(device, acc)
            return rest
        local = start(state, data, sel, key)
        if plan is None:   # a scan: one call takes every step
            local = self._steps(None, vmapped)[0](local, ctx, data, sel)
        else:
            for width, count in plan:
                train, step = self._steps(width, vmapped)
                for _ in range(count // self.layout.chunk_steps):
                    local = train(local, ctx, data, sel)
                for _ in range(count % self.layout.chunk_steps):
                    local = step(local, ctx, data, sel)
        out = local if self.problem.finish is None else finish(state, data, sel, local, key)
        if means is None:
            return out
        acc, rest = means.add(means.take(device, state, data, sel, key), out, data, sel)
        means.keep(device, acc)
        return rest

    def run_all(self, state, ctx, data: FederatedData, clients: np.ndarray, key: jax.Array, place):
        """Every one of ``clients`` (host ints ``[C]``, or ``[R, C]``) vmapped: stacked results."""
        sel = place(jnp.asarray(clients, jnp.int32))
        return self._drive(self.start_all, True, self.finish_all, state, ctx, data, sel, clients, key)

    def run_each(self, state, ctx, data: FederatedData, clients: np.ndarray, key: jax.Array, place,
                 spread: "_Spread | None" = None, means: "_Means | None" = None):
        """Every one of ``clients`` one after another (one per repetition at a time with ``[R, C]``);
        with ``spread``, one after another on each of its devices (results on the first); with
        ``means``, each result's averaged part added into its device's running sum, the rests the
        results."""
        clients = np.asarray(clients)
        drive = lambda st, cx, dt, sel, c, k, plan=None, i=0: self._drive(  # noqa: E731
            self.start_one, False, self.finish_one, st, cx, dt, sel, c, k, plan, means, i)
        cols = range(clients.shape[-1])
        if spread is None:   # lazily: each result can be consumed (written into a buffer) as it comes
            return (drive(state, ctx, data, place(jnp.asarray(clients[..., c], jnp.int32)), clients[..., c], key)
                    for c in cols)
        plans = [self.calls(clients[..., c], data) for c in cols]
        where, order = spread.assign([self.plan_steps(p) for p in plans])
        copies = spread.copies(state, ctx, key)
        datas = spread.data_on(data)
        outs = [None] * len(plans)
        for c in order:   # longest first; each device's calls queue up behind one another
            i = where[c]
            (st, cx, k), sel = copies[i], jax.device_put(np.asarray(clients[..., c], np.int32), spread.devices[i])
            outs[c] = drive(st, cx, datas[i], sel, clients[..., c], k, plans[c], i)
        return [o if where[c] == 0 else jax.device_put(o, spread.devices[0]) for c, o in enumerate(outs)]


# an evaluation of per-client backbones kept as a ClientRows computes the base's features in one shared
# pass over the test split where at least this share of the owner chunks read the base (clients never
# trained): Ditto at 10,000 clients with 1,000 rows, a first evaluation 11.6 -> 4.5 s (BENCHMARKS.md)
BASE_PASS_SHARE = 0.25


class _Rows:
    """Sequential clients' results ``[C]`` as one stacked pytree ``[C, ...]`` (``[R, C, ...]`` with
    repetitions, ``axis`` 1), each written in place (donated) into one buffer as it comes, so that
    at most one client's result exists besides the buffer. The buffer is kept for the next round of
    the same shapes, which overwrites every row: allocating it afresh each round cost its page
    faults (0.5–1.3 s for the 2.6 GB of 1,130 MNIST backbones). What the server step returns never
    shares it (a jitted call's outputs are its own buffers, also those that hand an input leaf on, as
    the clients' losses in the metrics: a test checks it). Stacking a list of C uploads inside
    the server step instead materialised a second copy of them all and took C dispatch arguments per
    leaf: with 1,000 uploads of the MNIST backbone (2.3 MB each), 1.5–3.4 s against 0.26 s for rows
    written into a preallocated buffer and averaged (BENCHMARKS.md, "Widths that pay, uploads
    written in place, and the scaling benchmark"; ``experiments/upload_rows.py``)."""

    def __init__(self, axis: int, keep: bool = True):
        # keep: hold the buffer for the next call (False: one made per call, for rare calls whose
        # buffer should not stay in memory between them, e.g. the personalization of every client)
        self.axis, self.keep = axis, keep
        self._buf, self._spec = None, None
        # a buffer of n copies of one row (every row is overwritten; made from it, so that it takes
        # the row's dtype, also a key's or a boolean's, and its sharding)
        self._empty = jax.jit(lambda row, n: jax.tree_util.tree_map(
            lambda r: jnp.repeat(jnp.expand_dims(r, axis), n, axis=axis), row), static_argnums=1)
        self._put = jax.jit(lambda buf, row, c: jax.tree_util.tree_map(
            lambda b, r: jax.lax.dynamic_update_index_in_dim(b, r, c, axis), buf, row), donate_argnums=0)

    def put(self, buf, row, c: int):
        """``buf`` (donated) with ``row`` written at index ``c`` of its stacking axis."""
        return self._put(buf, row, np.int32(c))

    def stack(self, rows, n: int):
        """The ``n`` results of the iterable ``rows`` stacked (every row written)."""
        buf = None
        for c, row in enumerate(rows):
            if buf is None:
                spec = (jax.tree_util.tree_structure(row), n,
                        tuple((x.shape, x.dtype, getattr(x, "sharding", None)) for x in jax.tree_util.tree_leaves(row)))
                buf = self._buf if spec == self._spec else self._empty(row, n)
                # donated below: only the returned buffer is live (and a call that fails before
                # returning leaves no stale buffer behind for the next one)
                self._buf, self._spec = None, None
            buf = self._put(buf, row, np.int32(c))
        if self.keep:
            self._buf, self._spec = buf, spec
        return buf


def _mean_split(a: Algorithm, update, data: FederatedData, sel):
    """``((w_k x_k, w_k, dtypes), rest)`` of one client's update under ``a.mean_upload``: its averaged
    part weighted by ``a.upload_weight`` (by default its train samples; float32, or a wider leaf's own
    dtype), the weight, zero-size arrays of the parts' dtypes, and the rest."""
    part, rest = a.mean_upload(update)
    check_floating(part, f"{type(a).__name__}.mean_upload's averaged part")
    w = upload_weight_of(a, data, sel, update)
    wide = lambda x: jnp.promote_types(x.dtype, jnp.float32)  # noqa: E731
    total = jax.tree_util.tree_map(lambda x: w.astype(wide(x)) * x.astype(wide(x)), part)
    like = jax.tree_util.tree_map(lambda x: jnp.zeros((0,), x.dtype), part)
    return (total, w, like), rest


def _mean_add(a: Algorithm, acc, update, data: FederatedData, sel):
    """``(acc + the update's weighted part, rest)``."""
    (total, w, like), rest = _mean_split(a, update, data, sel)
    return (jax.tree_util.tree_map(jnp.add, acc[0], total), acc[1] + w, like), rest


class _Means:
    """A round's weighted mean (``upload_weight``: by default the train samples) of the selected clients' averaged parts, formed as they finish
    (for a method that splits its uploads): each device keeps a running sum ``Σ n_k x_k`` and ``Σ n_k``
    (float32, or wider leaves' own dtype), each client's averaged part added into it in place (donated)
    and then dropped, so that a round holds one sum per device and the stacked rests instead of C
    whole uploads. A client of a fused plan adds into the sum inside its one call
    (``_ClientCalls``: ``client_whole_mean@...``), so its upload never leaves the call; another client's
    update is added by ``mean_add``. Each device's sum starts a round at zeros (their shapes traced once,
    never run), so the pieces run are the same on any number of devices. At the end the devices' sums go
    to the first device, where the server step's call adds them and divides. The order of the additions
    differs from the stacked mean's (:func:`~pfedkdh_jax.engine.protocol.sample_mean`), so the two agree
    to float32 rounding."""

    def __init__(self, compiled, d, devices: int, problem_of, donate_state=None):
        def shapes(a):   # a client's weighted part from its start and finish (no steps): for its shapes
            p = problem_of(a)
            return lambda s, dt, sel, k: _mean_split(a, p.finish(s, dt, sel, p.start(s, dt, sel, k), k), dt, sel)[0]

        def server(a, state, data, sel, sums, rest, key):   # sums: one (total, w, like) per device
            total = jax.tree_util.tree_map(lambda *xs: functools.reduce(jnp.add, xs), *[s[0] for s in sums])
            w, like = sum(s[1] for s in sums), sums[0][2]
            mean = jax.tree_util.tree_map(lambda s, z: (s / w).astype(z.dtype), total, like)
            return server_step_result(a, a.server_update_from_mean(state, data, sel, mean, rest, key),
                                      "server_update_from_mean")
        self._shapes_of = compiled("mean_shapes", shapes, (0, d, 0, 0))
        self._shapes = None
        self.add = compiled("mean_add", lambda a: functools.partial(_mean_add, a), (0, 0, d, 0), donate=0)
        self.server = compiled("server_update_from_mean", lambda a: functools.partial(server, a),
                               (0, d, 0, 0, 0, 0), donate=donate_state)
        self.devices = devices
        self._sums: dict[int, Any] = {}

    def zeros(self, state, data, sel, key):
        """A sum of zeros placed as ``sel`` is (its leading repetition axis sharded as the selection's)."""
        if self._shapes is None:
            self._shapes = jax.eval_shape(self._shapes_of, state, data, sel, key)
        return jax.tree_util.tree_map(lambda s: jnp.zeros(s.shape, s.dtype, device=sel.sharding), self._shapes)

    def take(self, device: int, state, data, sel, key):
        """``device``'s running sum (zeros at its first client of a round); it is donated to the call
        that adds into it, which gives the new one to :meth:`keep`."""
        acc = self._sums.pop(device, None)
        return self.zeros(state, data, sel, key) if acc is None else acc

    def keep(self, device: int, acc) -> None:
        self._sums[device] = acc

    def sums(self, first_device):
        """Every device's sum (the round's clients all added), on ``first_device``: a tuple of one per
        device, a device that had no client adding zeros; then reset for the next round."""
        got, self._sums = self._sums, {}
        if first_device is not None:
            got = {i: jax.device_put(s, first_device) for i, s in got.items()}
        zero = jax.tree_util.tree_map(jnp.zeros_like, got[min(got)]) if len(got) < self.devices else None
        return tuple(got.get(i, zero) for i in range(self.devices))


def _kind(state) -> tuple:
    """What a compiled round is keyed on in ``state``: its structure (static fields included), shapes
    and dtypes."""
    leaves, tree = jax.tree_util.tree_flatten(state)
    return tree, tuple((tuple(getattr(x, "shape", None) or np.shape(x)), getattr(x, "dtype", None)) for x in leaves)


def _unshared(state):
    """``state`` with a copy of every leaf after the first that holds the same buffer as another (a fresh
    ``init`` may hand one array to two fields, e.g. a ClientRows' base and the global model): a donated
    buffer may appear only once in a call's arguments."""
    seen: set = set()

    def one(x):
        try:   # per device: a replicated leaf may share one device's buffer with another leaf, not all
            keys = {s.data.unsafe_buffer_pointer() for s in x.addressable_shards}
        except (AttributeError, RuntimeError, NotImplementedError):
            keys = {id(x)}
        if keys & seen:
            return jnp.copy(x)
        seen.update(keys)
        return x
    return jax.tree_util.tree_map(one, state)


class _NewLeaves:
    """A compiled pytree-to-pytree call that computes only the leaves its function makes: the leaves it
    returns unchanged from its first argument (the same tracers) are handed back from the input
    instead. A jitted output is a fresh buffer, so a function that returns the state with one field
    added (``round_start``) or cut (``client_rows.restrict``) would otherwise copy the whole state,
    every per-client table too, at every call. Which output leaves pass through is recorded when the
    call is traced (once: the state's structure is the same every round)."""

    def __init__(self, compiled, name: str, make, axes):
        self._passthrough: list[int] = []
        self._treedef = None

        def fresh_of(a):
            fn = make(a)

            def fresh(state, *rest):
                out = fn(state, *rest)
                given = {id(x): i for i, x in enumerate(jax.tree_util.tree_leaves(state))}
                leaves, self._treedef = jax.tree_util.tree_flatten(out)
                self._passthrough = [given.get(id(x), -1) for x in leaves]
                return [x for x, i in zip(leaves, self._passthrough) if i < 0]
            return fresh
        self._call = compiled(name, fresh_of, axes)

    def __call__(self, state, *rest):
        made = iter(self._call(state, *rest))
        given = jax.tree_util.tree_leaves(state)
        return jax.tree_util.tree_unflatten(self._treedef, [given[i] if i >= 0 else next(made)
                                                            for i in self._passthrough])


class _Spread:
    """The local devices that sequential clients are spread over (``Layout.client_devices``).

    A round's clients go longest first to the least loaded device (counted in local steps); each
    device runs its clients one after another with the same compiled pieces, on its own copy of the
    data (made once per data object) and of the round's state; the results come back to the first
    device. Calls are dispatched asynchronously, so the devices work at the same time.
    """

    def __init__(self, devices):
        self.devices = list(devices)
        self._data: dict[int, tuple] = {}   # id(data) -> (data, its copy on every device)

    def assign(self, steps: list[int]) -> tuple[list[int], list[int]]:
        """(device of each client, the clients longest first): greedy longest-processing-time."""
        order = sorted(range(len(steps)), key=lambda c: -steps[c])   # stable: ties keep client order
        loads, where = [0] * len(self.devices), [0] * len(steps)
        for c in order:
            i = loads.index(min(loads))
            where[c], loads[i] = i, loads[i] + steps[c]
        return where, order

    def copies(self, *tree):
        return [tree] + [jax.device_put(tree, d) for d in self.devices[1:]]

    def data_on(self, data: FederatedData) -> list:
        cached = self._data.get(id(data))
        if cached is None or cached[0] is not data:
            cached = self._data[id(data)] = (data, [data] + [jax.device_put(data, d) for d in self.devices[1:]])
        return cached[1]


class RoundRunner:
    """Compiled round and evaluation pieces of one algorithm on one data layout (module docstring)."""

    def __init__(self, algo: Algorithm, data: FederatedData, layout: Layout = Layout(), *,
                 reps: int | None = None, mesh: jax.sharding.Mesh | None = None,
                 hparams: dict | None = None, workload: Workload | None = None, donate_state: bool = False):
        # donate_state: a round may reuse the buffers of the state it is given (its server step then
        # writes the per-client tables in place instead of into new ones); for a caller that drops
        # the state it passes in (the CLI's loop). Default: the state passed in stays valid.
        # hparams: {field: [R] values} of repetitions that differ in plain-number hyperparameters
        # (stacked runs): every piece then rebuilds the algorithm inside its trace from its
        # repetition's values (``algo.with_hparams``), so one program serves them all;
        # workload: the rounds this runner will train (and evaluations), so that the host plans
        # compile only the narrow step widths that pay (None: full batches only)
        check_algorithm(algo, "RoundRunner(algo, ...)")
        check_one_phase(algo, "RoundRunner(algo, ...)")
        check_pieces(algo, "RoundRunner(algo, ...)")
        check_data(data, "RoundRunner(algo, data)")
        if reps is not None and (isinstance(reps, bool) or not isinstance(reps, numbers.Integral) or reps < 1):
            raise ValueError(f"RoundRunner: reps must be None (one run) or a count >= 1 of repetitions; got {reps!r}")
        self.algo, self.reps, self.mesh = algo, reps, mesh
        self.donate_state = donate_state
        state_donation = 0 if donate_state else None
        if hparams is not None and reps is None:
            raise ValueError("hparams are per repetition: they need reps")
        self.hparams = hparams
        self.layout = layout.resolved()
        self.round_fn = make_round(algo, self.layout)
        self.evaluate_fn = make_evaluate(algo, self.layout)
        self.traces: collections.Counter = collections.Counter()
        self._fitting: set = set()   # kinds of state and data check_state_clients passed
        self._kept: set = set()      # kinds of state a round was seen to return unchanged
        self._prepared = False       # whether prepare ran (before_training), for one warning
        if data.stacked and reps != data.runs:
            raise ValueError(f"stacked partitions of {data.runs} runs need reps={data.runs}; got reps={reps}")
        self.stacked = data.stacked
        d = data_axes(data)   # None: every repetition shares the data
        largest = max(data.train_sizes)
        multi = mesh is not None and mesh.size > 1
        # the repetition axis is sharded over the mesh when it divides evenly
        self.rep_sharding = leading_axis_sharding(mesh) if multi and reps and reps % mesh.size == 0 else None
        shard_clients = multi and reps is None
        # sequential clients spread over local devices, where no mesh has taken the devices
        n = self.layout.client_devices or 1
        self.spread = (_Spread(jax.local_devices()[:n]) if n > 1 and not multi
                       and self.layout.client_parallel == "sequential" else None)
        train_options = local_training_compiler_options()
        layout = self.layout

        def compiled(name, make, axes, steps=False, donate=None):
            """``make(algo)`` jitted (and vmapped over repetitions, ``axes`` saying which arguments
            carry the axis; with ``hparams`` each repetition's algorithm is rebuilt from its values);
            pieces that take local SGD steps compile with the local-training options; ``donate``:
            the index of an argument whose buffers the call may reuse."""
            if hparams is None:
                fn, in_axes = make(algo), axes
            else:
                fn, in_axes = (lambda hp, *args: make(algo.with_hparams(hp))(*args)), (0, *axes)
            if reps is not None:
                fn = jax.vmap(fn, in_axes=in_axes)
                if self.rep_sharding is not None:
                    fn = per_device(fn, mesh, in_axes)

            def wrapper(*args):
                self.traces[name] += 1
                return fn(*args)
            donated = () if donate is None else (donate + (hparams is not None),)
            jitted = jax.jit(wrapper, compiler_options=train_options if steps else None, donate_argnums=donated)
            return jitted if hparams is None else functools.partial(jitted, self.place(hparams))

        # --- rounds
        k = data.num_clients
        def problem_of(a):   # the round's local problem of one (possibly rebuilt) algorithm
            return make_round(a, layout).problem
        self._clients = _ClientCalls(compiled, layout, problem_of, self.round_fn.problem, largest, "", d,
                                     None if workload is None else workload.visits(k))
        self._round_start = (_NewLeaves(compiled, "round_start", lambda a: a.round_start, (0, d, 0))
                             if prepares_rounds(algo) else None)
        self._context = compiled("context", lambda a: a.context, (0,))
        # the state the client pieces see: each ClientRows cut to the round's clients (client_rows.restrict)
        self._view = _NewLeaves(compiled, "client_rows_view", lambda a: client_rows.restrict, (0, 0))
        self._server = compiled("server_update", lambda a: lambda *args: server_step_result(a, a.server_update(*args)),
                                (0, d, 0, 0, 0), donate=state_donation)
        # sequential clients of a method that splits its uploads: a running mean instead of C uploads
        self._means = (_Means(compiled, d, 1 if self.spread is None else len(self.spread.devices), problem_of,
                              state_donation)
                       if splits_uploads(algo) and layout.client_parallel == "sequential" else None)
        # sequential clients: each one's upload written in place into one [C, ...] buffer as it comes
        self._rows = _Rows(axis=0 if reps is None else 1)
        self._personal_rows = _Rows(axis=0 if reps is None else 1, keep=False)
        self._owned_rows = _Rows(axis=0 if reps is None else 1, keep=False)   # owner chunks' test features

        def fused(a):   # the round itself (make_round's), its clients split over the mesh's devices
            return dataclasses.replace(make_round(a, layout), client_mesh=mesh if shard_clients else None)
        if layout.lanes is None:
            self._fused = compiled("round", fused, (0, d, 0, 0), steps=True, donate=state_donation)
        else:
            self._fused = self._packed(algo, reps, multi, train_options)

        # --- evaluation
        model = algo.model
        def ev(a):   # the pure evaluation pieces of one (possibly rebuilt) algorithm
            return make_evaluate(a, layout)
        self.models = compiled("eval_models", lambda a: a.eval_models, (0,))
        idx = None if d is None else 0   # flat index lists come from the data: stacked with it
        self._features_chunk = compiled(
            "features_chunk", lambda a: lambda b, data, i: scoring.features_of(model, b, data, i), (0, d, idx))
        self._features_scan = compiled("features_scan", lambda a: ev(a).features, (0, d, idx))
        self._owned_chunk = compiled(
            "owned_features_chunk",
            lambda a: lambda b, data, g: scoring.owned_features_of(model, b, data, data.owned_chunk[g],
                                                                   data.owned_idx[g]),
            (0, d, None))
        self._owned_scan = compiled("owned_features_scan", lambda a: ev(a).owned_features, (0, d))
        self._base_owned = compiled("base_owned_features", lambda a: scoring.owned_from_flat, (0, d))
        self.score = compiled("score", lambda a: ev(a).score, (0, 0, d))
        self.score_global_model = compiled("score_global", lambda a: ev(a).score_global_model, (0, 0, d))
        self.score_personal = compiled("score_personalized", lambda a: ev(a).score, (0, 0, d))
        p = algo.personalization
        if p is not None and p.on_features:
            self.adapted_on_features = compiled("personalize_on_features", lambda a: ev(a).adapted_on_features, (0, d, 0, 0))
        elif p is not None:
            self._personal = _ClientCalls(compiled, layout, lambda a: image_problem(a.personalization, layout.step_loop),
                                          image_problem(p, layout.step_loop), largest, "personalize_", d,
                                          None if workload is None else float(workload.evaluations))
            self._personal_models = compiled("personalized_models", lambda a: a.personalization.models, (0, 0))
            self._personal_fused = compiled("personalize", lambda a: ev(a).adapted_on_images, (0, d, 0), steps=True)

    def _packed(self, algo, reps, multi, options):
        """The one-call round with the local work of all repetitions packed into lanes."""
        if multi:
            raise ValueError("lanes packs a round's work on one device: run it without a device mesh "
                             "(one visible device)")
        packed = make_packed_round(algo, self.layout)
        hp = self.hparams

        def round_(state, data, selected, key, hp):
            self.traces["round"] += 1
            if reps is not None:
                return packed(state, data, selected, key, hp)
            lead = jax.tree_util.tree_map(lambda a: a[None], (state, selected, key))
            return jax.tree_util.tree_map(lambda a: a[0], packed(lead[0], data, lead[1], lead[2]))
        jitted = jax.jit(round_, compiler_options=options)
        return lambda state, data, selected, key: jitted(state, data, selected, key, hp)

    @property
    def fused(self) -> bool:
        return self.layout.client_parallel == "vmap" and self.layout.step_loop == "scan"

    # ------------------------------------------------------------------------------- training
    def round(self, state, data: FederatedData, selected: np.ndarray, key: jax.Array):
        """One federated round over the clients ``selected`` (host ints ``[C]``, or ``[R, C]`` with
        repetitions; ``key`` then ``[R]``). Returns device values without synchronising."""
        check_data(data, "RoundRunner.round", pointer=False)
        selected = checked_selection(selected, data.num_clients, 1 if self.reps is None else 2)
        kind = _kind(state)
        self._check_clients(state, data, "RoundRunner.round", kind)
        if kind in self._kept:
            return self._round(state, data, selected, key)
        if not self._kept and not self._prepared and self.algo.prepares:   # once, at the first round
            warnings.warn(f"RoundRunner.round: {type(self.algo).__name__}'s before_training is configured but did not "
                          "run: call runner.prepare(state, data, key) once before the first round", stacklevel=2)
        given = jax.tree_util.tree_map(lambda x: jax.ShapeDtypeStruct(np.shape(x), jnp.result_type(x)), state)
        new, metrics = self._round(state, data, selected, key)
        change, name = state_change(given, new), type(self.algo).__name__
        if change is not None:   # the next round would compile again, and again: say where, once
            raise ProtocolError(f"RoundRunner.round: {name}'s round returns a state unlike the one it was given "
                                f"({change}); every round would compile again: its server step must keep the "
                                "state's structure, shapes, dtypes and static fields")
        if not (isinstance(metrics, dict) and "train_loss" in metrics):
            raise ProtocolError(f"RoundRunner.round: {name}'s server step returns metrics without train_loss "
                                "(a dict with the clients' mean local loss, and client_loss [C] to name a diverging "
                                "client: pfedkdh_jax.round_metrics(updates))")
        self._kept.add(kind)
        return new, metrics

    def _round(self, state, data: FederatedData, selected: np.ndarray, key: jax.Array):
        sel = self.place(jnp.asarray(selected, jnp.int32))
        key = self.place(key)
        state = self._pin(state)
        if self.donate_state:
            state = _unshared(state)
        if self.fused:
            return self._fused(state, data, sel, key)
        # what the server prepares for the round's clients (pFedSim's downloads), before the cut below
        ready = self._round_start(state, data, sel) if self._round_start is not None else state
        ctx = self._context(ready)
        # per-client tables of rows (ClientRows) reach the clients cut to theirs: a round copies C rows
        # to another device, not the table
        view = self._view(ready, sel) if client_rows.has_client_rows(ready) else ready
        if self.layout.client_parallel == "vmap":
            updates = self._clients.run_all(view, ctx, data, selected, key, self.place)
        elif self._means is not None:   # only the rests are stacked; the averaged parts summed as they come
            rests = self._rows.stack(self._clients.run_each(view, ctx, data, selected, key, self.place,
                                                            self.spread, self._means), selected.shape[-1])
            first = None if self.spread is None else self.spread.devices[0]
            return self._means.server(state, data, sel, self._means.sums(first), rests, key)
        else:
            updates = self._rows.stack(self._clients.run_each(view, ctx, data, selected, key, self.place,
                                                              self.spread), selected.shape[-1])
        return self._server(state, data, sel, updates, key)

    def prepare(self, state, data: FederatedData, key: jax.Array, algo: Algorithm | None = None):
        """The algorithm's ``before_training`` (one repetition's state, no repetition axis; of stacked
        partitions, the repetition's :func:`~pfedkdh_jax.data.device.run_slice`); ``algo``: the
        repetition's own (other hyperparameter values), default the runner's."""
        check_state_clients(self.algo, state, data, "RoundRunner.prepare")
        self._prepared = True
        return (algo or self.algo).before_training(state, data, key, self.train)

    def _check_clients(self, state, data: FederatedData, where: str, kind: tuple | None = None) -> None:
        """:func:`check_state_clients`, once per kind of state (:func:`_kind`, given or read) and data."""
        kind = (_kind(state) if kind is None else kind, getattr(data, "num_clients", None))
        if kind not in self._fitting:
            check_state_clients(self.algo, state, data, where, rep_axis=self.reps is not None)
            self._fitting.add(kind)

    def train(self, trainer: LocalTrainer, local: LocalState, ctx, row: jax.Array, source) -> LocalState:
        """Every step of one local problem, laid out as a client's round is (the service given to
        ``before_training``; compiled on each call: it runs once per run)."""
        return train_local_problem(self.layout, trainer, local, ctx, row, source)

    def _pin(self, state):
        """On a mesh without a sharded repetition axis, keep the state replicated, so every round
        sees the same input sharding (and nothing recompiles after the first). Off a mesh, commit
        the leaves of a state not yet committed to a device (a fresh ``init``'s) to the device they
        are on: a round's outputs are committed, and the pieces compiled for the first round's
        uncommitted state would otherwise compile again at the second."""
        if self.mesh is None:
            return jax.tree_util.tree_map(
                lambda x: x if getattr(x, "committed", True) else jax.device_put(x, next(iter(x.devices()))), state)
        if self.rep_sharding is not None or self.mesh.size == 1:
            return state
        return jax.device_put(state, replicated(self.mesh))

    def place(self, tree):
        """Put a repetition-batched value (state, keys, selections) on the repetition sharding."""
        return tree if self.rep_sharding is None else jax.device_put(tree, self.rep_sharding)

    # ----------------------------------------------------------------------------- evaluation
    def features(self, backbone, data: FederatedData, flat_idx: jax.Array) -> jax.Array:
        """Features of a padded flat index list, in compiled chunks (or one ``lax.map``)."""
        if self.layout.step_loop == "scan":
            return self._features_scan(backbone, data, flat_idx)
        c = data.eval_chunk
        parts = [self._features_chunk(backbone, data, flat_idx[..., i:i + c]) for i in range(0, flat_idx.shape[-1], c)]
        return jnp.concatenate(parts, axis=0 if self.reps is None else 1)

    def test_features(self, models, data: FederatedData) -> jax.Array:
        """Test features of ``models``: shared-backbone ones, or owner-grouped with per-client backbones."""
        if not models.per_client:
            return self.features(models.backbone, data, data.test_flat)
        if self.layout.step_loop == "scan":
            return self._owned_scan(models.backbone, data)
        # the chunks' features written into one buffer as they come: a concatenate of G operands took
        # XLA 45 s to compile at G = 10,000 (per-client backbones of 10,000 clients)
        g = data.owned_idx.shape[-2]
        own = self._chunks_of_own_models(models.backbone, data)
        if own is None:
            feats = self._owned_rows.stack((self._owned_chunk(models.backbone, data, np.int32(i)) for i in range(g)), g)
        else:   # the chunks of clients still at the base read the base's features, computed once for all
            feats = self._base_owned(self.features(models.backbone.base, data, data.test_flat), data)
            for i in own:
                feats = self._owned_rows.put(feats, self._owned_chunk(models.backbone, data, np.int32(i)), i)
        lead = feats.shape[:-3]
        return feats.reshape(lead + (g * feats.shape[-2], feats.shape[-1]))

    def _chunks_of_own_models(self, backbones, data: FederatedData) -> np.ndarray | None:
        """Of per-client backbones kept as a ClientRows (one repetition), the owner chunks whose client
        has a row of its own, where at least ``BASE_PASS_SHARE`` of the chunks belong to clients without
        one (they all read the base, whose features one shared pass computes); ``None`` otherwise:
        every chunk with its owner's backbone."""
        if not client_rows.is_client_rows(backbones) or self.reps is not None:
            return None
        owners = np.asarray(data.owned_chunk)
        own = np.flatnonzero(np.asarray(backbones.slot)[owners] >= 0)
        return own if len(owners) - len(own) >= max(BASE_PASS_SHARE * len(owners), 1) else None

    def evaluate(self, state, data: FederatedData, key: jax.Array, *, personalize: bool = False) -> dict:
        """Every metric of an evaluation of all K clients, as device values (see
        :mod:`pfedkdh_jax.engine.evaluate`); ``personalize`` asks for a personalization that does not
        run at every evaluation (pFedKDH-EA)."""
        self._check_clients(state, data, "RoundRunner.evaluate")
        return evaluation(self, self.algo.personalization, state, data, self.place(key), personalize)

    def adapted_on_images(self, state, data: FederatedData, key: jax.Array):
        """The personalized models after the personalization's local problem for all K clients."""
        if self.fused:
            return self._personal_fused(state, data, key)
        k, clients = data.num_clients, adapted_clients(data)
        ids = np.arange(k) if clients is None else clients
        everyone = ids if self.reps is None else np.broadcast_to(ids, (self.reps, len(ids)))
        if self.layout.client_parallel == "vmap":
            finals = self._personal.run_all(state, None, data, everyone, key, self.place)
        else:
            finals = self._personal_rows.stack(self._personal.run_each(state, None, data, everyone, key, self.place,
                                                                       self.spread), everyone.shape[-1])
        params = finals.params if clients is None else spread_to_all(finals.params, clients, k, 0 if self.reps is None else 1)
        return self._personal_models(state, params)


class PhasedRunner:
    """The runners of an algorithm's phases (one :class:`RoundRunner` each), chosen by the round.

    At the first round of a phase after the first, the phase's ``enter`` prepares the state (compiled
    once; its key is the round key folded with a phase tag, so a resumed run enters identically).
    With a single phase it is that phase's runner.
    """

    def __init__(self, algo: Algorithm, data: FederatedData, layout: Layout = Layout(), *,
                 reps: int | None = None, mesh: jax.sharding.Mesh | None = None, hparams: dict | None = None,
                 workload: Workload | None = None, donate_state: bool = False):
        check_algorithm(algo, "PhasedRunner(algo, ...)")
        check_data(data, "PhasedRunner(algo, data)")
        self.phases, self.name = algo.phases, type(algo).__name__
        if hparams is not None and len(self.phases) > 1:
            raise ValueError("stacked hyperparameter values need a method of one phase")
        if any(p.rounds is None for p in self.phases[:-1]):
            raise ValueError("only the last phase may run 'every remaining round' (rounds=None)")
        self.starts = phase_starts(self.phases)
        self.runners = [RoundRunner(p.algorithm, data, layout, reps=reps, mesh=mesh, hparams=hparams,
                                    workload=self._phase_workload(workload, i), donate_state=donate_state)
                        for i, p in enumerate(self.phases)]
        self._enter = []
        for p in self.phases:
            fn = p.enter
            if fn is not None and reps is not None:
                fn = jax.vmap(fn, in_axes=(0, data_axes(data), 0))
            self._enter.append(jax.jit(fn) if fn is not None else None)

    def _phase_workload(self, workload: Workload | None, i: int) -> Workload | None:
        """The part of ``workload`` that phase ``i`` runs (its rounds; the evaluations fall in the last)."""
        if workload is None or len(self.phases) == 1:
            return workload
        end = self.phases[i].rounds
        rounds = max(0, min(workload.rounds - self.starts[i], workload.rounds if end is None else end))
        last = i == len(self.phases) - 1
        return Workload(rounds, workload.clients_per_round, workload.evaluations if last else 0)

    @property
    def layout(self) -> Layout:
        return self.runners[0].layout

    @property
    def traces(self) -> collections.Counter:
        if len(self.runners) == 1:
            return self.runners[0].traces
        out = collections.Counter()
        for i, r in enumerate(self.runners):
            out.update({f"phase{i + 1}/{k}": v for k, v in r.traces.items()})
        return out

    def phase(self, t: int) -> int:
        """The phase of round ``t`` (0-based): the last one whose first round is at most ``t``."""
        return phase_at(self.starts, t)

    def place(self, tree):
        return self.runners[0].place(tree)

    def prepare(self, state, data: FederatedData, key: jax.Array, algo: Algorithm | None = None):
        return self.runners[0].prepare(state, data, key, algo)

    def round(self, state, data: FederatedData, selected: np.ndarray, key: jax.Array, t: int):
        """Round ``t`` with its phase's runner (entering the phase first at its first round)."""
        i = self.phase(t)
        if i > 0 and t == self.starts[i] and self._enter[i] is not None:
            state = self._enter[i](state, data, self.place(_phase_key(key, i)))
        return self.runners[i].round(state, data, selected, key)

    def evaluate(self, state, data: FederatedData, key: jax.Array, t: int, *, personalize: bool = False) -> dict:
        """``state`` scored by the runner of round ``t``'s phase (``t``: the 0-based round just run, as
        :meth:`round` takes it; a :class:`RoundRunner`'s ``evaluate`` has no ``t``). ``personalize``
        reaches the phases whose algorithm has a personalization (see :attr:`personalizes`); with none
        it is a ValueError."""
        if personalize and not self.personalizes:
            raise ValueError(f"personalize=True: {self.name} has no personalization step in any phase, so there "
                             f"are no *_ea metrics to add; evaluate without it")
        return self.runners[self.phase(t)].evaluate(state, data, key, personalize=self.personalizes_at(t)
                                                    and personalize)

    @functools.cached_property
    def _personal_phases(self) -> tuple[bool, ...]:
        return tuple(r.algo.personalization is not None for r in self.runners)

    @property
    def personalizes(self) -> bool:
        """Whether some phase's algorithm has a personalization (what ``evaluate(...,
        personalize=True)`` asks for; the phases without one score without it)."""
        return any(self._personal_phases)

    def personalizes_at(self, t: int) -> bool:
        """Whether round ``t``'s phase has a personalization."""
        return self._personal_phases[self.phase(t)]


def phase_starts(phases) -> list[int]:
    """The first round of each phase (0-based; every phase but the last has its count of rounds)."""
    return [sum(p.rounds for p in phases[:i]) for i in range(len(phases))]


def phase_at(starts: list[int], t: int) -> int:
    """The phase of round ``t``: the last one whose first round is at most ``t``."""
    return max(i for i, start in enumerate(starts) if t >= start)


def _phase_key(key: jax.Array, phase: int) -> jax.Array:
    fold = jax.vmap(jax.random.fold_in, in_axes=(0, None)) if key.ndim else jax.random.fold_in
    return fold(key, (1 << 22) + phase)


__all__ = ["RoundRunner", "PhasedRunner", "sample_schedule", "max_local_steps"]
