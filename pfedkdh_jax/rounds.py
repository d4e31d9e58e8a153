"""Runs federated rounds of an algorithm with the configured client-parallel layout.

An algorithm (pFedKDH or a baseline) supplies pure functions:

* ``trainer``: its :class:`~pfedkdh_jax.engine.LocalTrainer` (local objective and optimizer);
* ``context(state)``: the frozen values every selected client receives;
* ``client_start(state, data, k, round_key) -> LocalState``;
* ``server_update(state, data, selected, finals, round_key) -> (state, metrics)`` with ``finals``
  stacked over the selected clients ``[C, ...]``;
* ``eval_models(state) -> (backbone, heads [K, ...], global_head)``; ``global_head`` may be ``None``
  for a method that has no server-side head (then no ``global_*`` accuracies are reported).

Optional hooks (absent attributes mean "not used"):

* ``before_training(state, data, key) -> state``: called once by the experiment driver before round 0;
* ``finetune_trainer`` (a :class:`~pfedkdh_jax.engine.LocalTrainer`, or ``None``) and
  ``finetune_start(state, data, k, key) -> LocalState``: a method whose personalized model is obtained
  by local fine-tuning at evaluation time (FedBABU). :meth:`RoundRunner.evaluate` then fine-tunes a copy
  of every client's full model ``{"backbone", "head"}`` on its train split (all K clients, same engine
  layout as training) and scores the ``personalized_*`` accuracies with each client's fine-tuned model on
  its own test split. The fine-tuned models are used for that evaluation only and never persisted; the
  ``global_*`` accuracies still come from ``eval_models``.
* ``client_final(state, data, client, local_state, round_key) -> upload``: client-side work after local
  training (e.g. FedProto's class prototypes); ``server_update`` then receives these uploads, stacked
  ``[C, ...]``, as ``finals`` instead of the final :class:`~pfedkdh_jax.engine.LocalState`. Called per
  client with the sequential layout and vmapped otherwise, like ``client_start``.
* ``LocalState.aux`` carries values from ``client_start`` to ``server_update`` unchanged by training
  (e.g. FedALA's learned aggregation weights).
* ``per_client_backbone = True``: every client evaluates with a whole model of its own. Then
  ``eval_models(state) -> (backbones [K, ...], heads [K, ...], global_model)`` where ``global_model`` is
  ``None`` or a full ``{"backbone", "head"}`` scored on every client's test split (``global_*``); each
  test sample's features come from its owner's backbone (see :func:`evaluation.owner_chunks`); an
  optional ``eval_extra_heads(state) -> {name: heads [K, ...]}`` adds ``name_*`` metrics on the same
  features. Head adaptation (EA) applies to shared-backbone methods only.

:class:`RoundRunner` compiles each piece once and chains the calls without host synchronisation;
with ``vmap`` + ``scan`` a whole round is a single compiled call. ``traces`` counts how often each
piece was traced, so tests can assert that nothing recompiles after the first round.

With ``reps=R`` every piece is additionally ``vmap``-ed over a leading repetition axis ``[R, ...]``
(states, selected clients ``[R, C]``, keys ``[R]``; the data are shared), so R Monte Carlo
repetitions run as one program. With a ``mesh``, that axis (or else the client axis of the fused
round) is sharded over the mesh's devices.
"""

from __future__ import annotations

import collections
import functools
import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from pfedkdh_jax import evaluation
from pfedkdh_jax.engine import EngineConfig, local_training_compiler_options, num_chunks, tree_stack
from pfedkdh_jax.federated_data import FederatedData

PyTree = Any


def supports_rep_axis(algo) -> bool:
    """Whether the algorithm's pieces all have a repetition axis (``REP_AXES``); the others run their
    repetitions one after another."""
    return not (getattr(algo, "client_final", None) or getattr(algo, "per_client_backbone", False)
                or getattr(algo, "finetune_trainer", None))


def sample_schedule(key: jax.Array, num_rounds: int, num_clients: int, per_round: int) -> np.ndarray:
    """Selected clients of every round ``[R, C]``: uniformly, without replacement (host copy)."""
    def one(r):
        return jax.random.choice(jax.random.fold_in(key, r), num_clients, (per_round,), replace=False)
    return np.asarray(jax.vmap(one)(jnp.arange(num_rounds)), dtype=np.int32)


