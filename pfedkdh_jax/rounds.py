"""Runs federated rounds of an algorithm with the configured client-parallel layout.

An algorithm (pFedKDH or a baseline) supplies pure functions:

* ``trainer``: its :class:`~pfedkdh_jax.engine.LocalTrainer` (local objective and optimizer);
* ``context(state)``: the frozen values every selected client receives;
* ``client_start(state, data, k, round_key) -> LocalState``;
* ``server_update(state, data, selected, finals, round_key) -> (state, metrics)`` with ``finals``
  stacked over the selected clients ``[C, ...]``;
* ``eval_models(state) -> (backbone, heads [K, ...], global_head)``.

Optional parts (absent = not used):

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
from pfedkdh_jax.engine import EngineConfig, num_chunks, tree_stack
from pfedkdh_jax.federated_data import FederatedData

PyTree = Any


def sample_schedule(key: jax.Array, num_rounds: int, num_clients: int, per_round: int) -> np.ndarray:
    """Selected clients of every round ``[R, C]``: uniformly, without replacement (host copy)."""
    def one(r):
        return jax.random.choice(jax.random.fold_in(key, r), num_clients, (per_round,), replace=False)
    return np.asarray(jax.vmap(one)(jnp.arange(num_rounds)), dtype=np.int32)


class RoundRunner:
    """Compiled round and evaluation functions of one algorithm on one data layout."""

    def __init__(self, algo, data: FederatedData, engine: EngineConfig = EngineConfig(), *,
                 eval_chunk: int = 2048, ea_steps: int = 0, ea_lr: float = 0.015, batch_size: int = 64,
                 owner_chunk: int | None = None):
        self.algo = algo
        self.per_client = bool(getattr(algo, "per_client_backbone", False))
        if self.per_client:
            ea_steps = 0  # EA adapts heads over shared-backbone features
        self.engine = engine.resolved()
        self.trainer = algo.trainer
        self.sizes = np.asarray(data.train_sizes)
        self.max_steps = int(self.trainer.num_steps(int(self.sizes.max())))
        self.eval_chunk = eval_chunk
        self.ea_steps = ea_steps
        self.traces: collections.Counter = collections.Counter()
        model = algo.model
        chunk = self.engine.chunk_steps
        t = self.trainer

        def counted(name, fn):
            def wrapper(*args, **kwargs):
                self.traces[name] += 1
                return fn(*args, **kwargs)
            return jax.jit(wrapper)

        vstart = jax.vmap(algo.client_start, in_axes=(None, None, 0, None))
        self._start_one = counted("client_start", algo.client_start)
        self._start_all = counted("client_start_vmap", vstart)

        def run_one(state, ctx, idx_row, data, num):
            return t.run(state, ctx, idx_row, data, num, self.engine.step_loop, chunk)

        vrun = jax.vmap(run_one, in_axes=(0, None, 0, None, None))
        if self.engine.step_loop == "scan":
            self._train_one = counted("train_scan", lambda s, c, r, d: run_one(s, c, r, d, self.max_steps))
            self._train_all = counted("train_scan_vmap", lambda s, c, r, d: vrun(s, c, r, d, self.max_steps))
        else:
            self._train_one = counted("train_chunk", lambda s, c, r, d: run_one(s, c, r, d, chunk))
            self._train_all = counted("train_chunk_vmap", lambda s, c, r, d: vrun(s, c, r, d, chunk))
        final = getattr(algo, "client_final", None)
        vfinal = jax.vmap(final, in_axes=(None, None, 0, 0, None)) if final is not None else None
        self._final_one = counted("client_final", final) if final is not None else None
        self._final_all = counted("client_final_vmap", vfinal) if final is not None else None
        self._server = counted("server_update", algo.server_update)
        self._stack = counted("stack", lambda xs: tree_stack(xs))

        def fused(state, data, selected, round_key):
            ls = vstart(state, data, selected, round_key)
            ls = vrun(ls, algo.context(state), data.train_idx[selected], data, self.max_steps)
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

    # ------------------------------------------------------------------------------- training
    def round(self, state, data: FederatedData, selected: np.ndarray, round_key: jax.Array):
        """One federated round over the clients ``selected`` (host ints). Returns device values."""
        e = self.engine
        sel = jnp.asarray(selected, jnp.int32)
        if e.client_parallel == "vmap" and e.step_loop == "scan":
            return self._fused(state, data, sel, round_key)
        ctx = self.algo.context(state)
        if e.client_parallel == "vmap":
            ls = self._start_all(state, data, sel, round_key)
            rows = data.train_idx[sel]
            steps = int(self.trainer.num_steps(int(self.sizes[selected].max())))
            calls = 1 if e.step_loop == "scan" else num_chunks(steps, e.chunk_steps)
            for _ in range(calls):
                ls = self._train_all(ls, ctx, rows, data)
            if self._final_all is not None:
                ls = self._final_all(state, data, sel, ls, round_key)
        else:
            finals = []
            for k in selected:
                ls = self._start_one(state, data, jnp.int32(k), round_key)
                row = data.train_idx[k]
                steps = int(self.trainer.num_steps(int(self.sizes[k])))
                calls = 1 if e.step_loop == "scan" else num_chunks(steps, e.chunk_steps)
                for _ in range(calls):
                    ls = self._train_one(ls, ctx, row, data)
                if self._final_one is not None:
                    ls = self._final_one(state, data, jnp.int32(k), ls, round_key)
                finals.append(ls)
            ls = self._stack(finals)
        return self._server(state, data, sel, ls, round_key)

    # ----------------------------------------------------------------------------- evaluation
    def features(self, backbone, data: FederatedData, flat_idx: jax.Array) -> jax.Array:
        if self.engine.step_loop == "scan":
            return self._features_scan(backbone, data, flat_idx)
        c = self.eval_chunk
        parts = [self._features_chunk(backbone, data, flat_idx[i:i + c])
                 for i in range(0, flat_idx.shape[0], c)]
        return jnp.concatenate(parts)

    def evaluate(self, state, data: FederatedData, key: jax.Array, *, ea: bool = False) -> dict:
        """Fair (and, if ``ea``, head-adapted) accuracies of all K clients, as device values."""
        if self.per_client:
            return self._evaluate_owned(state, data)
        backbone = self.algo.eval_models(state)[0]
        test_feats = self.features(backbone, data, data.test_flat)
        metrics = self._score(state, data, test_feats)
        if ea and self.ea_steps > 0:
            train_feats = self.features(backbone, data, data.train_flat)
            metrics.update(self._ea(state, data, train_feats, test_feats, key))
        return metrics

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
