"""pFedKDH: personalized federated knowledge distillation with head adaptation.

Souza Neto, da Silva Júnior, Cavalcante, "pFedKDH: Personalized Federated Learning with Global
Knowledge Distillation and Local Head Adaptation". The specification implemented here is method.md.

The server keeps a global backbone θ_g and a teacher head φ_g; client k keeps a private head φ_k that
is never uploaded, averaged or overwritten by the server. In a round each selected client starts from
(θ_g, φ_k) and minimises

    J_k = (1 − λ)·CE(h_φk(b_θk(x)), y) + λ·T²·KL(q_g^T(x) ‖ q_k^T(x)) + μ/2·‖θ_k − θ_g‖²

where the teacher q_g comes from the frozen (θ_g, φ_g) of this round (evaluated without dropout).
Only θ_k is uploaded; the server averages the backbones weighted by n_k and then refits φ_g on the
auxiliary set D_s with θ_g frozen (features computed once per round).

Beyond the paper, as options (``kd_target``, ``kd_gate``; the paper's form is ``plain`` / ``none``):
class-aware forms of the teacher-to-client transfer ("How the teacher reaches a client" below;
``KD_TARGETS``, ``KD_GATES`` in configs.py) and the ablation
``persistent_heads=False``. Evaluation: pFedKDH-Fair scores (θ_g, φ_k); pFedKDH-EA (the
``personalization``) first takes head-only SGD steps — ``ea_steps`` steps, or ``ea_epochs`` epochs —
on client k's train split with θ_g frozen, for that evaluation only. ``before_training`` runs the
optional warm-up on D_s and the optional teacher refit before round 0.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp

from pfedkdh_jax import losses
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import PFedKDHConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels, Personalization
from pfedkdh_jax.data.device import FederatedData, gather_inputs
from pfedkdh_jax.engine.local import LocalState, LocalTrainer
from pfedkdh_jax.engine.protocol import Model

PyTree = Any

# How the teacher reaches a client (the paper's form is kd_target="plain", kd_gate="none"):
#   kd_target  plain    KL over all classes (the paper)
#              support  teacher and student restricted to, and renormalised over, the classes of the
#                       client's own train labels (class-aware distillation)
#              prior    the teacher's logits Bayes-corrected from D_s's class prior to the client's:
#                       z_g + log π_k − log π_Ds (absent classes get probability 0); student unrestricted
#   kd_gate    none     every sample weighted λ (the paper)
#              confidence  sample i weighted λ·q_g(y_i | x_i), the teacher's probability of the true label
#              correct  λ where the teacher's prediction is right, 0 elsewhere
#              better   λ where the teacher gives the true label more probability than the student
#                       does (T = 1, both from the forward passes the step already makes), 0 elsewhere
#              adaptive  one weight for the whole batch, λ·max(0, p̄_g − p̄_k), where p̄_g and p̄_k are the
#                       teacher's and the student's mean probability of the true label over the batch's
#                       valid samples (T = 1, from the same forward passes): the teacher's margin over
#                       the student on the client's data, 0 once the client's own model is the better.
#                       (A first form weighted the share of the student's gap the teacher closes,
#                       (p̄_g − p̄_k) / (1 − p̄_k); near-perfect students made that ratio large on tiny
#                       margins and it scored 1.4–1.8 points below λ = 0: experiments/SWEEP.md.)
# With a gate, sample i's loss is (1 − λ_i)·CE_i + λ_i·T²·KL_i: an untrusted sample keeps its full CE.


@struct.dataclass
class PFedKDHState:
    """Server state and the clients' persistent heads.

    ``heads`` carries a leading client axis ``[K, ...]``; the server's update never reads it.
    """

    backbone: PyTree        # θ_g
    teacher_head: PyTree    # φ_g
    heads: PyTree           # φ_k for every client, [K, ...]
    init_head: PyTree       # φ_g⁰ (fresh-start refit option)
    round: jax.Array        # int32 [], rounds completed


def client_labels(data: FederatedData, client: jax.Array) -> dict:
    """What class-aware distillation knows of client ``client``: its label support (bool ``[C]``,
    the classes of its train split) and ``log π_k − log π_Ds`` (``[C]``; 0 off the support), from the
    class frequencies of its train split and of D_s (add-one smoothed)."""
    c = data.num_classes
    row = data.train_idx[client]
    valid = (jnp.arange(row.shape[0]) < data.train_n[client]).astype(jnp.float32)
    counts = jax.ops.segment_sum(valid, data.labels[row], num_segments=c)
    aux_counts = jnp.bincount(data.labels[data.aux_idx], length=c).astype(jnp.float32) + 1.0
    support = counts > 0
    log_ratio = (jnp.log(jnp.maximum(counts, 1.0) / jnp.sum(counts))
                 - jnp.log(aux_counts / jnp.sum(aux_counts)))
    return {"support": support, "log_prior_ratio": jnp.where(support, log_ratio, 0.0)}


def _with_client_labels(ctx: dict, aux: dict) -> dict:
    return {**ctx, "labels": aux}


@dataclasses.dataclass(frozen=True)
class PFedKDH(Algorithm):
    """pFedKDH over any :class:`~pfedkdh_jax.engine.protocol.Model`. Static; every method is pure and jittable."""

    model: Model
    config: PFedKDHConfig = PFedKDHConfig()

    name = "pfedkdh"

    # ----------------------------------------------------------------------------------- set-up
    def init(self, key: jax.Array, data: FederatedData) -> PFedKDHState:
        """θ_g⁰, φ_g⁰ from ``key``; every client head and the teacher head start as φ_g⁰."""
        C.check_init_args(key, data)
        if data.aux_idx.shape[-1] == 0 and (self.config.teacher_epochs > 0 or self.config.warmup_epochs > 0):
            raise ValueError("PFedKDH refits its teacher head on the auxiliary set D_s, and the data have none: "
                             "build them with aux_size > 0 (or, with lam=0, set PFedKDHConfig.teacher_epochs=0 and "
                             "warmup_epochs=0: with lam > 0 the clients would distil from a teacher never fitted)")
        params = C.init_params(self.model, key, data)
        head = params["head"]
        # a buffer of its own for each field: a caller may donate the state (jit's donate_argnums)
        return PFedKDHState(backbone=params["backbone"], teacher_head=head,
                            heads=C.broadcast(head, data.num_clients),
                            init_head=jax.tree_util.tree_map(jnp.copy, head),
                            round=jnp.zeros((), jnp.int32))

    @property
    def prepares(self) -> bool:
        """The warm-up or the refit at the start is on."""
        return self.config.warmup_epochs > 0 or self.config.teacher_refit_at_start

    def before_training(self, state: PFedKDHState, data: FederatedData, key: jax.Array, train):
        """The optional warm-up (E_w epochs of CE on D_s for (θ_g, φ_g); the heads start from φ_g),
        then the optional refit of φ_g on D_s (head only)."""
        c = self.config
        if c.warmup_epochs > 0:
            trainer = C.sgd_trainer(C.cross_entropy_loss(self.model), C.client_tx(c), c,
                                    epochs=c.warmup_epochs)
            n = int(data.aux_idx.shape[0])
            params = {"backbone": state.backbone, "head": state.teacher_head}
            ls = train(trainer, trainer.init(params, jax.random.fold_in(key, 1), jnp.asarray(n), n),
                       None, data.aux_idx, data)
            head = ls.params["head"]
            state = state.replace(backbone=ls.params["backbone"], teacher_head=head,
                                  heads=jax.tree_util.tree_map(lambda h, x: jnp.broadcast_to(x, h.shape),
                                                               state.heads, head))
        if c.teacher_refit_at_start:
            head, _ = jax.jit(self.refit_teacher)(state.backbone, state.teacher_head, data,
                                                  jax.random.fold_in(key, 2))
            state = state.replace(teacher_head=head)
        return state

    @property
    def class_aware(self) -> bool:
        """Whether the local objective reads the client's own label distribution."""
        return self.config.kd_target != "plain" and C.may_be_nonzero(self.config.lam)

    @property
    def trainer(self) -> LocalTrainer:
        """The clients' local problem: J_k over (θ_k, φ_k), by the config's optimizer (SGD by default)."""
        c = self.config
        return C.sgd_trainer(self.local_loss, C.client_tx(c), c,
                             client_context=_with_client_labels if self.class_aware else None)

    def teacher_trainer(self) -> LocalTrainer:
        c = self.config
        return C.head_trainer(self.model, lr=c.teacher_lr or c.lr, batch_size=c.batch_size,
                              epochs=c.teacher_epochs, optimizer=c.teacher_optimizer)

    # ------------------------------------------------------------------------------ client side
    def context(self, state: PFedKDHState) -> PyTree:
        """What every selected client receives this round: the frozen global model."""
        return {"backbone": state.backbone, "teacher_head": state.teacher_head}

    def local_loss(self, params, ctx, x, y, mask, rng) -> jax.Array:
        """``J_k`` of one batch (masked means over the valid samples)."""
        c = self.config
        logits = C.logits(self.model, params, x, rng=rng)
        ce = losses.cross_entropy(logits, y)
        if C.may_be_nonzero(c.lam):
            teacher = C.logits(self.model, {"backbone": ctx["backbone"], "head": ctx["teacher_head"]}, x)
            kd, trust = self.transfer(logits, teacher, y, ctx.get("labels"), mask)
            lam = c.lam * trust
            loss = losses.masked_mean((1.0 - lam) * ce + lam * kd, mask)
        else:
            loss = losses.masked_mean(ce, mask)
        if C.may_be_nonzero(c.mu):
            loss = loss + losses.proximal(params["backbone"], ctx["backbone"], c.mu)
        return loss

    def transfer(self, student: jax.Array, teacher: jax.Array, y: jax.Array, labels: dict | None,
                 mask: jax.Array | None = None):
        """Per-sample distillation term ``[B]`` and trust in the teacher ``[B]`` (in [0, 1], no
        gradient) of the configured form (``kd_target``, ``kd_gate``); ``labels``: the client's label
        support and log prior ratio (see :func:`client_labels`), needed by the class-aware targets;
        ``mask``: the batch's valid samples (``[B]``; None: all), read by the batch-level gate."""
        c = self.config
        teacher = jax.lax.stop_gradient(teacher)
        if c.kd_target == "support":
            kd = losses.restricted_distillation_kl(student, teacher, c.temperature, labels["support"])
            # the gates compare the two distributions that are distilled: both restricted
            teacher, student = (losses.restrict_logits(z, labels["support"]) for z in (teacher, student))
        else:
            if c.kd_target == "prior":
                teacher = losses.prior_adjusted_logits(teacher, labels["log_prior_ratio"], labels["support"])
            kd = losses.distillation_kl(student, teacher, c.temperature)
        if c.kd_gate == "none":
            return kd, jnp.ones_like(kd)
        p_t = losses.true_class_probability(teacher, y)
        if c.kd_gate == "confidence":
            trust = p_t
        elif c.kd_gate == "correct":
            trust = (jnp.argmax(teacher, -1) == y).astype(kd.dtype)
        elif c.kd_gate == "better":
            trust = (p_t > losses.true_class_probability(jax.lax.stop_gradient(student), y)).astype(kd.dtype)
        else:  # "adaptive"
            valid = jnp.ones_like(kd) if mask is None else mask.astype(kd.dtype)
            p_s = losses.true_class_probability(jax.lax.stop_gradient(student), y)
            margin = jnp.maximum(losses.masked_mean(p_t - p_s, valid), 0.0)   # max(0, p̄_g − p̄_k)
            trust = jnp.broadcast_to(margin, kd.shape)
        return kd, trust

    def messages(self, state: PFedKDHState, update: ClientUpdate):
        """θ_g and the teacher head φ_g down (the teacher's logits are computed on the client); the
        backbone up (and the head, when heads are averaged)."""
        up = update.params["backbone"] if self.config.persistent_heads else update.params
        return {"backbone": state.backbone, "teacher_head": state.teacher_head}, up

    def client_start(self, state: PFedKDHState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """Client ``client`` sets θ_k ← θ_g and takes up its own persistent head φ_k."""
        params = {"backbone": state.backbone, "head": C.take(state.heads, client)}
        aux = client_labels(data, client) if self.class_aware else None
        return C.start_local(self.trainer, params, data, client, key, aux=aux)

    # ------------------------------------------------------------------------------ server side
    def mean_upload(self, update: ClientUpdate):
        """The backbone is averaged (the only thing that leaves a client), the head stays with its
        client; in the ablation without persistent heads the heads are averaged too."""
        if self.config.persistent_heads:
            return update.params["backbone"], update.replace(params={"head": update.params["head"]})
        return update.params, update.replace(params=None)

    def server_update_from_mean(self, state: PFedKDHState, data: FederatedData, selected: jax.Array,
                                mean, rest: ClientUpdate, key: jax.Array) -> tuple[PFedKDHState, dict]:
        """Keep each selected head with its client; the backbones' mean is θ_g; refit φ_g."""
        if self.config.persistent_heads:
            backbone, heads = mean, C.put(state.heads, selected, rest.params["head"])
        else:  # ablation: the heads are aggregated like the backbone
            backbone = mean["backbone"]
            heads = jax.tree_util.tree_map(lambda all_h, h: jnp.broadcast_to(h, all_h.shape),
                                           state.heads, mean["head"])
        teacher_head, teacher_loss = self.refit(state, backbone, data, jax.random.fold_in(key, data.num_clients))
        finite = jnp.all(jnp.array([jnp.all(jnp.isfinite(x)) for x in
                                    jax.tree_util.tree_leaves((backbone, teacher_head))]))
        metrics = {**C.round_metrics(rest), "teacher_loss": teacher_loss,
                   "finite_params": finite.astype(jnp.float32)}
        return state.replace(backbone=backbone, teacher_head=teacher_head, heads=heads,
                             round=state.round + 1), metrics

    def refit(self, state: PFedKDHState, backbone: PyTree, data: FederatedData, key: jax.Array):
        """``(φ_g, loss)``: the teacher head refit on D_s over the features of the new ``backbone``
        (from the last round's head, or from its initial one)."""
        start = state.teacher_head if self.config.teacher_warm_start else state.init_head
        return self.refit_teacher(backbone, start, data, key)

    def refit_teacher(self, backbone: PyTree, head: PyTree, data: FederatedData, key: jax.Array):
        """Head-only SGD on D_s over features of the frozen backbone (computed once)."""
        x, y = gather_inputs(data, data.aux_idx)
        feats = self.model.features(backbone, x)
        return C.fit_head(self.teacher_trainer(), head, feats, y, key)

    # ------------------------------------------------------------------------------- evaluation
    def eval_models(self, state: PFedKDHState) -> EvalModels:
        """pFedKDH-Fair: (θ_g, φ_k) per client; the global model (θ_g, φ_g)."""
        return EvalModels(backbone=state.backbone, heads=state.heads, global_head=state.teacher_head)

    @property
    def personalization(self) -> Personalization | None:
        """pFedKDH-EA: head-only SGD on the client's train features with θ_g frozen (``*_ea``)."""
        c = self.config
        if c.ea_steps == 0 and c.ea_epochs == 0:
            return None
        lr = c.ea_lr or c.lr
        if c.ea_epochs > 0:
            trainer = C.head_trainer(self.model, lr=lr, batch_size=c.batch_size, epochs=c.ea_epochs,
                                     optimizer=c.ea_optimizer)
        else:
            # enough epochs for the smallest client to take ea_steps steps (capped at ea_steps)
            trainer = C.head_trainer(self.model, lr=lr, batch_size=c.batch_size,
                                     epochs=max(1, c.ea_steps), max_steps=c.ea_steps, optimizer=c.ea_optimizer)

        def start(state: PFedKDHState, data: FederatedData, client: jax.Array, key: jax.Array):
            return trainer.init(C.take(state.heads, client), jax.random.fold_in(key, client),
                                data.train_n[client], data.max_train)

        def models(state: PFedKDHState, heads: PyTree) -> EvalModels:
            return EvalModels(backbone=state.backbone, heads=heads)

        return Personalization(trainer=trainer, start=start, models=models, on_features=True, suffix="_ea")


def from_config(cfg, num_classes: int, args: dict) -> PFedKDH:
    """pFedKDH from a :class:`~pfedkdh_jax.run.config.RunConfig` (its hyperparameters are run options,
    the fields of :class:`PFedKDHConfig` the registry lists in ``PFEDKDH_OPTIONS``)."""
    from pfedkdh_jax.algorithms import PFEDKDH_OPTIONS

    del args
    return PFedKDH(C.run_model(cfg, num_classes), PFedKDHConfig(
        **C.local_config(cfg), **{name: getattr(cfg, name) for name in PFEDKDH_OPTIONS}))