# How each compiled piece maps over the repetition axis (0: batched, None: shared).
REP_AXES = {
    "client_start": (0, None, 0, 0), "client_start_vmap": (0, None, 0, 0),
    "train_scan": (0, 0, 0, None), "train_scan_vmap": (0, 0, 0, None),
    "train_chunk": (0, 0, 0, None), "train_chunk_vmap": (0, 0, 0, None),
    "server_update": (0, None, 0, 0, 0), "round": (0, None, 0, 0),
    "features_chunk": (0, None, None), "features_scan": (0, None, None),
    "score": (0, None, 0), "ea": (0, None, 0, 0, 0),
}


# Compiled pieces that take local SGD steps of the CNN (besides the "train_*" / "finetune_*" chunks).
LOCAL_STEP_PIECES = ("round", "finetune_fused")


def _per_device(fn, mesh: jax.sharding.Mesh, axes):
    """``fn`` run by every device on its own slice of the leading axis of the arguments whose entry
    in ``axes`` is 0 (the others are replicated), with ``jax.shard_map``.

    Left to the automatic partitioner, a ``vmap``-ed convolution with different weights per
    repetition (or per client) is a grouped convolution that XLA's SPMD partitioner does not split:
    every device computed every repetition (measured on 2 and 8 fake CPU devices, BENCHMARKS.md), so
    the devices added memory and no speed. Here each device computes only its own slice.
    """
    ax = mesh.axis_names[0]
    spec = jax.sharding.PartitionSpec
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(spec(ax) if a == 0 else spec() for a in axes),
                         out_specs=spec(ax), check_vma=False)


class _LocalCalls:
    """Compiled client-start and local-training calls of one local problem (training, fine-tuning).

    ``names`` = (start name, run name) as counted in ``RoundRunner.traces``.
    """

    def __init__(self, counted, engine: EngineConfig, trainer, start, sizes: np.ndarray, names,
                 place=lambda x: x):
        start_name, run_name = names
        self.place = place
        self.engine = engine
        self.trainer = trainer
        self.sizes = sizes
        self.max_steps = int(trainer.num_steps(int(sizes.max())))
        chunk = engine.chunk_steps

        def run_one(state, ctx, idx_row, data, num):
            return trainer.run(state, ctx, idx_row, data, num, engine.step_loop, chunk)

        self.vstart = jax.vmap(start, in_axes=(None, None, 0, None))
        self.vrun = jax.vmap(run_one, in_axes=(0, None, 0, None, None))
        self.start_one = counted(start_name, start)
        self.start_all = counted(f"{start_name}_vmap", self.vstart)
        vrun, max_steps = self.vrun, self.max_steps
        if engine.step_loop == "scan":
            self.train_one = counted(f"{run_name}_scan", lambda s, c, r, d: run_one(s, c, r, d, max_steps))
            self.train_all = counted(f"{run_name}_scan_vmap", lambda s, c, r, d: vrun(s, c, r, d, max_steps))
        else:
            self.train_one = counted(f"{run_name}_chunk", lambda s, c, r, d: run_one(s, c, r, d, chunk))
            self.train_all = counted(f"{run_name}_chunk_vmap", lambda s, c, r, d: vrun(s, c, r, d, chunk))

    def calls(self, clients: np.ndarray) -> int:
        """Compiled calls needed for the largest of ``clients`` (1 with a scan)."""
        if self.engine.step_loop == "scan":
            return 1
        return num_chunks(int(self.trainer.num_steps(int(self.sizes[clients].max()))),
                          self.engine.chunk_steps)

    def run_all(self, state, ctx, data: FederatedData, clients: np.ndarray, key: jax.Array):
        """Local states of ``clients`` (host ints) after local training, stacked ``[C, ...]``
        (vmap layout)."""
        sel = self.place(jnp.asarray(clients, jnp.int32))
        ls = self.start_all(state, data, sel, self.place(key))
        rows = data.train_idx[sel]
        for _ in range(self.calls(clients)):
            ls = self.train_all(ls, ctx, rows, data)
        return ls

    def run_each(self, state, ctx, data: FederatedData, clients: np.ndarray, key: jax.Array):
        """Yield ``(k, final local state)`` for each of ``clients``, one after another
        (sequential layout)."""
        clients = np.asarray(clients)
        for c in range(clients.shape[-1]):
            k = clients[..., c]  # one client, or one per repetition ([R])
            kk = self.place(jnp.asarray(k, jnp.int32))
            ls = self.start_one(state, data, kk, self.place(key))
            row = data.train_idx[kk]
            for _ in range(self.calls(np.ravel(k))):
                ls = self.train_one(ls, ctx, row, data)
            yield k, ls


