"""A federated round of any algorithm as pure functions: ``make_round(algo, layout)``.

``round_fn = make_round(algo, layout)`` is ``(state, data, selected [C], key) -> (state, metrics)``,
un-jitted: jit it, vmap it over a repetition axis or shard it inside your own program. Inside, every
selected client starts (``client_start``, from the state as ``round_start`` prepared it), takes all
its local steps, and finishes (``client_finish``); the updates, stacked ``[C, ...]``, go to
``server_update``. The layout says how:
clients ``vmap``-ed or one after another (``lax.map``), steps in a ``lax.scan`` or unrolled. Every
client is given as many steps as the largest client of the federation (``data.train_sizes``, static);
steps past a client's own are no-ops, so nothing retraces whoever is selected.

The pieces (:class:`RoundPieces`) are pure too; :class:`~pfedkdh_jax.engine.runner.RoundRunner`,
the CLI's host loop, calls them one by one on layouts where one compiled program per round is not the
fastest (on XLA:CPU, unrolled chunks of steps called from the host).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, StateError, check_algorithm, check_pieces, server_step_result
from pfedkdh_jax.data.device import FederatedData, check_data
from pfedkdh_jax.engine.layout import Layout, local_training_compiler_options
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.sharding import per_device

PyTree = Any


def max_local_steps(trainer: LocalTrainer, data: FederatedData, samples=lambda n: n) -> int:
    """Steps of the largest client of ``data`` (a static count, from ``data.train_sizes``); ``samples``:
    how many samples a client of n train samples visits per epoch in this problem."""
    return int(trainer.num_steps(samples(max(data.train_sizes))))


@dataclasses.dataclass(frozen=True)
class LocalProblem:
    """One local problem laid out: how a client starts, trains and finishes (pure pieces).

    The round's problem is the algorithm's (``trainer``, ``client_start``, ``client_finish``); a
    personalization that trains on the images is another (no finish: its parameters are the result).
    """

    trainer: LocalTrainer
    start: Any                      # (state, data, client, key) -> LocalState
    finish: Any = None              # (state, data, client, local, key) -> ClientUpdate, or None
    step_loop: str = "scan"
    samples: Any = None             # n_k -> samples visited per epoch (host ints; None: n_k)

    def narrowed(self, width: int) -> "LocalProblem":
        """The same problem computing ``width`` slots a step (``LocalTrainer.width``)."""
        return dataclasses.replace(self, trainer=dataclasses.replace(self.trainer, width=width))

    def size(self, n: int) -> int:
        return n if self.samples is None else self.samples(n)

    def max_steps(self, data: FederatedData) -> int:
        return max_local_steps(self.trainer, data, self.size)

    def train(self, local: LocalState, ctx: PyTree, data: FederatedData, client: jax.Array,
              num_steps: int) -> LocalState:
        """``num_steps`` steps of one client over its row (its train split, or the row its start drew)."""
        row = data.train_idx[client] if local.row is None else local.row
        return self.trainer.run(local, ctx, row, data, num_steps, self.step_loop)

    def client(self, state, ctx, data: FederatedData, client: jax.Array, key: jax.Array, num_steps: int):
        """One client from start to finish (its update, or its final local state without a finish)."""
        return self.client_in_runs(state, ctx, data, client, key, ((None, num_steps),))

    def client_in_runs(self, state, ctx, data: FederatedData, client: jax.Array, key: jax.Array, runs):
        """:meth:`client` with its steps in ``runs`` ``((width, steps), ...)``: each run's steps on
        ``width`` slots (``None``: the trainer's full batch), as a host plan lays them out."""
        local = self.start(state, data, client, key)
        for width, count in runs:
            local = (self if width is None else self.narrowed(width)).train(local, ctx, data, client, count)
        return local if self.finish is None else self.finish(state, data, client, local, key)

    def clients(self, state, ctx, data: FederatedData, clients: jax.Array, key: jax.Array,
                num_steps: int, client_parallel: str):
        """Every client of ``clients [C]``, stacked ``[C, ...]``: vmapped, or one after another."""
        def one(k):
            return self.client(state, ctx, data, k, key, num_steps)
        if client_parallel == "vmap":
            return jax.vmap(one)(clients)
        return jax.lax.map(one, clients)


@dataclasses.dataclass(frozen=True)
class RoundPieces:
    """The pure pieces of a round of ``algo`` with ``layout`` (resolved); calling it is the round.

    ``trace_scan``: the step loop was left to the backend; called inside a trace (a user's ``jit``,
    ``vmap`` or ``scan``), the round then takes its steps in a ``lax.scan`` whatever the backend's
    host-loop default (unrolled chunks on a CPU would unroll every local step into the user's program).
    ``client_mesh``: a device mesh over which the selected clients are split (each device trains its
    slice, ``jax.shard_map``) when their count divides evenly; ``None``: no split.
    """

    algo: Algorithm
    layout: Layout
    trace_scan: bool = False
    client_mesh: Any = None

    @property
    def problem(self) -> LocalProblem:
        a = self.algo
        return LocalProblem(a.trainer, a.client_start, a.client_finish, self.layout.step_loop, a.local_samples)

    def updates(self, state, data: FederatedData, selected: jax.Array, key: jax.Array) -> ClientUpdate:
        """Every selected client's :class:`ClientUpdate`, stacked ``[C, ...]``."""
        p, mesh = self.problem, self.client_mesh
        state = self.algo.round_start(state, data, selected)

        def train(state, data, selected, key):
            return p.clients(state, self.algo.context(state), data, selected, key, p.max_steps(data),
                             self.layout.client_parallel)
        if mesh is not None and mesh.size > 1 and selected.shape[0] % mesh.size == 0:
            train = per_device(train, mesh, (None, None, 0, None))
        return train(state, data, selected, key)

    def __call__(self, state, data: FederatedData, selected: jax.Array, key: jax.Array):
        """One round: ``(state, data, selected [C], key) -> (state, metrics)``."""
        check_state_clients(self.algo, state, data, "round")
        selected = jnp.asarray(checked_selection(selected, data.num_clients))
        pieces = self
        if self.trace_scan and self.layout.step_loop != "scan" and isinstance(selected, jax.core.Tracer):
            pieces = dataclasses.replace(self, layout=dataclasses.replace(self.layout, step_loop="scan"))
        updates = pieces.updates(state, data, selected, key)
        return server_step_result(self.algo, self.algo.server_update(state, data, selected, updates, key))

    def prepare(self, state, data: FederatedData, key: jax.Array):
        """The method's ``before_training`` (once, before round 0; pFedKDH's optional warm-up), pure:
        call it eagerly or inside your ``jit``. Inside a trace its local problems take their steps in a
        ``lax.scan`` (when the layout left the step loop to the backend), as the round's do."""
        check_state_clients(self.algo, state, data, "prepare")
        scan = self.trace_scan and isinstance(key, jax.core.Tracer)
        layout = dataclasses.replace(self.layout, step_loop="scan") if scan else self.layout
        return self.algo.before_training(state, data, key,
                                         lambda *args: train_local_problem(layout, *args))


def train_local_problem(layout: Layout, trainer: LocalTrainer, local: LocalState, ctx: PyTree, row: jax.Array,
                        source) -> LocalState:
    """Every step of one local problem, laid out as a client's round is: the ``train`` service a
    method's ``before_training`` is given. Called eagerly, each call compiles (it runs once a run) and
    an unrolled layout runs its chunks from the host; inside a trace it adds the steps to the program,
    as many as ``local.n`` asks (as ``row``'s length allows when ``n`` is traced: steps past a
    problem's own are no-ops)."""
    n = local.n
    steps = int(trainer.num_steps(int(row.shape[-1]) if isinstance(n, jax.core.Tracer) else int(n)))
    traced = any(isinstance(x, jax.core.Tracer) for x in jax.tree_util.tree_leaves((local, ctx, row, source)))
    if traced:
        return trainer.run(local, ctx, row, source, steps, layout.step_loop)
    opts = local_training_compiler_options()
    if layout.step_loop == "scan":
        return jax.jit(lambda s, c, r, src: trainer.run_scan(s, c, r, src, steps),
                       compiler_options=opts)(local, ctx, row, source)
    chunks, single = divmod(steps, layout.chunk_steps)
    run = jax.jit(lambda s, c, r, src: trainer.run_unrolled(s, c, r, src, layout.chunk_steps), compiler_options=opts)
    for _ in range(chunks):
        local = run(local, ctx, row, source)
    one = jax.jit(lambda s, c, r, src: trainer.run_unrolled(s, c, r, src, 1), compiler_options=opts)
    for _ in range(single):
        local = one(local, ctx, row, source)
    return local


def check_state_clients(algo: Algorithm, state, data: FederatedData, where: str, rep_axis: bool = False) -> None:
    """A ``ValueError`` naming ``where`` when ``state`` keeps values for another number of clients than
    ``data`` has (a state ``init`` built on other data: JAX would clamp the clients' indices into it,
    silently). Read from the shapes of the method's evaluation heads (``eval_models``, ``[K, ...]``;
    ``[R, K, ...]`` with ``rep_axis``); a method whose evaluation has no heads is not checked. ``data`` of
    another kind is a ``TypeError`` naming ``where``."""
    check_data(data, where)
    try:
        models = jax.eval_shape(jax.vmap(algo.eval_models) if rep_axis else algo.eval_models, state)
    except AttributeError as e:   # another method's state (or a method reading a field its state lacks)
        raise StateError(f"{where}: {type(algo).__name__} cannot read a {type(state).__name__} ({e}): a state of "
                         f"another method? Build it with algo.init(key, data)") from e
    heads, tree = jax.tree_util.tree_flatten(models.heads)
    if heads:
        ref, ref_tree = jax.tree_util.tree_flatten(_model_shapes(algo, data)["head"])
        if tree == ref_tree and all(h.shape[1 if rep_axis else 0:] == r.shape for h, r in zip(heads, ref)):
            raise StateError(f"{where}: {type(algo).__name__}.eval_models gives heads without a client axis (the "
                             f"model's own head shapes): give every client's, [K, ...] (a shared head: "
                             f"pfedkdh_jax.broadcast(head, K))")
        k = heads[0].shape[1 if rep_axis else 0]
        if k != data.num_clients:
            raise StateError(f"{where}: the state holds {k} clients (its evaluation heads are [{k}, ...]) but the "
                             f"data has {data.num_clients}: build the state with algo.init(key, data) on the data it "
                             f"runs on (or, writing a method, give EvalModels heads stacked per client, [K, ...])")
    check_eval_backbone(algo, models, data, where, rep_axis)


def check_eval_backbone(algo: Algorithm, models, data: FederatedData, where: str, rep_axis: bool = False) -> None:
    """A ``ValueError`` naming ``where`` when ``models`` (an :class:`EvalModels` of shapes) holds a backbone
    per client ``[K, ...]`` without ``per_client=True``, or one shared backbone with it. Compared with the
    shapes of ``algo.model.init``'s backbone; a backbone of another structure (a
    :class:`~pfedkdh_jax.engine.client_rows.ClientRows`, a method's own form) is not checked."""
    if models.backbone is None:
        return
    ref = _model_shapes(algo, data)["backbone"]
    ref_leaves, ref_tree = jax.tree_util.tree_flatten(ref)
    leaves, tree = jax.tree_util.tree_flatten(models.backbone)
    if tree != ref_tree or not leaves:
        return
    lead = [tuple(x.shape[:x.ndim - r.ndim]) if x.ndim >= r.ndim and x.shape[x.ndim - r.ndim:] == r.shape else None
            for x, r in zip(leaves, ref_leaves)]
    if None in lead:   # the model's own tree, other shapes: a state built for other inputs
        paths = [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(ref)[0]]
        i = lead.index(None)
        raise StateError(f"{where}: the state's backbone{paths[i]} is {tuple(leaves[i].shape)} but the model on the "
                         f"data's inputs {tuple(data.input_shape)} makes it {tuple(ref_leaves[i].shape)}: the state was "
                         "built on other inputs; build it with algo.init(key, data) on the data it runs on")
    if len(set(lead)) != 1:
        return
    stacked = len(lead[0]) > (1 if rep_axis else 0)   # a client axis besides any repetition axis
    if stacked and not models.per_client:
        raise StateError(f"{where}: {type(algo).__name__}.eval_models gives a backbone per client "
                         f"([{lead[0][-1]}, ...]) without per_client=True: return EvalModels(..., per_client=True) so "
                         "each client's test samples go through its own backbone")
    if models.per_client and not stacked:
        raise StateError(f"{where}: {type(algo).__name__}.eval_models says per_client=True but gives one shared "
                         "backbone: leave per_client False, or give the clients' backbones stacked [K, ...]")


def _model_shapes(algo: Algorithm, data: FederatedData):
    """The shapes of ``algo.model.init``'s parameters on ``data``'s inputs (nothing computed)."""
    return jax.eval_shape(lambda key: algo.model.init(key, tuple(data.input_shape)), jax.random.key(0))


def make_round(algo: Algorithm, layout: Layout = Layout()) -> RoundPieces:
    """The round of ``algo`` as a pure function ``(state, data, selected, key) -> (state, metrics)``
    (un-jitted). ``layout`` fields left ``None`` take the default backend's choice; a step loop left
    ``None`` is a ``lax.scan`` when the round is called inside a trace (a user's ``jit``). A method of
    several phases (FedFed) has a round function per phase (``make_round(phase.algorithm)``). A method's
    ``before_training`` (pFedKDH's optional warm-up) is not part of a round: :meth:`RoundPieces.prepare`
    (or a runner's ``prepare``) runs it once before round 0."""
    check_algorithm(algo, "make_round(algo)")
    check_one_phase(algo, "make_round(algo)")
    check_pieces(algo, "make_round(algo)")
    return same_pieces(RoundPieces(algo, layout.resolved(), trace_scan=layout.step_loop is None))


_PIECES: dict = {}   # (type, id of the algorithm, the rest) -> pieces, the latest _PIECES_KEPT: see same_pieces
_PIECES_KEPT = 8


def same_pieces(pieces):
    """The pieces made before for the same algorithm object (identity: an equal one may compute otherwise,
    a weakly typed ``lr=1.0`` against ``np.float64(1.0)``) with an equal layout, else ``pieces``:
    ``jax.jit(make_round(algo))`` built again for the same method then finds the program it compiled
    before (jit's cache holds a function by identity: new pieces compiled again). The latest
    ``_PIECES_KEPT`` are kept, each with its method; pieces whose algorithm or layout does not
    hash (a config holding a traced value, rebuilt inside a trace, or a list) only pass through."""
    fields = {f.name: getattr(pieces, f.name) for f in dataclasses.fields(pieces) if f.name != "algo"}
    try:
        hash(pieces.algo)   # a traced hyperparameter raises here: never kept
        key = (type(pieces), id(pieces.algo), tuple(fields.items()))
        found = _PIECES.pop(key, None)
    except TypeError:
        return pieces
    if found is None or found.algo is not pieces.algo:
        found = pieces
    _PIECES[key] = found   # most recent last
    while len(_PIECES) > _PIECES_KEPT:
        _PIECES.pop(next(iter(_PIECES)))
    return found


def check_one_phase(algo: Algorithm, where: str) -> None:
    """A ``ValueError`` naming ``where`` when ``algo`` runs in several phases (each its own algorithm)."""
    phases = algo.phases
    if len(phases) > 1:
        steps = ", then ".join(f"{type(p.algorithm).__name__} for " +
                               (f"{p.rounds} round{'s' if p.rounds != 1 else ''}" if p.rounds is not None else "the remaining rounds")
                               for p in phases)
        raise ValueError(f"{where}: {type(algo).__name__} runs in {len(phases)} phases ({steps}): make a round "
                         "function per phase, make_round(phase.algorithm) for phase in algo.phases, and call "
                         "phase.enter(state, data, key) at the first round of each later phase; or run it with "
                         "pfedkdh_jax.PhasedRunner, whose round takes the round's index")


def checked_selection(selected, num_clients: int, ndim: int = 1):
    """``selected``, a round's client indices (``[C]``; ``[R, C]`` with ``ndim=2``), as an array: its
    dtype and rank are checked always, its values where they are known (outside a trace): each in
    ``[0, num_clients)`` and none twice in one round. A ``ValueError`` names ``selected``."""
    if isinstance(selected, (list, tuple)):
        selected = jnp.asarray(selected) if any(isinstance(s, jax.core.Tracer) for s in selected) \
            else np.asarray(selected)
    if not hasattr(selected, "dtype") or not hasattr(selected, "ndim"):
        raise ValueError(f"selected must be an array of client indices; got {type(selected).__name__} {selected!r}")
    if selected.size == 0:
        raise ValueError("selected is empty: a round needs at least one client")
    if selected.ndim != ndim or not np.issubdtype(selected.dtype, np.integer):
        want = "[C]" if ndim == 1 else "[R, C] (a row of clients per repetition)"
        raise ValueError(f"selected must be integer client indices {want}; got {selected.dtype} of shape "
                         f"{tuple(selected.shape)}")
    if isinstance(selected, jax.core.Tracer):
        return selected.astype(jnp.int32)
    values = np.asarray(selected)
    if values.size and (values.min() < 0 or values.max() >= num_clients):
        bad = values[(values < 0) | (values >= num_clients)].flat[0]
        raise ValueError(f"selected: client {bad} is out of range for {num_clients} clients (0 to {num_clients - 1})")
    rows = np.sort(values.reshape(-1, values.shape[-1]), axis=-1)
    twice = rows[:, 1:][rows[:, 1:] == rows[:, :-1]]
    if twice.size:
        raise ValueError(f"selected holds client {twice[0]} twice: a round's clients are distinct")
    return values.astype(np.int32)


def select_clients(key: jax.Array, num_clients: int, per_round: int) -> jax.Array:
    """``per_round`` of ``num_clients`` clients, uniformly without replacement: ``int32 [C]``, traceable
    in ``key`` (use it inside a ``jit`` or ``lax.scan``); the two counts set its shape, so they are Python
    ints. Round ``t`` of :func:`~pfedkdh_jax.engine.runner.sample_schedule` is
    ``select_clients(jax.random.fold_in(key, t), ...)``."""
    if isinstance(num_clients, jax.core.Tracer) or isinstance(per_round, jax.core.Tracer):
        raise ValueError("select_clients: num_clients and per_round set the selection's shape: pass Python ints "
                         "(static arguments of your jit), not traced values")
    if not 1 <= per_round <= num_clients:
        raise ValueError(f"per_round must be in [1, num_clients={num_clients}]; got {per_round}")
    return jax.random.choice(key, num_clients, (per_round,), replace=False).astype(jnp.int32)
