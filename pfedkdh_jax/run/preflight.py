"""Memory pre-flight: before anything is initialised or compiled for a run, estimate the bytes it will
hold at its peak and stop with one line when they exceed the device's.

The estimate has four terms:

* **states**: the algorithm state's bytes (from ``jax.eval_shape`` of ``init``: nothing is allocated)
  for every repetition — all repetitions' states are held, whichever ``--reps-mode`` — its shared
  part times 3 for the local copies, gradients and optimizer states of a round, its per-client part
  twice (the state and the server step's new tables) plus twice the selected clients' share;
* **updates**: the round's stacked client results (``ClientUpdate`` ``[C, ...]``, from
  ``jax.eval_shape`` of a client's start and finish; the largest over a method's phases) — the
  buffer the selected clients' uploads are written into, which dominates with a thousand clients a
  round (1,130 MNIST backbones: 2.6 GB); every repetition's when they are vmapped together. For a
  method that splits its uploads, with sequential clients, only the rests are stacked (C of them) and
  the averaged part is held once per device's running sum, plus the client in flight;
* **data**: the pool and index tables already on the device;
* **local training**: XLA's own count of the temporary buffers of one training step of the model at
  the run's batch size (``memory_analysis`` of a compiled, never-run step: about a second once per
  process and shape), times the clients that train at once (the round's clients with
  ``--client-parallel vmap``, else one) and the repetitions vmapped together.

It errs on the low side (a method's extra terms — distillation, a VAE — add to the step), so it
catches the runs that cannot fit, not every one that barely does. ``PFEDKDH_SKIP_PREFLIGHT=1``
turns it off.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp

from pfedkdh_jax.engine.client_rows import is_client_rows, tables
from pfedkdh_jax.run.config import ConfigError

MARGIN = 0.9   # of the available memory


def available_bytes() -> int | None:
    """Memory the run may use: the accelerator's limit, or the host's available memory on a CPU."""
    device = jax.local_devices()[0]
    if device.platform != "cpu":
        stats = device.memory_stats() or {}
        limit = stats.get("bytes_limit")
        return int(limit - stats.get("bytes_in_use", 0)) if limit else None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def _tree_bytes(tree) -> int:
    return int(sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(tree)))


def step_temp_bytes(num_classes: int, input_shape: tuple, batch: int, model=None, input_dtype=jnp.float32) -> int:
    """Temporary bytes of one SGD step of the run's model (``None``: the CNN) on a batch of
    ``input_dtype`` inputs (the data's: integer token ids stay integer), as XLA's buffer assignment
    counts them."""
    from pfedkdh_jax.model import CNN
    if model is None or isinstance(model, CNN):
        return _cnn_step_temp_bytes(num_classes, input_shape, batch)
    return _step_temp_bytes(model, input_shape, batch, input_dtype)


@functools.lru_cache(maxsize=16)
def _cnn_step_temp_bytes(num_classes: int, input_shape: tuple, batch: int) -> int:
    from pfedkdh_jax.model import CNN
    return _step_temp_bytes(CNN(num_classes), input_shape, batch)


def _step_temp_bytes(model, input_shape: tuple, batch: int, input_dtype=jnp.float32) -> int:
    from pfedkdh_jax.engine.protocol import logits

    def step(params, x, y):
        def loss(p):
            logp = jax.nn.log_softmax(logits(model, p, x))
            return -jnp.mean(jnp.take_along_axis(logp, y[:, None], axis=1))
        g = jax.grad(loss)(params)
        return jax.tree_util.tree_map(lambda a, b: a - 0.1 * b, params, g)

    params = jax.eval_shape(lambda k: model.init(k, input_shape), jax.random.key(0))
    compiled = jax.jit(step).lower(params, jax.ShapeDtypeStruct((batch, *input_shape), input_dtype),
                                   jax.ShapeDtypeStruct((batch,), jnp.int32)).compile()
    analysis = compiled.memory_analysis()
    return int(analysis.temp_size_in_bytes) if analysis is not None else 0


def _dense_per_client(state, num_clients: int) -> list:
    """The state's leaves with a leading axis of ``num_clients`` (outside any ClientRows)."""
    return [x for x in jax.tree_util.tree_leaves(state, is_leaf=is_client_rows)
            if not is_client_rows(x) and x.ndim and x.shape[0] == num_clients]


def per_client_bytes(state, num_clients: int) -> int:
    """Bytes of the state's per-client leaves: those with a leading axis of ``num_clients`` (heads,
    personal models, per-client optimizer states) and every
    :class:`~pfedkdh_jax.engine.client_rows.ClientRows`' rows and row map."""
    return int(sum(x.size * x.dtype.itemsize for x in _dense_per_client(state, num_clients))
               + sum(_tree_bytes((t.rows, t.slot)) for t in tables(state)))


def row_bytes(state) -> int:
    """Bytes of one row of the state's ClientRows (0: none)."""
    return int(sum(_tree_bytes(t.rows) // t.capacity for t in tables(state)))


def selected_bytes(state, num_clients: int, clients: int) -> int:
    """Bytes of what ``clients`` selected clients hold of the per-client state (a row each)."""
    return int(clients * (sum(x.size * x.dtype.itemsize for x in _dense_per_client(state, num_clients)) // num_clients
                          + row_bytes(state)))


def update_bytes(algo, state, data, clients: int = 1, sums: int | None = None) -> tuple[int, int]:
    """``(per client, round)``: bytes of what one client's round result leaves in the round's buffer,
    and of the round's ``clients`` results, the largest over ``algo``'s phases; ``state`` as
    ``jax.eval_shape`` gives it (nothing is computed). A client's result is its whole ``ClientUpdate``
    (parameters, loss, aux); with ``sums`` (the running sums of sequential clients, one per device)
    and a method that splits its uploads, only its rest, the averaged part counted ``sums + 1`` times
    (each sum and the client in flight). With stacked partitions, one run's (every run's slice has
    one shape)."""
    from pfedkdh_jax.data.device import run_slice
    from pfedkdh_jax.engine.protocol import client_update_shape, splits_uploads

    one = run_slice(data, 0)
    out = []
    for p in algo.phases:
        shape = client_update_shape(p.algorithm, state, one, jax.random.key(0))
        if sums is None or not splits_uploads(p.algorithm):
            out.append((_tree_bytes(shape), clients * _tree_bytes(shape)))
            continue
        averaged, rest = jax.eval_shape(p.algorithm.mean_upload, shape)
        out.append((_tree_bytes(rest), clients * _tree_bytes(rest) + (sums + 1) * _tree_bytes(averaged)))
    return max(out, key=lambda t: t[1])


def estimate(cfg, algo, data, layout, batched_reps: bool) -> dict:
    """The four terms (bytes) and their sum. A state's shared part counts 3× (the round's local
    copies, gradients and optimizer states); its per-client part twice (the state's and the one the
    server step writes: Ditto at K = 1,000 peaked 2.3 GB higher with 1,000 models of 2.3 MB than with
    500), plus twice the selected clients' share of it; the round's updates once per selected client."""
    state = jax.eval_shape(lambda k: algo.init(k, data), jax.random.key(0))
    per_client = per_client_bytes(state, data.num_clients)
    shared = _tree_bytes(state) - per_client
    states = cfg.reps * (3 * shared + 2 * per_client + 2 * selected_bytes(state, data.num_clients, cfg.clients_per_round))
    sequential = layout.client_parallel == "sequential"
    one_update, round_updates = update_bytes(algo, state, data, cfg.clients_per_round,
                                             (layout.client_devices or 1) if sequential else None)
    # one buffer per round in flight: every repetition's when they are vmapped together, else one
    updates = (cfg.reps if batched_reps else 1) * round_updates
    data_bytes = _tree_bytes(data)
    together = (cfg.clients_per_round if layout.client_parallel == "vmap" else 1) * (cfg.reps if batched_reps else 1)
    step = step_temp_bytes(data.num_classes, tuple(data.input_shape), cfg.batch_size,
                           getattr(algo, "model", None), data.input_dtype) * together
    return {"states": states, "updates": updates, "data": data_bytes, "local_training": step,
            "total": states + updates + data_bytes + step, "clients_at_once": together,
            "per_client": per_client // data.num_clients, "per_update": one_update, "row": row_bytes(state)}


def check(cfg, algo, data, layout, batched_reps: bool, available: int | None = None) -> dict | None:
    """Raise :class:`ConfigError` (one line saying what to lower) when the estimate exceeds
    ``MARGIN`` of ``available`` (default: :func:`available_bytes`); return the estimate."""
    if os.environ.get("PFEDKDH_SKIP_PREFLIGHT") == "1":
        return None
    est = estimate(cfg, algo, data, layout, batched_reps)
    available = available_bytes() if available is None else available
    if available is None or est["total"] <= MARGIN * available:
        return est
    gb = lambda b: f"{b / 2 ** 30:.1f} GiB" if b >= 2 ** 30 else f"{b / 2 ** 20:.1f} MiB"  # noqa: E731
    biggest = max(("states", "updates", "local_training", "data"), key=lambda k: est[k])
    k = cfg.num_clients
    per_client_total = cfg.reps * est["per_client"] * (2 * k + 2 * cfg.clients_per_round)
    client_bound = per_client_total > est["states"] / 2   # per-client state dominates
    fit = int(max(MARGIN * available - est["data"] - est["local_training"] - est["updates"], 0)
              // max(cfg.reps * est["per_client"] * (2 + 2 * cfg.clients_per_round / k), 1))
    advice = {
        "states": (f"fewer --rounds or clients per round: {cfg.method} keeps {gb(est['row'])} for every client "
                   f"a run trains, up to rounds × clients per round = {cfg.rounds * cfg.clients_per_round}"
                   if est["row"] and client_bound else
                   f"fewer --clients: {cfg.method} keeps {gb(est['per_client'])} per client "
                   f"(about {fit} clients fit)" if client_bound else
                   f"fewer --reps ({cfg.reps} states of {gb(est['states'] / cfg.reps)} each are held)"),
        "updates": ("fewer --" + ("reps or --" if batched_reps else "") + "clients-per-round (or a lower "
                    f"--participation): each of the round's {cfg.clients_per_round} clients returns "
                    f"{gb(est['per_update'])}" + (f" in each of {cfg.reps} repetitions" if batched_reps else "")),
        "local_training": (f"a smaller --batch-size ({cfg.batch_size})"
                           + (", --client-parallel sequential" if layout.client_parallel == "vmap" else "")
                           + (", --reps-mode sequential" if batched_reps else "")),
        "data": "a smaller dataset or --aux-size",
    }[biggest]
    raise ConfigError(f"this run needs about {gb(est['total'])} of memory (states {gb(est['states'])}, round's "
                      f"updates {gb(est['updates'])}, local "
                      f"training {gb(est['local_training'])} for {est['clients_at_once']} client(s) at once, data "
                      f"{gb(est['data'])}) but {gb(available)} is available; try {advice} "
                      "(PFEDKDH_SKIP_PREFLIGHT=1 skips this check)")