class RoundRunner:
    """Compiled round and evaluation functions of one algorithm on one data layout."""

    def __init__(self, algo, data: FederatedData, engine: EngineConfig = EngineConfig(), *,
                 eval_chunk: int = 2048, ea_steps: int = 0, ea_lr: float = 0.015, batch_size: int = 64,
                 ea_epochs: int = 0,
                 owner_chunk: int | None = None, reps: int | None = None,
                 mesh: jax.sharding.Mesh | None = None):
        self.algo = algo
        self.reps = reps
        self.mesh = mesh
        # the repetition axis is sharded over the mesh when it divides evenly
        self.rep_sharding = (
            jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(mesh.axis_names[0]))
            if mesh is not None and reps and mesh.size > 1 and reps % mesh.size == 0 else None)
        self.per_client = bool(getattr(algo, "per_client_backbone", False))
        if self.per_client:
            ea_steps = ea_epochs = 0  # EA adapts heads over shared-backbone features
        if ea_epochs > 0:
            # EA as epochs over each client's train split (E·ceil(n_k / B) steps, client by client)
            ea_steps = ea_epochs * math.ceil(data.max_train / batch_size)
        self.engine = engine.resolved()
        self.trainer = algo.trainer
        self.sizes = np.asarray(data.train_sizes)
        self.max_steps = int(self.trainer.num_steps(int(self.sizes.max())))
        self.eval_chunk = eval_chunk
        self.ea_steps = ea_steps
        self.traces: collections.Counter = collections.Counter()
        model = algo.model

        train_options = local_training_compiler_options()

        def counted(name, fn):
            if reps is not None:
                if name not in REP_AXES:
                    raise ValueError(f"{type(algo).__name__}: '{name}' has no repetition axis; "
                                     "run its repetitions sequentially")
                fn = jax.vmap(fn, in_axes=REP_AXES[name])
                if self.rep_sharding is not None:
                    fn = _per_device(fn, mesh, REP_AXES[name])

            def wrapper(*args, **kwargs):
                self.traces[name] += 1
                return fn(*args, **kwargs)
            # the calls that take local SGD steps compile with the local-training options
            takes_steps = name in LOCAL_STEP_PIECES or name.startswith(("train_", "finetune_scan", "finetune_chunk"))
            return jax.jit(wrapper, compiler_options=train_options if takes_steps else None)

        self._local = _LocalCalls(counted, self.engine, self.trainer, algo.client_start, self.sizes,
                                  ("client_start", "train"), place=self.place)
        final = getattr(algo, "client_final", None)
        vfinal = jax.vmap(final, in_axes=(None, None, 0, 0, None)) if final is not None else None
        self._final_one = counted("client_final", final) if final is not None else None
        self._final_all = counted("client_final_vmap", vfinal) if final is not None else None
        self._server = counted("server_update", algo.server_update)
        self._stack = jax.jit(lambda xs: tree_stack(xs, axis=0 if reps is None else 1))
        local = self._local
        client_sharding = self._client_sharding(data)

        def fused(state, data, selected, round_key):
            ls = local.vstart(state, data, selected, round_key)
            shard_clients = client_sharding is not None and selected.shape[0] % self.mesh.size == 0

            def train(s, c, r, d):
                return local.vrun(s, c, r, d, local.max_steps)
            if shard_clients:
                ls = jax.lax.with_sharding_constraint(ls, client_sharding)
                train = _per_device(train, self.mesh, (0, None, 0, None))
            ls = train(ls, algo.context(state), data.train_idx[selected], data)
            if vfinal is not None:
                ls = vfinal(state, data, selected, ls, round_key)
            return algo.server_update(state, data, selected, ls, round_key)
        self._fused = counted("round", fused)

        # --- evaluation
        self._features_chunk = counted("features_chunk", functools.partial(evaluation.features_of, model))
        self._features_scan = counted(
            "features_scan", lambda b, d, idx: evaluation.chunked_features(model, b, d, idx, eval_chunk))

        def scored(state, data, test_feats):
            backbone, heads, global_head = algo.eval_models(state)
            return evaluation.score(model, test_feats, data.labels[data.test_flat], data.test_client,
                                    heads, global_head, data.num_clients)
        self._score = counted("score", scored)

        if self.per_client:
            c = owner_chunk or min(eval_chunk, 256)
            idx, slot_owner, chunk_owner = evaluation.owner_chunks(
                data.test_flat, data.test_client, data.num_clients, c)
            self._owned = (jnp.asarray(chunk_owner), jnp.asarray(idx), jnp.asarray(slot_owner))
            self._eval_models = counted("eval_models", algo.eval_models)
            self._owned_chunk = counted(
                "owned_features_chunk",
                lambda b, d, owners, rows, g: evaluation.owned_features_of(model, b, d, owners[g], rows[g]))
            self._owned_scan = counted(
                "owned_features_scan", functools.partial(evaluation.owned_features, model))
            extra = getattr(algo, "eval_extra_heads", None)

            def scored_owned(state, data, feats, idx, slot_owner):
                _, heads, _ = algo.eval_models(state)
                return evaluation.score(model, feats, data.labels[idx.reshape(-1)], slot_owner, heads,
                                        None, data.num_clients, extra(state) if extra else None)

            def scored_global(state, data, feats):
                head = algo.eval_models(state)[2]["head"]
                return evaluation.score(model, feats, data.labels[data.test_flat], data.test_client,
                                        None, head, data.num_clients)
            self._score_owned = counted("score_owned", scored_owned)
            self._score_global = counted("score_global", scored_global)

        if ea_steps > 0:
            from pfedkdh_jax.pfedkdh import head_trainer  # shared head-only SGD
            if ea_epochs > 0:
                ea = head_trainer(model, lr=ea_lr, batch_size=batch_size, epochs=ea_epochs)
            else:
                min_spe = max(1, math.ceil(int(self.sizes.min()) / batch_size))
                ea = head_trainer(model, lr=ea_lr, batch_size=batch_size,
                                  epochs=math.ceil(ea_steps / min_spe), max_steps=ea_steps)

            def adapted(state, data, train_feats, test_feats, key):
                backbone, heads, global_head = algo.eval_models(state)
                src = (train_feats, data.labels[data.train_flat])

                def adapt(head, k):
                    s = ea.init(head, jax.random.fold_in(key, k), data.train_n[k], data.max_train)
                    return ea.run_scan(s, None, data.train_flat_pos[k], src, ea_steps).params
                new_heads = jax.vmap(adapt)(heads, jnp.arange(data.num_clients))
                m = evaluation.score(model, test_feats, data.labels[data.test_flat], data.test_client,
                                     new_heads, None, data.num_clients)
                return {f"{k}_ea": v for k, v in m.items()}
            self._ea = counted("ea", adapted)

        # --- evaluation after local fine-tuning (optional hook, e.g. FedBABU)
        self._finetune = None
        ft_trainer = getattr(algo, "finetune_trainer", None)
        if ft_trainer is not None:
            ft = _LocalCalls(counted, self.engine, ft_trainer, algo.finetune_start, self.sizes,
                             ("finetune_start", "finetune"))
            width = int(np.max(np.asarray(data.test_n)))  # static test window of one client (host, once)

            def count_one(params, data, k):
                return evaluation.client_model_correct(model, params, data, k, width)

            def count_all(params, data):
                return jax.lax.map(lambda a: count_one(a[0], data, a[1]),
                                   (params, jnp.arange(data.num_clients)))

            def finetune_fused(state, data, key):
                everyone = jnp.arange(data.num_clients)
                ls = ft.vstart(state, data, everyone, key)
                ls = ft.vrun(ls, None, data.train_idx, data, ft.max_steps)
                return evaluation.accuracies_from_counts(*count_all(ls.params, data), "personalized")

            self._finetune = ft
            self._ft_count_one = counted("finetune_count", count_one)
            self._ft_count_all = counted("finetune_count_all", count_all)
            self._ft_metrics = counted(
                "finetune_metrics",
                lambda c, n: evaluation.accuracies_from_counts(jnp.stack(c), jnp.stack(n), "personalized"))
            self._ft_fused = counted("finetune_fused", finetune_fused)

    # ------------------------------------------------------------------------------- training
    def round(self, state, data: FederatedData, selected: np.ndarray, round_key: jax.Array):
        """One federated round over the clients ``selected`` (host ints ``[C]``, or ``[R, C]`` with
        repetitions; ``round_key`` then ``[R]``). Returns device values without synchronising."""
        e = self.engine
        selected = np.asarray(selected)
        sel = self.place(jnp.asarray(selected, jnp.int32))
        round_key = self.place(round_key)
        state = self._pin(state)
        if e.client_parallel == "vmap" and e.step_loop == "scan":
            return self._fused(state, data, sel, round_key)
        ctx = self.algo.context(state)
        if e.client_parallel == "vmap":
            ls = self._local.run_all(state, ctx, data, selected, round_key)
            if self._final_all is not None:
                ls = self._final_all(state, data, sel, ls, round_key)
        else:
            finals = []
            for k, ls in self._local.run_each(state, ctx, data, selected, round_key):
                if self._final_one is not None:
                    ls = self._final_one(state, data, jnp.asarray(k, jnp.int32), ls, round_key)
                finals.append(ls)
            ls = self._stack(finals)
        return self._server(state, data, sel, ls, round_key)

    def _pin(self, state):
        """On a mesh without a sharded repetition axis, keep the state replicated, so every round
        sees the same input sharding (and nothing recompiles after the first)."""
        if self.mesh is None or self.rep_sharding is not None or self.mesh.size == 1:
            return state
        return jax.device_put(state, jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec()))

    def place(self, tree):
        """Put a repetition-batched value (state, keys, selections) on the repetition sharding."""
        return tree if self.rep_sharding is None else jax.device_put(tree, self.rep_sharding)

    def _client_sharding(self, data: FederatedData):
        """Sharding of the stacked selected clients over the mesh, when the repetition axis is not
        already sharded and the clients divide evenly."""
        if self.mesh is None or self.reps is not None or self.mesh.size == 1:
            return None
        return jax.sharding.NamedSharding(self.mesh, jax.sharding.PartitionSpec(self.mesh.axis_names[0]))

    # ----------------------------------------------------------------------------- evaluation
    def features(self, backbone, data: FederatedData, flat_idx: jax.Array) -> jax.Array:
        if self.engine.step_loop == "scan":
            return self._features_scan(backbone, data, flat_idx)
        c = self.eval_chunk
        parts = [self._features_chunk(backbone, data, flat_idx[i:i + c])
                 for i in range(0, flat_idx.shape[0], c)]
        return jnp.concatenate(parts, axis=0 if self.reps is None else 1)

    def evaluate(self, state, data: FederatedData, key: jax.Array, *, ea: bool = False) -> dict:
        """Fair (and, if ``ea``, head-adapted) accuracies of all K clients, as device values.

        For an algorithm with a fine-tuning hook the ``personalized_*`` values are those of the
        clients' fine-tuned models; for one with per-client backbones every test sample is scored
        with its owner's whole model (see the module docstring).
        """
        if self.per_client:
            return self._evaluate_owned(state, data)
        key = self.place(key)
        backbone = self.algo.eval_models(state)[0]
        test_feats = self.features(backbone, data, data.test_flat)
        metrics = self._score(state, data, test_feats)
        if self._finetune is not None:
            metrics.update(self.finetuned(state, data, jax.random.fold_in(key, 1)))
        if ea and self.ea_steps > 0:
            train_feats = self.features(backbone, data, data.train_flat)
            metrics.update(self._ea(state, data, train_feats, test_feats, key))
        return metrics

    def finetuned(self, state, data: FederatedData, key: jax.Array) -> dict:
        """``personalized_*`` accuracies of every client's model after the algorithm's local
        fine-tuning (all K clients; the fine-tuned models are discarded)."""
        e, ft = self.engine, self._finetune
        if e.client_parallel == "vmap" and e.step_loop == "scan":
            return self._ft_fused(state, data, key)
        everyone = np.arange(data.num_clients)
        if e.client_parallel == "vmap":
            ls = ft.run_all(state, None, data, everyone, key)
            return evaluation.accuracies_from_counts(*self._ft_count_all(ls.params, data), "personalized")
        correct, count = [], []
        for k, ls in ft.run_each(state, None, data, everyone, key):
            c, n = self._ft_count_one(ls.params, data, jnp.int32(k))
            correct.append(c)
            count.append(n)
        return self._ft_metrics(correct, count)

    def _evaluate_owned(self, state, data: FederatedData) -> dict:
        """Every test sample scored with its owner's whole model (and the global model, if any)."""
        backbones, _, global_model = self._eval_models(state)
        owners, idx, slot_owner = self._owned
        if self.engine.step_loop == "scan":
            feats = self._owned_scan(backbones, data, owners, idx)
        else:
            feats = jnp.concatenate([self._owned_chunk(backbones, data, owners, idx, jnp.int32(g))
                                     for g in range(idx.shape[0])])
        metrics = self._score_owned(state, data, feats, idx, slot_owner)
        if global_model is not None:
            feats = self.features(global_model["backbone"], data, data.test_flat)
            metrics.update(self._score_global(state, data, feats))
        return metrics
