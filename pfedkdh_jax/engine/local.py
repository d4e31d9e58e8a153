"""Local SGD over padded client data: the one training loop every method runs on.

A *local problem* is a loss ``loss_fn(params, ctx, x, y, mask, rng) -> scalar`` minimised by an optax
transformation over minibatches of one client's samples. The client's samples are a row of pool
indices ``idx_row [M]`` (padded) with a true size ``n``; every epoch visits them in a fresh random
order (a permutation of the first ``n`` slots), in ``ceil(n / B)`` batches, the last one partial and
kept (masked). Steps past a client's own ``epochs · ceil(n / B)`` are no-ops, so clients of different
sizes share one static shape. How the steps of several clients are laid out (vmapped or one after
another; a scan or unrolled chunks) is :mod:`pfedkdh_jax.engine.layout`'s choice.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import flax.struct as struct
import jax
import jax.numpy as jnp
import numpy as np
import optax

PyTree = Any
GatherFn = Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]

@struct.dataclass
class LocalState:
    """One client's local training state (or ``[C, ...]`` stacked for C clients)."""

    params: PyTree          # the trainable parameters
    opt_state: PyTree       # optax state of ``params``
    perms: jax.Array        # int32 [E, M]: slot order of each epoch (valid slots first)
    key: jax.Array          # the client's key for this round (dropout, shuffling)
    n: jax.Array            # int32 []: the client's number of samples
    step: jax.Array         # int32 []: local steps taken so far
    loss_sum: jax.Array     # float32 []: sum of the losses of the steps taken
    aux: PyTree = None      # carried unchanged by training: values client_start hands to server_update
    row: jax.Array | None = None  # int32 [M]: the client's own sample row, when its problem draws one
                                  # (None: its train split, ``data.train_idx[k]``)


