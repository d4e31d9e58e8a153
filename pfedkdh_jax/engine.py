"""Local SGD over padded client data, and the client-parallel strategies that run it.

A *local problem* is a loss ``loss_fn(params, ctx, x, y, mask, rng) -> scalar`` minimised by an optax
transformation over minibatches of one client's samples. The client's samples are a row of pool
indices ``idx_row [M]`` (padded) with a true size ``n``; every epoch visits them in a fresh random
order (a permutation of the first ``n`` slots), in ``ceil(n / B)`` batches, the last one partial and
kept (masked). Steps past a client's own ``epochs · ceil(n / B)`` are no-ops, so clients of different
sizes share one static shape.

How the work is laid out is an explicit, measured choice (see BENCHMARKS.md):

* ``client_parallel``: ``"vmap"`` runs all selected clients in one batched computation (stacked state,
  leading client axis ``[C, ...]``); ``"sequential"`` runs them one after another with the same
  compiled function.
* ``step_loop``: ``"scan"`` loops the local steps with ``lax.scan`` inside one compiled call;
  ``"unrolled"`` compiles a chunk of ``chunk_steps`` unrolled steps once and calls it as often as
  needed, chained on the device without host synchronisation.

On XLA:CPU a convolution inside a while loop is ~15–20× slower than the same steps unrolled, so the CPU
default is sequential + unrolled; on GPU/TPU the default is vmap + scan, one compiled call per round.
All forms compute the same numbers (tests check it).
"""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any, Callable

import flax.struct as struct
import jax
import jax.numpy as jnp
import optax

PyTree = Any
GatherFn = Callable[[Any, jax.Array], tuple[jax.Array, jax.Array]]

CLIENT_PARALLEL = ("vmap", "sequential")
STEP_LOOPS = ("scan", "unrolled")


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


