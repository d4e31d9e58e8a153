"""FedFed: feature distillation — clients share the performance-sensitive part of their data.

Z. Yang, Y. Zhang, Y. Zheng, X. Tian, H. Peng, T. Liu, B. Han, "FedFed: Feature Distillation against
Data Heterogeneity in Federated Learning", NeurIPS 2023. The specification implemented here is
method.md §5.2; it is a method of two phases (:class:`~pfedkdh_jax.engine.protocol.Phase`) on one
state.

* **Phase A** (``feature_rounds`` = 15 rounds, sampled clients as in any round): each client holds the
  classifier f (the CNN) and a VAE (:mod:`.vae`) and takes one local epoch of batches of 32, each batch
  in three passes: (1) mixup on f only (λ ~ Beta(2, 2)); (2) the VAE alone on
  ``5·MSE(x_r, x) + 0.005·KL/(64·3·F)`` with AdamW (lr 1e-3, weight decay 1e-6); (3) jointly: the
  sensitive part ``x_s = x − x_r`` and two noisy copies ``s1 = x_s + N(0, 0.15²)``,
  ``s2 = x_s + N(0, 0.25²)``, loss = the reconstruction terms + ``2.0·CE(f([s1; s2]), [y; y]) +
  0.4·CE(f(x), y)``, the CE's gradient reaching the VAE through x_s; both optimizers step. Clients
  upload f and the VAE (parameters and batch-norm statistics); the server averages both weighted by
  n_k. The VAE's AdamW state stays with its client (``vae_opt``, ``[K, ...]``). Scored with the global f.
* **Generation**, once, entering phase B: with the global VAE (z = its mean, batch norm in eval mode)
  every client computes s1 and s2 for each of its train samples; the server pools them (2·N samples,
  with their labels) and every client receives the pool. x and x_r never leave a client.
* **Phase B** (the remaining rounds): FedAvg from phase A's f; each selected client trains on its own
  train split plus n_k samples drawn uniformly without replacement from the pool, redrawn every round
  (E epochs, batch 64: the shared budget over its 2·n_k samples). Scored with the global model.

Phase A's rounds count in the run's total (the paper's budget of rounds is the same for every
method): with 50 rounds, 15 of feature distillation and 35 of FedAvg on the enlarged data.

On the engine: a client's batch is drawn by index from its own row *and* from the pool (the batch
gather reads the pool from the round's context), with masks, so each phase is one compiled program
and clients stay vmappable. Pixels: the VAE works on [0, 1] pixels; f sees a client's own images
normalised to [−1, 1] (method.md §2) and the sensitive features (in phase A's joint pass and in the
pool), x − x_r plus noise on [0, 1] pixels, mapped once as the images are (2s − 1, never again), so
that both inputs of f share one range, as in the authors' code, where images and features both stay on
[0, 1] (``feature_range="images"``; ``"pixels"`` gives f the features as generated, the default before
2026-12-06: on MNIST α = 0.05 it scored lower on a validation split, BENCHMARKS.md). A known defect of a
public implementation — adding a client's index arrays element-wise instead of joining them, so it
trained on arbitrary samples, test splits included — is not reproduced: a client's row is its own train
samples followed by its pool draws (tested: nothing else is ever gathered).

Hyperparameters (``--method-arg``; method.md §5.2, the paper's code): ``feature_rounds`` = 15;
``vae_width`` = 32 (the VAE's channels; the tests use a narrower one to stay quick); ``feature_range`` =
images (above); the noise levels, loss weights and VAE optimizer are constants of :class:`FedFedConfig`.
Memory: the pool holds 2·N images (float16) in the state, the clients' VAE optimizer states
2·K copies of the VAE (≈ 13× the CNN's parameters) — about 1.2 GB for MNIST, K = 20.
(Over 300 lines: phase A's three passes, the pool's generation and phase B are one method.)
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct as struct
import jax
import jax.numpy as jnp
import optax

from pfedkdh_jax import losses
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms.configs import FedFedConfig
from pfedkdh_jax.engine.protocol import Algorithm, ClientUpdate, EvalModels, Phase
from pfedkdh_jax.algorithms.vae import VAE, kl_term, reconstruction
from pfedkdh_jax.data.device import FederatedData, gather_inputs
from pfedkdh_jax.engine.local import LocalState, LocalTrainer, mean_loss
from pfedkdh_jax.engine.protocol import Model

PyTree = Any
_POOL_STREAM = 3   # fold_in tag of a client's pool draws
_VAE_STREAM = 5    # ... of the VAE's initialisation


@struct.dataclass
class FedFedState:
    params: PyTree          # the global classifier f {"backbone", "head"}
    vae: PyTree             # the global VAE {"params", "batch_stats"}
    vae_opt: PyTree         # every client's AdamW state of its VAE, [K, ...] (never leaves the client)
    pool_x: jax.Array       # float16 [2S, H, W, C]: the shared pool (s1 of the flat train list, then s2), in f's range
    pool_y: jax.Array       # int32 [2S]
    pool_valid: jax.Array   # bool [2S] (False for the padding of the flat train list, and before phase B)
    round: jax.Array        # int32 [], rounds completed
    num_clients: int = struct.field(pytree_node=False)   # K


def to_unit(x: jax.Array) -> jax.Array:
    """[−1, 1] (the normalised inputs) → [0, 1] pixels (the VAE's)."""
    return (x + 1.0) * 0.5


def mixup_partner(key: jax.Array, mask: jax.Array) -> jax.Array:
    """Each valid slot's mixup partner: the next valid slot in a random order (a derangement of the
    valid slots when there are two or more); padding slots map to themselves."""
    b = mask.shape[0]
    order = jnp.argsort(jnp.where(mask, jax.random.uniform(key, (b,)), 2.0))
    n = jnp.maximum(jnp.sum(mask.astype(jnp.int32)), 1)
    rank = jnp.zeros(b, jnp.int32).at[order].set(jnp.arange(b, dtype=jnp.int32))
    partner = order[(rank + 1) % n]
    return jnp.where(mask, partner, jnp.arange(b))


def noisy_copies(x_s: jax.Array, key: jax.Array, stds) -> tuple[jax.Array, jax.Array]:
    k1, k2 = jax.random.split(key)
    return (x_s + stds[0] * jax.random.normal(k1, x_s.shape), x_s + stds[1] * jax.random.normal(k2, x_s.shape))


def _vae_tx(config: FedFedConfig) -> optax.GradientTransformation:
    """The VAE's optimizer (default AdamW at ``vae_lr`` with ``vae_weight_decay``, method.md §5.2)."""
    if config.vae_optimizer is None:
        return optax.adamw(config.vae_lr, weight_decay=config.vae_weight_decay)
    return C.make_tx(config.vae_optimizer, config.vae_lr)


def _init_global(model: Model, key: jax.Array, data: FederatedData, config: FedFedConfig) -> FedFedState:
    C.check_init_args(key, data)
    shape = tuple(data.input_shape)
    if len(shape) != 3 or shape[0] % 4 or shape[1] % 4:
        raise ValueError(f"FedFed: its VAE takes images (H, W, C) whose H and W are multiples of 4 (two stride-2 "
                         f"convolutions and their mirror); the data's samples have shape {shape}")
    params = C.init_params(model, key, data)
    vae = VAE(data.input_shape[-1], config.vae_width).init(jax.random.fold_in(key, _VAE_STREAM),
                                         jnp.zeros((1,) + tuple(data.input_shape)))
    vae = {"params": vae["params"], "batch_stats": vae["batch_stats"]}
    adamw = _vae_tx(config)
    s = data.train_flat.shape[0]
    return FedFedState(params=params, vae=vae, vae_opt=C.broadcast(adamw.init(vae["params"]), data.num_clients),
                       pool_x=jnp.zeros((2 * s,) + tuple(data.input_shape), jnp.float16),
                       pool_y=jnp.zeros((2 * s,), jnp.int32), pool_valid=jnp.zeros((2 * s,), bool),
                       round=jnp.zeros((), jnp.int32), num_clients=data.num_clients)


def _global_eval(state: FedFedState) -> EvalModels:
    """The global f for everyone (FedFed is scored with its global model)."""
    return EvalModels(backbone=state.params["backbone"], heads=C.broadcast(state.params["head"], state.num_clients),
                      global_head=state.params["head"])


@dataclasses.dataclass(frozen=True)
class _FedFedBase(Algorithm):
    """What both phases share: the model, the configuration and the state."""

    model: Model
    config: FedFedConfig = FedFedConfig()

    name = "fedfed"

    def init(self, key: jax.Array, data: FederatedData) -> FedFedState:
        return _init_global(self.model, key, data, self.config)


@dataclasses.dataclass(frozen=True)
class FedFedFeatures(_FedFedBase):
    """FedFed's phase A (feature distillation: f and the VAE trained together), a method of one phase;
    its :meth:`build_pool` enters phase B."""

    # ----------------------------------------------------------------------- phase A: local problem
    @property
    def trainer(self) -> LocalTrainer:
        """One epoch of batches of 32; a step is the three passes (``update``)."""
        c = self.config
        return LocalTrainer(loss_fn=self.joint_loss, tx=optax.identity(), gather=gather_inputs, epochs=1,
                            batch_size=c.vae_batch_size, update=self.three_passes)

    def optimizers(self):
        c = self.config
        return C.client_tx(c), _vae_tx(c)

    def messages(self, state: FedFedState, update: ClientUpdate):
        """Phase A: f and the VAE down and up (the VAE's optimizer state stays with the client)."""
        return (state.params, state.vae), update.params

    def client_start(self, state: FedFedState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """The global f and VAE; the client's own AdamW state of the VAE."""
        params = {"f": state.params, "vae": state.vae["params"], "bs": state.vae["batch_stats"]}
        local = C.start_local(self.trainer, params, data, client, key)
        sgd, _ = self.optimizers()
        return local.replace(opt_state={"f": sgd.init(state.params), "vae": C.take(state.vae_opt, client)})

    def _vae_apply(self, vae_params, batch_stats, x01, rng, mask, channels):
        (x_r, mean, logvar), new = VAE(channels, self.config.vae_width).apply(
            {"params": vae_params, "batch_stats": batch_stats}, x01, train=True, rng=rng, mask=mask,
            mutable=["batch_stats"])
        return x_r, mean, logvar, new["batch_stats"]

    def as_f_input(self, s: jax.Array) -> jax.Array:
        """Sensitive features (on [0, 1] pixels) in the range f sees them in (``feature_range``)."""
        return 2.0 * s - 1.0 if self.config.feature_range == "images" else s

    def recon_terms(self, x_r, x01, mean, logvar, mask):
        c = self.config
        return c.recon_weight * reconstruction(x_r, x01, mask) + c.kl_weight * kl_term(mean, logvar, mask)

    def joint_loss(self, params, ctx, x, y, mask, rng):
        """Pass (3)'s objective over {f, VAE}: reconstruction + 2·CE(f([s1; s2])) + 0.4·CE(f(x))."""
        loss, _ = self._joint(params["f"], params["vae"], params["bs"], x, y, mask, rng)
        return loss

    def _joint(self, f, vae_params, batch_stats, x, y, mask, rng):
        c = self.config
        x01 = to_unit(x)
        x_r, mean, logvar, bs = self._vae_apply(vae_params, batch_stats, x01, jax.random.fold_in(rng, 1),
                                                mask, x.shape[-1])
        s1, s2 = noisy_copies(x01 - x_r, jax.random.fold_in(rng, 2), c.noise_std)
        logits = C.logits(self.model, f, self.as_f_input(jnp.concatenate([s1, s2])), rng=jax.random.fold_in(rng, 3))
        two = jnp.concatenate([mask, mask])
        sensitive = losses.masked_mean(losses.cross_entropy(logits, jnp.concatenate([y, y])), two)
        plain = losses.masked_mean(losses.cross_entropy(C.logits(self.model, f, x, rng=jax.random.fold_in(rng, 4)), y), mask)
        loss = self.recon_terms(x_r, x01, mean, logvar, mask) + c.sensitive_ce_weight * sensitive + c.ce_weight * plain
        return loss, bs

    def three_passes(self, params, opt_state, ctx, x, y, mask, rng):
        """One batch: (1) mixup on f, (2) the VAE's reconstruction, (3) the joint pass."""
        c = self.config
        sgd, adamw = self.optimizers()
        f, vae_params, bs = params["f"], params["vae"], params["bs"]
        f_opt, vae_opt = opt_state["f"], opt_state["vae"]
        # (1) mixup, f only
        lam = jax.random.beta(jax.random.fold_in(rng, 10), c.mixup_alpha, c.mixup_alpha)
        partner = mixup_partner(jax.random.fold_in(rng, 11), mask)

        def mix_loss(f):
            logits = C.logits(self.model, f, lam * x + (1.0 - lam) * x[partner], rng=jax.random.fold_in(rng, 12))
            ce = lam * losses.cross_entropy(logits, y) + (1.0 - lam) * losses.cross_entropy(logits, y[partner])
            return losses.masked_mean(ce, mask)
        g = jax.grad(mix_loss)(f)
        u, f_opt = sgd.update(g, f_opt, f)
        f = optax.apply_updates(f, u)
        # (2) the VAE's reconstruction alone
        x01 = to_unit(x)

        def vae_loss(vp):
            x_r, mean, logvar, new_bs = self._vae_apply(vp, bs, x01, jax.random.fold_in(rng, 13), mask, x.shape[-1])
            return self.recon_terms(x_r, x01, mean, logvar, mask), new_bs
        (_, bs), g = jax.value_and_grad(vae_loss, has_aux=True)(vae_params)
        u, vae_opt = adamw.update(g, vae_opt, vae_params)
        vae_params = optax.apply_updates(vae_params, u)
        # (3) jointly: CE through x_s reaches the VAE; both optimizers step
        (loss, bs), (g_f, g_v) = jax.value_and_grad(
            lambda f, vp: self._joint(f, vp, bs, x, y, mask, jax.random.fold_in(rng, 14)), argnums=(0, 1),
            has_aux=True)(f, vae_params)
        u, f_opt = sgd.update(g_f, f_opt, f)
        f = optax.apply_updates(f, u)
        u, vae_opt = adamw.update(g_v, vae_opt, vae_params)
        vae_params = optax.apply_updates(vae_params, u)
        return loss, {"f": f, "vae": vae_params, "bs": bs}, {"f": f_opt, "vae": vae_opt}

    def client_finish(self, state: FedFedState, data: FederatedData, client: jax.Array, local: LocalState,
                      key: jax.Array) -> ClientUpdate:
        """f and the VAE go up; the VAE's AdamW state stays with the client (carried in ``aux``)."""
        del state, data, client, key
        return ClientUpdate(params=local.params, loss=mean_loss(local), aux={"vae_opt": local.opt_state["vae"]})

    def server_update(self, state: FedFedState, data: FederatedData, selected: jax.Array,
                      updates: ClientUpdate, key: jax.Array) -> tuple[FedFedState, dict]:
        """f and the VAE (parameters and batch statistics) averaged weighted by n_k."""
        del key
        avg = C.average_uploads(updates.params, data, selected)
        return state.replace(params=avg["f"], vae={"params": avg["vae"], "batch_stats": avg["bs"]},
                             vae_opt=C.put(state.vae_opt, selected, updates.aux["vae_opt"]),
                             round=state.round + 1), C.round_metrics(updates)

    def eval_models(self, state: FedFedState) -> EvalModels:
        return _global_eval(state)

    # ------------------------------------------------------------------------------ generation
    def sensitive_features(self, vae: PyTree, data: FederatedData, idx: jax.Array, key: jax.Array):
        """s1, s2 of the pool samples ``idx`` with the VAE in eval mode (z = its mean), on [0, 1] pixels."""
        x01 = to_unit(gather_inputs(data, idx)[0])
        x_r, _, _ = VAE(x01.shape[-1], self.config.vae_width).apply(vae, x01)
        return noisy_copies(x01 - x_r, key, self.config.noise_std)

    def build_pool(self, state: FedFedState, data: FederatedData, key: jax.Array) -> FedFedState:
        """The shared pool, once: s1 and s2 of every client's train samples (the flat train list, in
        chunks), with their labels."""
        c = data.eval_chunk
        chunks = data.train_flat.reshape(-1, c)

        def one(args):
            g, idx = args
            return self.sensitive_features(state.vae, data, idx, jax.random.fold_in(key, g))
        s1, s2 = (self.as_f_input(s) for s in jax.lax.map(one, (jnp.arange(chunks.shape[0]), chunks)))
        shape = (-1,) + tuple(data.input_shape)
        valid = data.train_flat_client < data.num_clients
        labels = data.labels[data.train_flat]
        return state.replace(pool_x=jnp.concatenate([s1.reshape(shape), s2.reshape(shape)]).astype(jnp.float16),
                             pool_y=jnp.concatenate([labels, labels]), pool_valid=jnp.concatenate([valid, valid]))


@dataclasses.dataclass(frozen=True)
class FedFed(FedFedFeatures):
    """FedFed over any :class:`~pfedkdh_jax.engine.protocol.Model`: ``feature_rounds`` rounds of phase A
    (:class:`FedFedFeatures`), then phase B (:class:`FedFedAvg`, FedAvg on own data plus the shared
    pool, which :meth:`build_pool` makes at its first round). Run it with
    :class:`~pfedkdh_jax.engine.runner.PhasedRunner`, or a round function per phase."""

    @property
    def phases(self) -> tuple[Phase, ...]:
        c = self.config
        return (Phase(FedFedFeatures(self.model, c), c.feature_rounds),
                Phase(FedFedAvg(self.model, c), None, enter=self.build_pool))


@dataclasses.dataclass(frozen=True)
class FedFedAvg(_FedFedBase):
    """FedFed's phase B: FedAvg of f over each client's own data plus n_k draws from the pool."""

    @property
    def trainer(self) -> LocalTrainer:
        return LocalTrainer(loss_fn=C.cross_entropy_loss(self.model), tx=C.client_tx(self.config),
                            gather=gather_with_pool, epochs=self.config.local_epochs,
                            batch_size=self.config.batch_size, gather_context=True)

    def context(self, state: FedFedState) -> PyTree:
        """The shared pool every client receives."""
        return {"pool_x": state.pool_x, "pool_y": state.pool_y}

    def local_samples(self, n: int) -> int:
        return 2 * n   # its own n_k and as many pool draws

    def messages(self, state: FedFedState, update: ClientUpdate):
        """Phase B: f down and up (the pool reached every client once, entering the phase)."""
        return state.params, update.params

    def client_start(self, state: FedFedState, data: FederatedData, client: jax.Array,
                     key: jax.Array) -> LocalState:
        """The global f; the client's row is its own train samples, then n_k pool draws."""
        row = client_row(state, data, client, jax.random.fold_in(jax.random.fold_in(key, client), _POOL_STREAM))
        n = data.train_n[client]
        return self.trainer.init(state.params, jax.random.fold_in(key, client), 2 * n, 2 * data.max_train,
                                 row=row)

    def server_update(self, state: FedFedState, data: FederatedData, selected: jax.Array,
                      updates: ClientUpdate, key: jax.Array) -> tuple[FedFedState, dict]:
        del key
        # the pool's size, for a loop of one's own to see: 0 means phase B began without phase.enter
        # (build_pool), and its clients drew blank entries
        metrics = {**C.round_metrics(updates), "pool_entries": jnp.sum(state.pool_valid.astype(jnp.int32))}
        return state.replace(params=C.average_uploads(updates.params, data, selected), round=state.round + 1), metrics

    def eval_models(self, state: FedFedState) -> EvalModels:
        return _global_eval(state)


def client_row(state: FedFedState, data: FederatedData, client: jax.Array, key: jax.Array) -> jax.Array:
    """Client ``client``'s row ``[2M]``: its n_k own train indices (pool-of-images indices), then n_k
    distinct pool entries drawn uniformly (encoded as ``N_images + entry``), then padding (0)."""
    m = data.max_train
    n = data.train_n[client]
    u = jnp.where(state.pool_valid, jax.random.uniform(key, state.pool_valid.shape), -1.0)
    draws = jax.lax.top_k(u, m)[1]            # m distinct valid entries in random order
    slots = jnp.arange(2 * m)
    own = data.train_idx[client][jnp.minimum(slots, m - 1)]
    pool = data.images.shape[0] + draws[jnp.clip(slots - n, 0, m - 1)]
    return jnp.where(slots < n, own, jnp.where(slots < 2 * n, pool, 0)).astype(jnp.int32)


def gather_with_pool(data: FederatedData, idx: jax.Array, ctx: dict):
    """A batch from a row of both kinds of index: own images (normalised) and pool features."""
    n_img = data.images.shape[0]
    own = idx < n_img
    x_img, y_img = gather_inputs(data, jnp.minimum(idx, n_img - 1))
    j = jnp.maximum(idx - n_img, 0)
    x_pool, y_pool = ctx["pool_x"][j].astype(jnp.float32), ctx["pool_y"][j]
    x = jnp.where(own.reshape((-1,) + (1,) * (x_img.ndim - 1)), x_img, x_pool)
    return x, jnp.where(own, y_img, y_pool)


def from_config(cfg, num_classes: int, args: dict) -> FedFed:
    """FedFed of a run: the run's model, budget and optimizer, ``args`` its own options (``--method-arg``)."""
    return FedFed(C.run_model(cfg, num_classes), FedFedConfig(**C.local_config(cfg), **args))
