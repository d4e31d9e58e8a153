"""Balanced local work: a round's (run, client) jobs packed into a fixed number of lanes.

With clients vmapped, every selected client is given as many steps as the largest one, and the steps
past its own are masked no-ops: at α = 0.05 on MNIST a round computes about three times the useful
sample-steps (experiments/useful_work.py). ``make_packed_round(algo, layout)`` with ``layout.lanes = L``
instead runs the ``J = R·C`` jobs of a round (R stacked runs, C selected clients each) in ``L`` lanes:

1. every job starts (``client_start``, vmapped over runs and clients), giving a stack ``[J + 1, ...]``
   of local states (the last, an idle slot of zero samples);
2. :func:`pack_jobs` assigns the jobs to lanes, longest first, each to the least loaded lane, so a
   lane's jobs run one after another and the lanes end at nearly the same step;
3. a loop of as many steps as the longest lane (a traced count, so no shape depends on the selection
   and nothing recompiles): at step ``t`` each lane gathers the local state of the job it holds at
   ``t`` (or the idle slot), the ``L`` states take one step together (vmapped), and go back to the
   stack;
4. every job finishes (``client_finish``) and each run's server update follows, vmapped over runs.

A job takes exactly the steps it takes in the unpacked round, from the same state with the same keys,
so the results are the unpacked round's up to float rounding (tests check it). The computed
sample-steps are ``L`` times the longest lane instead of ``J`` times the longest job; the round's
metrics report both counts (``packing_useful_steps``, ``packing_computed_steps``). The step loop is a
``lax.while_loop``: the layout for accelerators (``vmap`` + ``scan``), not for XLA:CPU, where a
convolution inside a loop is slow and clients run one after another anyway.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from pfedkdh_jax.engine.protocol import Algorithm, server_step_result
from pfedkdh_jax.data.device import FederatedData, data_axes
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.round import LocalProblem, RoundPieces

PyTree = Any


def pack_jobs(steps: jax.Array, lanes: int) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Longest-first greedy packing of jobs into ``lanes`` lanes (pure, jittable).

    ``steps [J]`` (int) are the jobs' step counts. Returns ``lane [J]`` (the lane of each job),
    ``start [J]`` (the lane step at which it begins) and ``loads [L]`` (each lane's total steps).
    Ties go to the lowest lane and the earlier job, so the packing is deterministic.
    """
    steps = jnp.asarray(steps, jnp.int32)
    order = jnp.argsort(-steps, stable=True)

    def place(i, carry):
        loads, lane, start = carry
        j = order[i]
        least = jnp.argmin(loads)
        return loads.at[least].add(steps[j]), lane.at[j].set(least), start.at[j].set(loads[least])

    zeros = jnp.zeros_like(steps)
    loads, lane, start = jax.lax.fori_loop(0, steps.shape[0], place,
                                           (jnp.zeros((lanes,), jnp.int32), zeros, zeros))
    return lane.astype(jnp.int32), start, loads


def lane_slots(lane: jax.Array, start: jax.Array, steps: jax.Array, lanes: int, t: jax.Array) -> jax.Array:
    """The job each lane holds at lane step ``t`` (``[L]``; ``J``, the idle slot, where none)."""
    holds = ((lane[None, :] == jnp.arange(lanes)[:, None])
             & (start[None, :] <= t) & (t < (start + steps)[None, :]))
    return jnp.where(holds.any(axis=1), jnp.argmax(holds, axis=1), steps.shape[0]).astype(jnp.int32)


def _flat(tree, lead: int):
    return jax.tree_util.tree_map(lambda a: a.reshape((lead,) + a.shape[2:]), tree)