def steps_for(n, epochs: int, batch_size: int, max_steps: int | None = None):
    """Number of local steps of a client with ``n`` samples: ``epochs · ceil(n / B)`` (capped)."""
    if isinstance(n, int):
        s = epochs * (-(-n // batch_size))
        return s if max_steps is None else min(s, max_steps)
    s = epochs * ((n + batch_size - 1) // batch_size)
    return s if max_steps is None else jnp.minimum(s, max_steps)


def _plain_update(tx, grads, opt_state, params):
    """``tx.update(grads, opt_state, params)``; an optimizer whose update needs more (optax's extra
    arguments: ``value=`` of ``reduce_on_plateau``, ``value_fn=`` of ``lbfgs``) is a one-line TypeError."""
    try:
        return tx.update(grads, opt_state, params)
    except TypeError as e:
        if "required" not in str(e) or "argument" not in str(e):
            raise
        raise TypeError(f"the optimizer's update needs arguments local training does not pass ({e}): a step gives "
                        "it (grads, state, params) only, so optimizers such as optax.contrib.reduce_on_plateau "
                        "(value=) and optax.lbfgs (value=, grad=, value_fn=) cannot be a method's optimizer") from None


@dataclasses.dataclass(frozen=True)
class LocalTrainer:
    """Minibatch training of one local problem by an optax optimizer (``tx``). Static configuration
    only; all methods are pure.

    Attributes:
      loss_fn: ``(params, ctx, x, y, mask, rng) -> scalar`` masked-mean loss of a batch.
      tx: the optax optimizer of ``params``.
      gather: ``(source, indices [B]) -> (x, y)`` that fetches a batch from the data source.
      epochs: epochs over the client's samples (also the number of permutations drawn).
      batch_size: B.
      max_steps: optional cap on the number of steps (a fixed-step problem such as head adaptation).
      update: optional step rule ``(params, opt_state, ctx, x, y, mask, rng) -> (loss, params,
        opt_state)`` replacing the default "gradient of ``loss_fn``, then ``tx``" (for updates that are
        not one gradient step, e.g. pFedMe's inner solve or a projected step).
      client_context: optional ``(ctx, aux) -> ctx`` giving the loss (and ``update``) what belongs to
        the client itself next to the shared context: ``aux`` is the client's ``LocalState.aux``
        (e.g. its label distribution, for class-aware distillation). ``None``: the loss sees ``ctx``.
      gather_context: batches are ``gather(source, indices, ctx)``: drawn from the context too (e.g.
        FedFed's shared pool of features next to the client's own images).
      width: the slots a step computes (``None``: ``batch_size``). A client whose batches hold at most
        ``width`` samples (``min(n, batch_size) <= width``) takes the same steps on fewer computed
        slots: the host runner gives each step the width of its batch (:func:`step_widths`), so a
        7-sample client does not cost a 64-sample batch. Too narrow a width would drop samples: the
        caller guarantees the bound (the steps are the same; only dropout masks, drawn per slot,
        differ from a full-width step's).
    """

    loss_fn: Callable[..., jax.Array]
    tx: optax.GradientTransformation
    gather: GatherFn
    epochs: int
    batch_size: int
    max_steps: int | None = None
    update: Callable[..., tuple] | None = None
    client_context: Callable[[PyTree, PyTree], PyTree] | None = None
    gather_context: bool = False
    width: int | None = None

    def num_steps(self, n):
        return steps_for(n, self.epochs, self.batch_size, self.max_steps)

    def init(self, params: PyTree, key: jax.Array, n: jax.Array, row_length: int,
             aux: PyTree = None, row: jax.Array | None = None) -> LocalState:
        """Local state of a client with ``n`` valid slots out of ``row_length`` (``aux``, ``row``: see
        :class:`LocalState`; a given ``row`` has ``row_length`` slots)."""
        slots = jnp.arange(row_length)

        def order(e):
            u = jax.random.uniform(jax.random.fold_in(key, e), (row_length,))
            return jnp.argsort(jnp.where(slots < n, u, 2.0)).astype(jnp.int32)

        perms = jax.vmap(order)(jnp.arange(self.epochs))
        return LocalState(params=params, opt_state=self.tx.init(params), perms=perms,
                          key=key, n=jnp.asarray(n, jnp.int32), step=jnp.zeros((), jnp.int32),
                          loss_sum=jnp.zeros((), jnp.float32), aux=aux, row=row)

    def step(self, state: LocalState, ctx: PyTree, idx_row: jax.Array, source: Any,
             gate: str = "cond") -> LocalState:
        """One SGD step; a no-op once the client has taken all its steps.

        ``gate`` says how the no-op is expressed: ``"cond"`` skips the work (``lax.cond``; what a
        GPU/TPU wants, and what ``vmap`` turns into a select anyway) and ``"where"`` computes the step
        and keeps the old state (XLA:CPU runs a convolution inside a conditional branch ~15× slower
        than outside one, so unrolled CPU chunks use ``"where"``).
        """
        b_size = self.batch_size
        width = b_size if self.width is None else self.width
        spe = jnp.maximum((state.n + b_size - 1) // b_size, 1)
        active = state.step < self.num_steps(state.n)

        def take(s: LocalState) -> LocalState:
            epoch = jnp.minimum(s.step // spe, self.epochs - 1)
            slots = (s.step % spe) * b_size + jnp.arange(width)
            mask = slots < s.n
            pos = s.perms[epoch, jnp.minimum(slots, s.perms.shape[1] - 1)]
            c = ctx if self.client_context is None else self.client_context(ctx, s.aux)
            x, y = self.gather(source, idx_row[pos], c) if self.gather_context else self.gather(source, idx_row[pos])
            rng = jax.random.fold_in(jax.random.fold_in(s.key, 1 << 20), s.step)
            if self.update is None:
                loss, grads = jax.value_and_grad(self.loss_fn)(s.params, c, x, y, mask, rng)
                updates, opt_state = _plain_update(self.tx, grads, s.opt_state, s.params)
                params = optax.apply_updates(s.params, updates)
            else:
                loss, params, opt_state = self.update(s.params, s.opt_state, c, x, y, mask, rng)
            return s.replace(params=params, opt_state=opt_state, step=s.step + 1,
                             loss_sum=s.loss_sum + loss)

        if gate == "where":
            new = take(state)
            return jax.tree_util.tree_map(lambda a, b: jnp.where(active, a, b), new, state)
        return jax.lax.cond(active, take, lambda s: s, state)

    def run_unrolled(self, state, ctx, idx_row, source, num_steps: int) -> LocalState:
        """``num_steps`` steps unrolled in the traced program (one compiled chunk)."""
        for _ in range(num_steps):
            state = self.step(state, ctx, idx_row, source, gate="where")
        return state

    def run_scan(self, state, ctx, idx_row, source, num_steps: int) -> LocalState:
        """``num_steps`` steps in a ``lax.scan``."""
        def body(s, _):
            return self.step(s, ctx, idx_row, source, gate="cond"), None
        return jax.lax.scan(body, state, None, length=num_steps)[0]

    def run(self, state, ctx, idx_row, source, num_steps: int, step_loop: str):
        """``num_steps`` steps inside one traced program, as a scan or unrolled."""
        if step_loop == "scan":
            return self.run_scan(state, ctx, idx_row, source, num_steps)
        return self.run_unrolled(state, ctx, idx_row, source, num_steps)


def slot_width(samples: int, batch_size: int, granule: int = 8) -> int:
    """The slots a step holding ``samples`` samples computes: ``min(samples, batch_size)`` rounded up
    to a multiple of ``granule`` (at most ``batch_size``), or exactly that many below one granule. A
    batch of 39 computes 40 slots, one of 5 computes 5 (not 64): a step costs about a fixed part
    plus a part per slot, and for clients of a handful of samples (thousands of clients) the slots
    are most of it. The widths stay few (at most ``granule − 1 + batch_size / granule``; each piece
    compiles once per width a run meets)."""
    need = min(max(int(samples), 1), batch_size)
    if need < granule:
        return need
    return min(-(-need // granule) * granule, batch_size)


def step_widths(samples, epochs: int, batch_size: int, granule: int | None,
                max_steps: int | None = None, kept: frozenset | None = None) -> list[int | None]:
    """The slots each local step computes, for clients visiting ``samples`` (host ints) samples an
    epoch that take their steps together (one client, or one per repetition): step ``s`` of a
    client holds ``min(B, n − (s mod ceil(n/B))·B)`` samples, its last batch of an epoch partial;
    the width of a step is the largest :func:`slot_width` of the clients still training at it.
    ``None`` for a full batch (and every step when ``granule`` is ``None``). A 100-sample client's
    epoch is a step of 64 slots and one of 40, not two of 64. ``kept``: the only narrow widths
    allowed (:func:`paying_widths`); a step needing another computes the next wider one kept, or a
    full batch."""
    sizes = [max(int(n), 0) for n in samples]
    counts = [steps_for(n, epochs, batch_size, max_steps) for n in sizes]
    out: list[int | None] = []
    for s in range(max(counts, default=0)):
        if granule is None:
            out.append(None)
            continue
        need = 0
        for n, c in zip(sizes, counts):
            if s < c:
                spe = max(-(-n // batch_size), 1)
                need = max(need, min(batch_size, n - (s % spe) * batch_size))
        w = slot_width(need, batch_size, granule)
        if kept is not None and w < batch_size:
            w = min((k for k in kept if k >= w), default=batch_size)
        out.append(None if w >= batch_size else w)
    return out


def compile_cost(steps: int) -> float:
    """What compiling a piece of ``steps`` unrolled local steps costs, in full-batch steps run: on
    the 2-core CPU (MNIST CNN, batch 64) one step compiled in 0.74 s and a chunk of 8 in 2.56 s,
    while a full step ran in 17.4 ms: about 30 + 14·steps (BENCHMARKS.md, "Widths that pay, uploads
    written in place, and the scaling benchmark")."""
    return 30.0 + 14.0 * steps


# What running a client of a few steps as one compiled call saves a visit, in full-batch steps: the
# calls between its pieces (start, each run of steps, finish). Measured on a 2-core CPU against a
# 25.8 ms full step: 0.6-1.0 ms a client with 1,000 random-image clients of 3 train samples a round
# (3.5-3.9 -> 2.9-3.1 s), 1.5 ms in MNIST rounds of 1,130 clients of ~4 (6.29 -> 4.59 s; BENCHMARKS.md,
# "Clients of a few steps as one compiled call"); the lower figure is taken
FUSED_SAVING = 0.023


def fused_plan_pays(visits: float, steps: int) -> bool:
    """Whether a one-call client of ``steps`` steps pays for its compile (about a piece of as many
    steps, :func:`compile_cost`) when clients with its step plan train ``visits`` times over the run
    in all (``FUSED_SAVING`` full steps saved a visit)."""
    return visits * FUSED_SAVING >= compile_cost(steps)


def paying_widths(samples, visits: float, epochs: int, batch_size: int, granule: int,
                  max_steps: int | None, chunk_steps: int) -> frozenset:
    """The narrow widths (:func:`step_widths`) worth compiling for clients of ``samples`` samples
    an epoch (host ints, one per client) that each train about ``visits`` times over a run.

    A step on ``w`` slots instead of a full batch saves about ``1 − w/B`` of a full step (measured:
    24 and 40 slots ran in 36 % and 58 % of a 64-slot step), while each width compiles its own
    pieces once (:func:`compile_cost`: a single step is worth about 44 full steps, a chunk of 8
    about 140). A width is kept when its expected saving over the run covers its compiles, so a
    short run (a smoke test, 2 rounds) computes full batches and compiles nothing more, and a long
    run of many small clients narrows every width it meets."""
    sizes, counts = np.unique(np.asarray(samples, np.int64).ravel(), return_counts=True)
    saved: dict[int, float] = {}
    pieces: dict[int, set] = {}
    for n, count in zip(sizes, counts):
        for w, steps in width_runs(step_widths([int(n)], epochs, batch_size, granule, max_steps)):
            if w is None:
                continue
            saved[w] = saved.get(w, 0.0) + float(count) * visits * steps * (1.0 - w / batch_size)
            need = pieces.setdefault(w, set())
            if steps >= chunk_steps:
                need.add(chunk_steps)
            if steps % chunk_steps:
                need.add(1)
    return frozenset(w for w, s in saved.items() if s >= sum(compile_cost(p) for p in pieces[w]))


def width_runs(widths: list[int | None]) -> list[tuple[int | None, int]]:
    """``widths`` as runs ``[(width, steps), ...]`` of consecutive equal widths."""
    runs: list[tuple[int | None, int]] = []
    for w in widths:
        if runs and runs[-1][0] == w:
            runs[-1] = (w, runs[-1][1] + 1)
        else:
            runs.append((w, 1))
    return runs


def mean_loss(state: LocalState) -> jax.Array:
    """The mean loss of the steps a client took (0 if none)."""
    return state.loss_sum / jnp.maximum(state.step, 1)


def tree_stack(trees, axis: int = 0):
    """Stack a list of equally-shaped pytrees along a new axis (default: leading)."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs, axis=axis), *trees)
