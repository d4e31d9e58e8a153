"""FedProto: clients exchange class prototypes (mean features) instead of model weights.

Y. Tan, G. Long, L. Liu, T. Zhou, Q. Lu, J. Jiang, C. Zhang, "FedProto: Federated Prototype Learning
across Heterogeneous Clients", AAAI 2022 (arXiv:2105.00243).

Every client keeps its whole model (``[K, ...]``, never averaged). The server keeps one global
prototype p_c per class c (``[C, 512]``, plus which classes have one). A selected client trains its
own model on

    CE(h(f(x)), y) + λ · d(f(x), p_y),    d(a, b) = ‖a − b‖² / 512

where f is the backbone (the 512-d features before the head) and the term is dropped for samples
whose class has no global prototype yet (all of them in round 1). It then computes its local
prototypes: the mean feature of each class over its train split with the trained model
(``client_finish``; eval mode, masked: a class the client lacks gets count 0 and prototype 0, never a
NaN). The server averages, per class, the local prototypes of the selected clients that hold that
class, weighted by their class counts |D_k,c| (the paper's aggregation); classes no selected client
holds keep their previous global prototype.

Inference is the paper's nearest-prototype rule, ``argmin_c ‖f_k(x) − p_c‖²`` with the client's own
backbone over the classes that have a prototype (``personalized_*`` metrics). It is computed as a
linear head with kernel 2·p_c and bias −‖p_c‖² (−∞ without a prototype), whose argmax is the same
class. The client's own head is also reported (``head_*`` metrics). There is no global model.

Hyperparameters (``--method-arg``):

* ``lam`` = 1.0 — λ (the paper's default, also the authors' code ``--ld`` and PFLlib's);
* ``proto_weighting`` = ``count`` — ``count`` weights local prototypes by |D_k,c| as in the paper;
  ``uniform`` averages them with equal weight, as the authors' code and PFLlib do.

The distance is the squared Euclidean distance averaged over the 512 feature dimensions, i.e. the
``MSELoss`` of the authors' code and PFLlib, for which λ = 1 was chosen (the paper writes an L2
distance without fixing its scale). Differences from the authors' code: there prototypes are collected
during the last local epoch from the changing model and averaged per client without weights; here they
come from the trained model over the whole train split (as in PFLlib) with the paper's count weights.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp

from pfedkdh_jax import losses
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import FedProtoConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels
from pfedkdh_jax.data.device import FederatedData, gather_inputs
from pfedkdh_jax.engine.local import LocalState, LocalTrainer, mean_loss
from pfedkdh_jax.engine.protocol import Model, feature_dim

PyTree = Any

PROTO_WEIGHTINGS = ("count", "uniform")


@struct.dataclass
class FedProtoState:
    models: PyTree        # every client's own model {"backbone", "head"}, [K, ...]
    protos: jax.Array     # float32 [C, 512], global prototypes (0 where none)
    has_proto: jax.Array  # bool [C], which classes have a global prototype
    round: jax.Array      # int32 [], rounds completed


def class_prototypes(feats: jax.Array, labels: jax.Array, valid: jax.Array, num_classes: int):
    """Per-class mean of ``feats [M, D]`` over the ``valid`` rows: ``(protos [C, D], counts [C])``.

    Classes without a valid row get count 0 and prototype 0.
    """
    segment = jnp.where(valid, labels, num_classes)  # invalid rows go to a discarded extra segment
    sums = jax.ops.segment_sum(feats, segment, num_segments=num_classes + 1)[:num_classes]
    ones = valid.astype(jnp.float32)
    counts = jax.ops.segment_sum(ones, segment, num_segments=num_classes + 1)[:num_classes]
    return sums / jnp.maximum(counts, 1.0)[:, None], counts


def prototype_head(protos: jax.Array, has_proto: jax.Array) -> PyTree:
    """A linear rule (scored with :func:`prototype_logits`) whose argmax is the nearest prototype:
    ``argmin_c ‖z − p_c‖² = argmax_c (2·z·p_c − ‖p_c‖²)``; classes without a prototype get −∞."""
    bias = jnp.where(has_proto, -jnp.sum(protos * protos, axis=-1), -jnp.inf)
    return {"kernel": 2.0 * protos.T, "bias": bias}


def prototype_logits(head: PyTree, z: jax.Array) -> jax.Array:
    """The nearest-prototype rule's logits ``z·kernel + bias`` (whatever the model's own head is)."""
    out = jnp.dot(z, head["kernel"])
    return out + head["bias"].reshape((1,) * (out.ndim - 1) + (-1,))


@dataclasses.dataclass(frozen=True)
class FedProto(Algorithm):
    model: Model
    config: FedProtoConfig = FedProtoConfig()

    name = "fedproto"

    def init(self, key: jax.Array, data: FederatedData) -> FedProtoState:
        """Every client starts from the same initial model; no global prototypes yet."""
        params = C.init_params(self.model, key, data)
        c = data.num_classes
        return FedProtoState(models=C.broadcast(params, data.num_clients),
                             protos=jnp.zeros((c, feature_dim(self.model, data.input_shape, data.input_dtype)),
                                              jnp.float32),
                             has_proto=jnp.zeros((c,), bool), round=jnp.zeros((), jnp.int32))

    @property
    def trainer(self) -> LocalTrainer:
        c = self.config
        return C.sgd_trainer(self.local_loss, C.client_tx(c), c)

    def context(self, state: FedProtoState) -> PyTree:
        """The global prototypes every selected client receives."""
        return {"protos": state.protos, "has_proto": state.has_proto}

    def local_loss(self, params, ctx, x, y, mask, rng) -> jax.Array:
        """``CE + λ·d(f(x), p_y)``, the distance term only for classes that have a global prototype."""
        z = self.model.features(params["backbone"], x, rng=rng)
        logits = self.model.logits_from_features(params["head"], z)
        ce = losses.masked_mean(losses.cross_entropy(logits, y), mask)
        target = jax.lax.stop_gradient(ctx["protos"][y])
        dist = jnp.mean(jnp.square(z - target), axis=-1) * ctx["has_proto"][y]
        return ce + self.config.lam * losses.masked_mean(dist, mask)

    def messages(self, state: FedProtoState, update: ClientUpdate):
        """The global prototypes (and which classes have one) down; the client's prototypes and
        class counts up. No weights travel."""
        return (state.protos, state.has_proto), update.aux

    def client_start(self, state: FedProtoState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        return C.start_local(self.trainer, C.take(state.models, client), data, client, key)

    def client_finish(self, state: FedProtoState, data: FederatedData, client: jax.Array,
                      local: LocalState, key: jax.Array) -> ClientUpdate:
        """The client's trained model and its local prototypes over its whole train split."""
        del state, key
        rows = data.train_idx[client]
        x, y = gather_inputs(data, rows)
        feats = self.model.features(local.params["backbone"], x)
        valid = jnp.arange(rows.shape[0]) < local.n
        protos, counts = class_prototypes(feats, y, valid, data.num_classes)
        return ClientUpdate(params=local.params, loss=mean_loss(local), aux={"protos": protos, "counts": counts})

    def server_update(self, state: FedProtoState, data: FederatedData, selected: jax.Array,
                      updates: ClientUpdate, key: jax.Array) -> tuple[FedProtoState, dict]:
        """Models stay with their clients; only the prototypes are combined."""
        del key
        protos, has_proto = self.aggregate(state.protos, state.has_proto, updates.aux["protos"],
                                           updates.aux["counts"])
        models = C.put(state.models, selected, updates.params)
        metrics = C.round_metrics(updates)
        return state.replace(models=models, protos=protos, has_proto=has_proto,
                             round=state.round + 1), metrics

    def aggregate(self, protos, has_proto, local_protos, counts):
        """Per class, the (count-weighted or plain) mean of the local prototypes ``[S, C, D]`` of the
        clients that hold the class (``counts [S, C] > 0``); other classes keep the old prototype."""
        w = counts if self.config.proto_weighting == "count" else (counts > 0).astype(jnp.float32)
        total = jnp.sum(w, axis=0)
        mean = jnp.sum(w[:, :, None] * local_protos, axis=0) / jnp.maximum(total, 1e-12)[:, None]
        fresh = total > 0
        return jnp.where(fresh[:, None], mean, protos), has_proto | fresh

    def eval_models(self, state: FedProtoState) -> EvalModels:
        """Own backbones with the nearest-prototype rule (``personalized_*``) and with each client's
        own head (``head_*``); no global model."""
        head = prototype_head(state.protos, state.has_proto)
        k = jax.tree_util.tree_leaves(state.models)[0].shape[0]
        return EvalModels(backbone=state.models["backbone"], heads=C.broadcast(head, k),
                          extra_heads={"head": state.models["head"]}, per_client=True,
                          head_logits=prototype_logits)


def from_config(cfg, num_classes: int, args: dict) -> FedProto:
    """FedProto of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return FedProto(C.run_model(cfg, num_classes), FedProtoConfig(**C.local_config(cfg), **args))