@dataclasses.dataclass(frozen=True)
class PackedRound:
    """A round of R stacked runs with the selected clients' local work packed into lanes.

    ``(states [R], data, selected [R, C], keys [R], hparams=None) -> (states [R], metrics [R])``, pure
    and un-jitted; with ``R = 1`` it is one run's round with a leading axis of one. ``hparams``
    (``{field: [R]}``) are the runs' own plain-number hyperparameters, when they differ: each run's
    pieces, and each lane's step, use the algorithm of the run it works for (``algo.with_hparams``).
    """

    algo: Algorithm
    layout: Layout

    def algo_of(self, hp) -> Algorithm:
        """The algorithm of a run with hyperparameter values ``hp`` (``None``: the shared one)."""
        return self.algo if hp is None else self.algo.with_hparams(hp)

    def problem_of(self, hp) -> LocalProblem:
        return RoundPieces(self.algo_of(hp), self.layout).problem

    @property
    def problem(self) -> LocalProblem:
        return self.problem_of(None)

    def local_work(self, states, data: FederatedData, selected: jax.Array, keys: jax.Array, hparams=None):
        """Every job's final local state ``[R, C, ...]`` and the packing's ``(useful, computed)`` steps."""
        lanes = self.layout.lanes
        trainer = self.problem.trainer   # step counts and gates only: no hyperparameter value
        runs, per_run = selected.shape
        jobs = runs * per_run
        ctx = jax.vmap(lambda s, h: self.algo_of(h).context(s))(states, hparams)
        d = data_axes(data)   # stacked partitions: each run's clients in its own tables

        def start_run(s, dt, sel, k, h):
            return jax.vmap(self.problem_of(h).start, in_axes=(None, None, 0, None))(s, dt, sel, k)
        local = _flat(jax.vmap(start_run, in_axes=(0, d, 0, 0, 0))(states, data, selected, keys, hparams), jobs)
        steps = trainer.num_steps(local.n).astype(jnp.int32)
        lane, begin, loads = pack_jobs(steps, lanes)
        # the idle slot: a copy of job 0 with no samples (its steps are no-ops)
        stack = jax.tree_util.tree_map(lambda a: jnp.concatenate([a, a[:1]]), local)
        stack = stack.replace(n=stack.n.at[jobs].set(0))
        run_of = jnp.append(jnp.arange(jobs) // per_run, 0)
        client_of = jnp.append(selected.reshape(-1), selected[0, 0])

        def one(s, c, row, h):
            return self.problem_of(h).trainer.step(s, c, row, data, gate="cond")

        def body(carry):
            t, stack = carry
            slot = lane_slots(lane, begin, steps, lanes, t)
            held = jax.tree_util.tree_map(lambda a: a[slot], stack)
            c, h = jax.tree_util.tree_map(lambda a: a[run_of[slot]], (ctx, hparams))
            if held.row is not None:
                rows = held.row
            elif data.stacked:
                rows = data.train_idx[run_of[slot], client_of[slot]]
            else:
                rows = data.train_idx[client_of[slot]]
            new = jax.vmap(one)(held, c, rows, h)
            # only what a step changes goes back (the orders, keys, sizes and rows are read-only)
            put = lambda a, b: a.at[slot].set(b)
            return t + 1, stack.replace(**{f: jax.tree_util.tree_map(put, getattr(stack, f), getattr(new, f))
                                           for f in ("params", "opt_state", "step", "loss_sum")})

        longest = loads.max()
        _, stack = jax.lax.while_loop(lambda c: c[0] < longest, body, (jnp.zeros((), jnp.int32), stack))
        done = jax.tree_util.tree_map(lambda a: a[:jobs].reshape((runs, per_run) + a.shape[1:]), stack)
        return done, (steps.sum(), lanes * longest)

    def updates(self, states, data: FederatedData, selected: jax.Array, keys: jax.Array, hparams=None):
        """Every job's :class:`ClientUpdate` ``[R, C, ...]`` and the packing's step counts."""
        local, counts = self.local_work(states, data, selected, keys, hparams)
        if self.problem.finish is None:
            return local, counts

        def finish_run(s, dt, sel, loc, k, h):
            return jax.vmap(self.problem_of(h).finish, in_axes=(None, None, 0, 0, None))(s, dt, sel, loc, k)
        return jax.vmap(finish_run, in_axes=(0, data_axes(data), 0, 0, 0, 0))(
            states, data, selected, local, keys, hparams), counts

    def __call__(self, states, data: FederatedData, selected: jax.Array, keys: jax.Array, hparams=None):
        prepared = jax.vmap(lambda s, dt, sel, h: self.algo_of(h).round_start(s, dt, sel),
                            in_axes=(0, data_axes(data), 0, 0))(states, data, selected, hparams)
        updates, (useful, computed) = self.updates(prepared, data, selected, keys, hparams)

        def server(s, dt, sel, u, k, h):
            a = self.algo_of(h)
            return server_step_result(a, a.server_update(s, dt, sel, u, k))
        states, metrics = jax.vmap(server, in_axes=(0, data_axes(data), 0, 0, 0, 0))(
            states, data, selected, updates, keys, hparams)
        runs = selected.shape[0]
        metrics = dict(metrics, packing_useful_steps=jnp.broadcast_to(useful, (runs,)),
                       packing_computed_steps=jnp.broadcast_to(computed, (runs,)))
        return states, metrics


def make_packed_round(algo: Algorithm, layout: Layout) -> PackedRound:
    """The packed round of ``algo`` (``layout.lanes`` lanes; see the module docstring)."""
    layout = layout.resolved()
    if layout.lanes is None:
        raise ValueError("make_packed_round needs a layout with lanes set (Layout(lanes=L))")
    return PackedRound(algo, layout)
