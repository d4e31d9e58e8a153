"""FedRep: a shared representation and personal heads, trained in alternation.

Collins, Hassani, Mokhtari, Shakkottai, "Exploiting Shared Representations for Personalized
Federated Learning", ICML 2021.

Round t: selected client k sets θ_k ← θ_g and, with its persistent head φ_k,

1. trains the head only, ``head_epochs`` epochs of SGD with θ_k frozen;
2. then trains the representation only, E epochs of SGD with φ_k frozen;

uploads θ_k (the head stays with the client), and the server sets θ_g ← Σ n_k θ_k / Σ n_k. Evaluation:
(θ_g, φ_k) per client; no server-side head, so no ``global_*`` accuracy.

How it runs on the shared engine: one :class:`~pfedkdh_jax.engine.LocalTrainer` of
``head_epochs + E`` epochs (a fresh shuffle every epoch) whose optimizer is
``phased(head_only(sgd), body_only(sgd))`` (:mod:`pfedkdh_jax.baselines._common`): two separate
optimizers, the first making the client's first ``head_epochs · ceil(n_k / B)`` updates, the second
the rest. That boundary depends on n_k, so ``client_start`` writes it into the optimizer state; the
compiled step never changes. During the head phase the backbone update is exactly zero (and vice
versa), so the frozen part stays bit-identical.

Hyperparameters (``--method-arg``):

* ``head_epochs`` = 10: the paper runs "ten local epochs ... to train the local head, followed by one
  or five epochs for the representation" in every local update. The representation epochs are the
  run's shared E (method.md Table 1: 2 for MNIST), so the shared part gets the same budget as every
  other method. PFLlib's default is 1 head epoch (``plocal_epochs``) — the paper's 10 is used here.

Differences: the paper's SGD has momentum 0.5; here, as for every method, plain SGD with the shared
learning rate (method.md §3/§5). A head-phase step still computes the backbone gradient (discarded by
the optimizer), so it costs about as much as a body step; the head epochs make FedRep's local work
``(head_epochs + E) / E`` times that of FedAvg.
"""

from __future__ import annotations

import dataclasses

import jax
import optax

from pfedkdh_jax.baselines import _common as C
from pfedkdh_jax.baselines.fedper import FedPer
from pfedkdh_jax.engine import LocalState, LocalTrainer
from pfedkdh_jax.federated_data import FederatedData
from pfedkdh_jax.model import CNN

DEFAULT_HEAD_EPOCHS = 10


@dataclasses.dataclass(frozen=True)
class FedRepConfig(C.LocalConfig):
    head_epochs: int = DEFAULT_HEAD_EPOCHS   # head-only epochs before the E representation epochs


@dataclasses.dataclass(frozen=True)
class FedRep(FedPer):
    """FedRep over a :class:`CNN`: FedPer's state, server and evaluation; alternating local updates."""

    config: FedRepConfig = FedRepConfig()

    name = "fedrep"

    @property
    def trainer(self) -> LocalTrainer:
        """``head_epochs`` of head-only SGD, then E epochs of body-only SGD (separate optimizers)."""
        c = self.config
        tx = C.phased(C.head_only(optax.sgd(c.lr)), C.body_only(optax.sgd(c.lr)))
        return C.sgd_trainer(C.cross_entropy_loss(self.model), tx, c, epochs=c.head_epochs + c.local_epochs)

    def head_steps(self, n: jax.Array) -> jax.Array:
        """Number of head-phase steps of a client with ``n`` samples: ``head_epochs · ceil(n / B)``."""
        return self.config.head_epochs * C.steps_per_epoch(n, self.config.batch_size)

    def client_start(self, state: C.PersonalHeadsState, data: FederatedData, client: jax.Array,
                     round_key: jax.Array) -> LocalState:
        """FedPer's start (θ_g, φ_k), with this client's head/body boundary in the optimizer state."""
        ls = super().client_start(state, data, client, round_key)
        return ls.replace(opt_state=C.with_switch(ls.opt_state, self.head_steps(ls.n)))


def from_config(cfg, num_classes: int, args: dict) -> FedRep:
    """FedRep with the run's shared budget; ``args['head_epochs']`` head epochs per round."""
    head_epochs = int(args.get("head_epochs", DEFAULT_HEAD_EPOCHS))
    if head_epochs < 0:
        raise ValueError(f"fedrep head_epochs must be >= 0; got {head_epochs}")
    return FedRep(CNN(num_classes, cfg.dropout),
                  FedRepConfig(**dataclasses.asdict(C.local_config(cfg)), head_epochs=head_epochs))