def steps_for(n, epochs: int, batch_size: int, max_steps: int | None = None):
    """Number of local steps of a client with ``n`` samples: ``epochs · ceil(n / B)`` (capped)."""
    if isinstance(n, int):
        s = epochs * (-(-n // batch_size))
        return s if max_steps is None else min(s, max_steps)
    s = epochs * ((n + batch_size - 1) // batch_size)
    return s if max_steps is None else jnp.minimum(s, max_steps)


@dataclasses.dataclass(frozen=True)
class LocalTrainer:
    """SGD on one local problem. Static configuration only; all methods are pure.

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
    """

    loss_fn: Callable[..., jax.Array]
    tx: optax.GradientTransformation
    gather: GatherFn
    epochs: int
    batch_size: int
    max_steps: int | None = None
    update: Callable[..., tuple] | None = None
    client_context: Callable[[PyTree, PyTree], PyTree] | None = None

    def num_steps(self, n):
        return steps_for(n, self.epochs, self.batch_size, self.max_steps)

    def init(self, params: PyTree, key: jax.Array, n: jax.Array, row_length: int,
             aux: PyTree = None) -> LocalState:
        """Local state of a client with ``n`` valid slots out of ``row_length`` (``aux``: see LocalState)."""
        slots = jnp.arange(row_length)

        def order(e):
            u = jax.random.uniform(jax.random.fold_in(key, e), (row_length,))
            return jnp.argsort(jnp.where(slots < n, u, 2.0)).astype(jnp.int32)

        perms = jax.vmap(order)(jnp.arange(self.epochs))
        return LocalState(params=params, opt_state=self.tx.init(params), perms=perms,
                          key=key, n=jnp.asarray(n, jnp.int32), step=jnp.zeros((), jnp.int32),
                          loss_sum=jnp.zeros((), jnp.float32), aux=aux)

    def step(self, state: LocalState, ctx: PyTree, idx_row: jax.Array, source: Any,
             gate: str = "cond") -> LocalState:
        """One SGD step; a no-op once the client has taken all its steps.

        ``gate`` says how the no-op is expressed: ``"cond"`` skips the work (``lax.cond``; what a
        GPU/TPU wants, and what ``vmap`` turns into a select anyway) and ``"where"`` computes the step
        and keeps the old state (XLA:CPU runs a convolution inside a conditional branch ~15× slower
        than outside one, so unrolled CPU chunks use ``"where"``).
        """
        b_size = self.batch_size
        spe = jnp.maximum((state.n + b_size - 1) // b_size, 1)
        active = state.step < self.num_steps(state.n)

        def take(s: LocalState) -> LocalState:
            epoch = jnp.minimum(s.step // spe, self.epochs - 1)
            slots = (s.step % spe) * b_size + jnp.arange(b_size)
            mask = slots < s.n
            pos = s.perms[epoch, jnp.minimum(slots, s.perms.shape[1] - 1)]
            x, y = self.gather(source, idx_row[pos])
            rng = jax.random.fold_in(jax.random.fold_in(s.key, 1 << 20), s.step)
            c = ctx if self.client_context is None else self.client_context(ctx, s.aux)
            if self.update is None:
                loss, grads = jax.value_and_grad(self.loss_fn)(s.params, c, x, y, mask, rng)
                updates, opt_state = self.tx.update(grads, s.opt_state, s.params)
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

    def run(self, state, ctx, idx_row, source, num_steps: int, step_loop: str, chunk_steps: int):
        """All ``num_steps`` inside one traced program, as a scan or as unrolled chunks."""
        if step_loop == "scan":
            return self.run_scan(state, ctx, idx_row, source, num_steps)
        return self.run_unrolled(state, ctx, idx_row, source, num_steps)


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How clients and local steps are laid out. ``None`` fields take the backend's default."""

    client_parallel: str | None = None   # "vmap" | "sequential"
    step_loop: str | None = None         # "scan" | "unrolled"
    chunk_steps: int = 16                # steps per compiled chunk when step_loop == "unrolled"

    def resolved(self, backend: str | None = None) -> "EngineConfig":
        backend = backend or jax.default_backend()
        cpu = backend == "cpu"
        cfg = dataclasses.replace(
            self,
            client_parallel=self.client_parallel or ("sequential" if cpu else "vmap"),
            step_loop=self.step_loop or ("unrolled" if cpu else "scan"))
        if cfg.client_parallel not in CLIENT_PARALLEL:
            raise ValueError(f"client_parallel must be one of {CLIENT_PARALLEL}, got {cfg.client_parallel!r}")
        if cfg.step_loop not in STEP_LOOPS:
            raise ValueError(f"step_loop must be one of {STEP_LOOPS}, got {cfg.step_loop!r}")
        if cfg.chunk_steps < 1:
            raise ValueError(f"chunk_steps must be >= 1, got {cfg.chunk_steps}")
        return cfg


# XLA:CPU option that turns off its YNNPACK library calls (on by default in jaxlib 0.10).
_YNN_OPTION = "xla_cpu_experimental_ynn_fusion_type"


def local_training_compiler_options(backend: str | None = None) -> dict | None:
    """``jax.jit`` compiler options for the compiled calls that take local SGD steps of the CNN.

    On XLA:CPU these calls compile without YNNPACK (``xla_cpu_experimental_ynn_fusion_type`` empty):
    measured on the 2-core machine, a batch-64 training step ran 1.4× (MNIST) and 2.2× (CIFAR-10)
    faster without it, while large-batch forward passes (evaluation, the teacher's D_s features) ran
    up to 3× faster *with* it on MNIST shapes (BENCHMARKS.md, "CPU: XLA's YNNPACK calls"), so those
    keep XLA's default. ``None`` (XLA's defaults) on other backends, and when the user's
    ``XLA_FLAGS`` already set the option (theirs wins).
    """
    if (backend or jax.default_backend()) != "cpu" or _YNN_OPTION in os.environ.get("XLA_FLAGS", ""):
        return None
    return {_YNN_OPTION: ""}


def num_chunks(steps: int, chunk_steps: int) -> int:
    return max(1, math.ceil(steps / chunk_steps))


def tree_stack(trees, axis: int = 0):
    """Stack a list of equally-shaped pytrees along a new axis (default: leading)."""
    return jax.tree_util.tree_map(lambda *xs: jnp.stack(xs, axis=axis), *trees)
