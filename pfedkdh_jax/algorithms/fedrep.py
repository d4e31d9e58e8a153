"""FedRep: a shared representation and personal heads, trained in alternation.

Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021.

Round t: selected client k sets θ_k ← θ_g and, with its persistent head φ_k,

1. trains the head only, ``head_epochs`` epochs of the client optimizer (SGD by default) with θ_k frozen;
2. then trains the representation only, E epochs of it with φ_k frozen;

uploads θ_k (the head stays with the client), and the server sets θ_g ← Σ n_k θ_k / Σ n_k. Evaluation:
(θ_g, φ_k) per client; no server-side head, so no ``global_*`` accuracy.

How it runs on the shared engine: during the head epochs the representation is frozen, so a client's
features do not change; ``client_start`` computes them once (one forward pass over the client's
padded train row, in chunks) and fits the head on them (``head_epochs`` epochs of the client optimizer
with a state of its own, a fresh shuffle each, ``lax.scan`` over dense steps only). The engine's
:class:`~pfedkdh_jax.engine.local.LocalTrainer` then runs the E representation epochs with a body-only
optimizer (the head's update is exactly zero, so it stays bit-identical). The two phases have
separate optimizers, as in the paper. This makes the head epochs cost about one forward pass instead
of ``head_epochs`` full steps per batch: a paper-preset MNIST round took 14.0 s against FedPer's
10.1 s (1.4×; BENCHMARKS.md) instead of the ``(head_epochs + E) / E`` = 6× of full head-phase steps.

Hyperparameters (``--method-arg``):

* ``head_epochs`` = 10: the paper runs "ten local epochs ... to train the local head, followed by one
  or five epochs for the representation" in every local update. The representation epochs are the
  run's shared E (method.md Table 1: 2 for MNIST), so the shared part gets the same budget as every
  other method. PFLlib's default is 1 head epoch (``plocal_epochs``) — the paper's 10 is used here.

Differences: the paper's SGD has momentum 0.5; here, as for every method, plain SGD with the shared
learning rate (method.md §3/§5). With ``--dropout`` > 0 the head epochs see the features without
dropout (computed once, in evaluation mode); with the default dropout 0 the cached features are
exactly those a frozen representation gives at every step. ``train_loss`` is the mean loss of the
representation epochs.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import FedRepConfig
from pfedkdh_jax.algorithms.fedper import FedPer
from pfedkdh_jax.data.device import FederatedData, gather_inputs
from pfedkdh_jax.engine.local import LocalState, LocalTrainer

FEATURE_CHUNK = 1024   # samples per forward pass when a client's features are computed
HEAD_PHASE_STREAM = 1 << 21  # folded into the client's round key for the head epochs' shuffles


@dataclasses.dataclass(frozen=True)
class FedRep(FedPer):
    """FedRep over any :class:`~pfedkdh_jax.engine.protocol.Model`: FedPer's state, server and evaluation; alternating local updates."""

    config: FedRepConfig = FedRepConfig()

    name = "fedrep"

    @property
    def trainer(self) -> LocalTrainer:
        """The representation epochs: E epochs of the client optimizer on the body (the head is frozen)."""
        c = self.config
        return C.sgd_trainer(C.cross_entropy_loss(self.model), C.body_only(C.client_tx(c)), c)

    @property
    def head_phase(self) -> LocalTrainer:
        """The head epochs: ``head_epochs`` epochs of the client optimizer (its own state) on the head
        over fixed features."""
        c = self.config
        return C.head_trainer(self.model, lr=c.lr, batch_size=c.batch_size, epochs=c.head_epochs,
                              optimizer=c.optimizer)

    def client_features(self, backbone, data: FederatedData, row: jax.Array) -> jax.Array:
        """Features ``[M, 512]`` of a client's padded train row under ``backbone`` (evaluation mode),
        computed in unrolled chunks of at most ``FEATURE_CHUNK`` samples."""
        m = row.shape[0]
        parts = [self.model.features(backbone, gather_inputs(data, row[i:i + FEATURE_CHUNK])[0])
                 for i in range(0, m, FEATURE_CHUNK)]
        return jnp.concatenate(parts, axis=0)

    def fit_head(self, backbone, head, data: FederatedData, client: jax.Array,
                 key: jax.Array):
        """The client's head after the head epochs with ``backbone`` frozen."""
        ht = self.head_phase
        if ht.epochs == 0:
            return head
        row, n, m = data.train_idx[client], data.train_n[client], data.max_train
        source = (self.client_features(backbone, data, row), data.labels[row])
        hs = ht.init(head, key, n, m)
        # as many steps as the largest possible client (static); a smaller client's extra steps are no-ops
        steps = ht.epochs * math.ceil(m / ht.batch_size)
        return ht.run_scan(hs, None, jnp.arange(m), source, steps).params

    def client_start(self, state: C.PersonalHeadsState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """θ_k ← θ_g; the head epochs on the client's persistent head φ_k; then the local state of
        the representation epochs."""
        ls = super().client_start(state, data, client, key)
        head = self.fit_head(state.backbone, ls.params["head"], data, client,
                             jax.random.fold_in(ls.key, HEAD_PHASE_STREAM))
        return ls.replace(params={"backbone": ls.params["backbone"], "head": head})


def from_config(cfg, num_classes: int, args: dict) -> FedRep:
    """FedRep of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return FedRep(C.run_model(cfg, num_classes), FedRepConfig(**C.local_config(cfg), **args))
