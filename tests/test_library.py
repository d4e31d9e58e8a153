"""pfedkdh_jax as building blocks (issue 23): a user's model, optimizer and data, every method by
name, and the pure pieces inside a user's own ``jit`` / ``lax.scan``."""

import dataclasses
import importlib.metadata
import importlib.util
import json
import pathlib
import typing
import warnings

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import pfedkdh_jax as p
from pfedkdh_jax.data import DataError, load_pool

NAMES = ("FedAvg", "FedProx", "FedPer", "FedRep", "FedBABU", "Ditto", "PFedMe", "FedProto", "FedALA", "PFedSim",
         "FedFed", "PFedKDH")
# small local work for one round on the digits set (every other value the config's default)
SMALL = {"FedRep": dict(head_epochs=1), "FedBABU": dict(finetune_epochs=1), "PFedMe": dict(inner_steps=2),
         "FedALA": dict(start_epochs=1), "PFedSim": dict(rounds=2, warmup=1),
         "FedFed": dict(feature_rounds=1, vae_width=8), "PFedKDH": dict(lam=0.5, ea_steps=2, teacher_epochs=1)}


class SmallBackbone(nn.Module):
    """Not the paper's CNN: one strided convolution and a 128-d feature."""

    @nn.compact
    def __call__(self, x):
        x = nn.relu(nn.Conv(8, (3, 3), strides=(2, 2))(x))
        return nn.relu(nn.Dense(128)(x.reshape(x.shape[0], -1)))


@pytest.fixture(scope="module")
def digits():
    pool = load_pool("digits")
    return p.from_arrays(pool.images[:600], pool.labels[:600], num_clients=4, alpha=1.0, aux_size=60, seed=0)


def small_model():
    return p.LinenModel(SmallBackbone(), nn.Dense(10))


def with_host_noise(base):
    """``base`` whose loss is scaled by a number drawn in Python when traced: fixed in each program, so each
    layout, and each trace of one, holds its own (what check_method must name)."""
    @dataclasses.dataclass(frozen=True)
    class HostNoise(base):
        @property
        def trainer(self):
            t = super().trainer
            scale = float(np.random.default_rng().uniform(0.5, 1.5))
            return dataclasses.replace(t, loss_fn=lambda *a: scale * t.loss_fn(*a))
    return HostNoise


@pytest.mark.parametrize("name", NAMES)
def test_every_method_by_name_trains_a_users_128d_model(digits, name):
    config = getattr(p, name + "Config")(local_epochs=1, batch_size=32, **SMALL.get(name, {}))
    algo = getattr(p, name)(small_model(), config)
    state = algo.init(jax.random.key(0), digits)
    algo = algo.phases[0].algorithm      # a method of several phases (FedFed) has a round per phase
    round_fn = jax.jit(p.make_round(algo, p.Layout("vmap", "scan")))
    new, metrics = round_fn(state, digits, jnp.array([0, 2], jnp.int32), jax.random.key(1))
    assert np.isfinite(float(metrics["train_loss"]))
    moved = [not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(new))
             if jnp.issubdtype(a.dtype, jnp.floating)]
    assert any(moved)
    scores = jax.jit(p.make_evaluate(algo, p.Layout("vmap", "scan")))(new, digits, jax.random.key(2))
    assert 0.0 <= float(scores["personalized_macro_accuracy"]) <= 1.0


def test_a_model_that_is_not_one_is_named():
    with pytest.raises(TypeError, match="LinenModel"):        # a bare flax module
        p.FedAvg(SmallBackbone())
    with pytest.raises(TypeError, match="object given is not a pfedkdh_jax Model: it lacks init.*features.*logits_from_features"):
        p.FedPer(object())

    class NoRng:
        def init(self, key, shape):
            return {}

        def features(self, b, x):
            return x

        def logits_from_features(self, h, z):
            return z
    with pytest.raises(TypeError, match=r"FedPer\(model=...\): NoRng.features must take the keyword rng"):
        p.FedPer(NoRng())

    class Dropping(nn.Module):
        @nn.compact
        def __call__(self, x, train: bool = False):
            return nn.Dropout(0.5, deterministic=not train)(x.reshape(x.shape[0], -1))
    with pytest.warns(UserWarning, match=r"takes 'train' but train_kwarg is None.*pass train_kwarg='train'"):
        p.LinenModel(Dropping(), nn.Dense(10))
    with pytest.raises(ValueError, match=r"flax's deterministic is the opposite"):
        p.LinenModel(Dropping(), nn.Dense(10), train_kwarg="deterministic")


def test_model_shapes_are_checked_before_anything_runs(digits):
    class NoSplit:
        def init(self, key, shape):
            return (1, 2)

        def features(self, b, x, *, rng=None):
            return x

        def logits_from_features(self, h, z):
            return z
    with pytest.raises(ValueError, match=r"must return \{'backbone': ..., 'head': ...\}; got a tuple"):
        p.FedAvg(NoSplit()).init(jax.random.key(0), digits)
    wrong_head = p.LinenModel(SmallBackbone(), nn.Dense(7))
    with pytest.raises(ValueError, match=r"\[B, 10\] logits"):
        p.FedPer(wrong_head).init(jax.random.key(0), digits)


class TokenBackbone(nn.Module):
    """Token ids [B, L] through an embedding: a backbone whose inputs are integers."""

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(16)(nn.Embed(20, 8)(x).mean(axis=1)))


def test_integer_inputs_reach_a_users_embedding_in_every_probe():
    """Token ids stay int32 (from_arrays) and LinenModel(input_dtype=) builds with them; FedProto's and
    pFedSim's feature probes take the data's dtype; a float example batch is named with the fix."""
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 240)
    x = (rng.integers(0, 6, (240, 5)) + 6 * y[:, None]).astype(np.int32) % 20   # learnable from the tokens
    data = p.from_arrays(x, y, num_clients=3, alpha=5.0, aux_size=30, seed=0)
    assert data.input_dtype == jnp.int32
    model = p.LinenModel(TokenBackbone(), nn.Dense(3), input_dtype=jnp.int32)
    for name in ("FedAvg", "FedProto", "PFedSim"):
        algo = p.make_method(name, model, local_epochs=1, batch_size=32)
        state = algo.init(jax.random.key(0), data)
        _, metrics = jax.jit(p.make_round(algo, p.Layout("vmap", "scan")))(state, data, jnp.array([0, 2]),
                                                                             jax.random.key(1))
        assert np.isfinite(float(metrics["train_loss"])), name
    with pytest.raises(ValueError, match=r"LinenModel.init\(key, \(5,\)\) failed.*input_dtype=jnp.int32"):
        p.FedAvg(p.LinenModel(TokenBackbone(), nn.Dense(3))).init(jax.random.key(0), data)
    with pytest.raises(ValueError, match=r"LinenModel.init\(key, \(5,\)\) failed on the data's inputs") as e:
        p.FedAvg(small_model()).init(jax.random.key(0), data)   # an image model on token rows: named, one line
    assert "\n" not in str(e.value)
    from pfedkdh_jax.run import preflight   # the run's memory pre-flight compiles a step on the data's dtype
    assert preflight.step_temp_bytes(3, (5,), 8, model, data.input_dtype) >= 0


def test_two_model_methods_take_an_optimizer_that_reads_the_models_structure(digits):
    """Ditto's global and personal copies, pFedMe's w: each is {"backbone", "head"} to the optimizer, so
    adamw's mask by part works as in FedAvg; an object with optax's init/update is an optimizer too."""
    masked = optax.adamw(1e-3, weight_decay=1e-2, mask={"backbone": True, "head": False})
    sel, key = jnp.array([0, 2], jnp.int32), jax.random.key(1)
    for name in ("Ditto", "PFedMe"):
        algo = p.make_method(name, small_model(), optimizer=masked, local_epochs=1, batch_size=32,
                             **({"inner_steps": 2} if name == "PFedMe" else {}))
        state = algo.init(jax.random.key(0), digits)
        _, metrics = jax.jit(p.make_round(algo, p.Layout("vmap", "scan")))(state, digits, sel, key)
        assert np.isfinite(float(metrics["train_loss"])), name
    class Duck:   # optax's two functions on an object of one's own (hashable, as a config's fields are)
        def init(self, params):
            return optax.sgd(0.05).init(params)

        def update(self, updates, state, params=None):
            return optax.sgd(0.05).update(updates, state, params)
    duck = Duck()
    plain = p.FedAvg(small_model(), p.FedAvgConfig(local_epochs=1, batch_size=32, lr=0.05))
    ducked = p.FedAvg(small_model(), p.FedAvgConfig(local_epochs=1, batch_size=32, optimizer=duck))
    state = plain.init(jax.random.key(0), digits)
    a = jax.jit(p.make_round(plain, p.Layout("vmap", "scan")))(state, digits, sel, key)[0]
    b = jax.jit(p.make_round(ducked, p.Layout("vmap", "scan")))(state, digits, sel, key)[0]
    np.testing.assert_allclose(a.head["kernel"], b.head["kernel"], rtol=1e-6, atol=1e-7)


def test_head_phases_and_fine_tuning_take_the_methods_optimizer(digits):
    """FedRep's head epochs and FedBABU's fine-tuning run the config's optimizer (they ran plain SGD
    whatever it was): with one that never moves, FedRep's heads stay where they started and FedBABU's
    fine-tuned scores are the global model's; a head trained on its own (FedRep's head epochs,
    pFedKDH's refit and EA) meets an optimizer that reads a model's structure as a model's head."""
    still = optax.set_to_zero()
    sel, key, layout = jnp.array([0, 2], jnp.int32), jax.random.key(1), p.Layout("vmap", "scan")
    rep = p.FedRep(small_model(), p.FedRepConfig(local_epochs=1, batch_size=32, head_epochs=1, optimizer=still))
    state = rep.init(jax.random.key(0), digits)
    new = jax.jit(p.make_round(rep, layout))(state, digits, sel, key)[0]
    np.testing.assert_array_equal(new.heads["kernel"], state.heads["kernel"])
    babu = p.FedBABU(small_model(), p.FedBABUConfig(local_epochs=1, batch_size=32, finetune_epochs=1, optimizer=still))
    scores = jax.jit(p.make_evaluate(babu, layout), static_argnames="personalize")(
        babu.init(jax.random.key(0), digits), digits, jax.random.key(2), personalize=True)
    assert float(scores["personalized_macro_accuracy"]) == float(scores["global_macro_accuracy"])
    masked = optax.adamw(1e-3, weight_decay=1e-2, mask={"backbone": True, "head": False})
    for algo in (p.FedRep(small_model(), p.FedRepConfig(local_epochs=1, batch_size=32, head_epochs=1, optimizer=masked)),
                 p.PFedKDH(small_model(), p.PFedKDHConfig(local_epochs=1, batch_size=32, lam=0.5, ea_steps=2,
                                                          teacher_epochs=1, teacher_optimizer=masked,
                                                          ea_optimizer=masked))):
        state = algo.init(jax.random.key(0), digits)
        new, metrics = jax.jit(p.make_round(algo, layout))(state, digits, sel, key)
        assert np.isfinite(float(metrics["train_loss"])), algo.name
        scores = jax.jit(p.make_evaluate(algo, layout), static_argnames="personalize")(
            new, digits, jax.random.key(2), personalize=algo.personalization is not None)
        assert np.isfinite(float(scores["personalized_macro_accuracy"])), algo.name


def test_a_config_of_another_method_is_refused():
    """FedAvg(model, FedProxConfig(mu=100)) trained as plain FedAvg before, its mu unread."""
    with pytest.raises(TypeError, match=r"FedAvg\(config=...\) must be a FedAvgConfig; got a FedProxConfig"):
        p.FedAvg(small_model(), p.FedProxConfig(mu=100.0))
    with pytest.raises(TypeError, match=r"Ditto\(config=...\) must be a DittoConfig; got a dict \(e.g. DittoConfig"):
        p.Ditto(small_model(), {"lr": 0.1})
    assert type(p.FedProx(small_model(), p.FedProxConfig(mu=0.1)).config) is p.FedProxConfig

    @dataclasses.dataclass(frozen=True)
    class Mine(p.FedPer):   # inherits FedPer's config field: a config of its own is its business
        pass

    @dataclasses.dataclass(frozen=True)
    class MineConfig(p.LocalConfig):
        extra: int = 1
    assert Mine(small_model(), MineConfig()).config.extra == 1


def test_configs_check_their_fields_in_python_terms():
    with pytest.raises(p.OptionError, match=r"FedProxConfig.mu must be >= 0; got -1"):
        p.FedProxConfig(mu=-1)
    with pytest.raises(ValueError, match=r"PFedKDHConfig.kd_gate must be one of"):
        p.PFedKDHConfig(kd_gate="sometimes")
    assert p.FedProxConfig(mu=0.1).mu == 0.1 and p.FedBABUConfig().finetune_epochs == 5
    # the kind of each field too (a float where an int sets shapes would fail deep inside a trace)
    with pytest.raises(p.OptionError, match=r"FedAvgConfig.local_epochs must be an int; got 1.5"):
        p.FedAvgConfig(local_epochs=1.5)
    with pytest.raises(p.OptionError, match=r"FedAvgConfig.lr must be a number; got '0.1'"):
        p.FedAvgConfig(lr="0.1")
    with pytest.raises(p.OptionError, match=r"PFedKDHConfig.persistent_heads must be True or False; got 1"):
        p.PFedKDHConfig(persistent_heads=1)
    assert p.FedAvgConfig(lr=1, batch_size=np.int64(8)).batch_size == 8 and p.PFedSimConfig(warmup=3).warmup == 3
    with pytest.raises(p.OptionError, match=r"PFedKDHConfig.lam must be in \[0, 1\]; got 5.0"):   # a concrete JAX value
        p.PFedKDHConfig(lam=jnp.array(5.0))
    # an optax update function is callable but no function of the learning rate alone (before: accepted,
    # and a TypeError about chain's update_fn deep in the first round)
    with pytest.raises(p.OptionError, match=r"FedAvgConfig.optimizer must be an optax GradientTransformation, a "
                                            r"function lr -> GradientTransformation, or None; got <function"):
        p.FedAvgConfig(optimizer=optax.adam(1e-3).update)
    assert p.FedAvgConfig(optimizer=optax.adam).optimizer is optax.adam
    with pytest.raises(ValueError, match=r"PFedKDHConfig has no field 'learning_rate'; traceable fields: lr"):
        p.PFedKDH(small_model()).with_hparams({"learning_rate": 0.1})
    # every method by its registered name, over a model of one's own
    prox = p.make_method("fedprox", small_model(), mu=0.1)
    assert type(prox) is p.FedProx and prox.config == p.FedProxConfig(mu=0.1)
    assert type(p.make_method("Fed-Prox", small_model())) is p.FedProx   # as --method reads it
    with pytest.raises(ValueError, match=r"FedProxConfig has no field 'lam'"):
        p.make_method("fedprox", small_model(), lam=0.5)
    with pytest.raises(ValueError, match=r"no method 'fedsgd'; registered: pfedkdh, fedavg"):
        p.make_method("fedsgd", small_model())
    with pytest.raises(ValueError, match=r"at least 16×16.*\(8, 8, 1\)"):
        p.CNN(10).init(jax.random.key(0), (8, 8, 1))


def test_a_rounds_clients_are_checked_and_a_failed_round_leaves_the_runner_usable(digits, monkeypatch):
    algo = p.FedPer(small_model(), p.FedPerConfig(local_epochs=1, batch_size=32))
    state = algo.init(jax.random.key(0), digits)
    key = jax.random.key(1)
    pure = p.make_round(algo, p.Layout("vmap", "scan"))
    with pytest.raises(ValueError, match=r"selected: client 9 is out of range for 4 clients \(0 to 3\)"):
        pure(state, digits, [0, 9], key)
    with pytest.raises(ValueError, match=r"selected is empty"):
        pure(state, digits, [], key)
    with pytest.raises(ValueError, match=r"selected must be integer client indices \[C\]; got float32"):
        jax.jit(pure)(state, digits, jnp.array([0.0, 1.0]), key)
    with pytest.raises(ValueError, match=r"select_clients: num_clients and per_round set the selection's shape"):
        jax.jit(lambda n: p.select_clients(key, 4, n))(2)
    runner = p.RoundRunner(algo, digits, p.Layout("sequential", "unrolled", chunk_steps=2))
    with pytest.raises(ValueError, match=r"selected holds client 2 twice"):
        runner.round(state, digits, [2, 2], key)
    want, _ = runner.round(state, digits, [0, 1], key)
    # a round that stops after its first client (an interrupt, say) leaves nothing stale behind
    put, calls = runner._rows._put, []

    def failing(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return put(*args)
    monkeypatch.setattr(runner._rows, "_put", failing)
    with pytest.raises(KeyboardInterrupt):
        runner.round(state, digits, [0, 1], key)
    monkeypatch.setattr(runner._rows, "_put", put)
    got, _ = runner.round(state, digits, [0, 1], key)
    np.testing.assert_array_equal(got.heads["kernel"], want.heads["kernel"])


def test_a_fresh_state_may_be_donated_and_phases_are_named(digits):
    algo = p.PFedKDH(small_model(), p.PFedKDHConfig(local_epochs=1, batch_size=32, teacher_epochs=1))
    donating = jax.jit(p.make_round(algo, p.Layout("vmap", "scan")), donate_argnums=0)
    new, _ = donating(algo.init(jax.random.key(0), digits), digits, jnp.array([0, 1]), jax.random.key(1))
    assert new.round == 1
    fedfed = p.FedFed(small_model(), p.FedFedConfig(feature_rounds=1, vae_width=8))
    with pytest.raises(ValueError, match=r"FedFed runs in 2 phases \(FedFedFeatures for 1 round, then FedFedAvg "
                                         r"for the remaining rounds\).*pfedkdh_jax.PhasedRunner"):
        p.make_round(fedfed)
    with pytest.raises(ValueError, match=r"RoundRunner\(algo, ...\): FedFed runs in 2 phases"):
        p.RoundRunner(fedfed, digits)
    assert p.PhasedRunner(fedfed, digits).starts == [0, 1]
    flat = p.from_arrays(np.zeros((200, 20), np.float32), np.arange(200) % 4, num_clients=2, alpha=1.0,
                         aux_size=20, seed=0)
    with pytest.raises(ValueError, match=r"FedFed: its VAE takes images \(H, W, C\).*shape \(20,\)"):
        fedfed.init(jax.random.key(0), flat)


def test_a_state_built_on_other_data_is_named(digits):
    algo = p.PFedKDH(small_model(), p.PFedKDHConfig(local_epochs=1, batch_size=32, teacher_epochs=1))
    pool = load_pool("digits")
    six = p.from_arrays(pool.images[:600], pool.labels[:600], num_clients=6, alpha=1.0, aux_size=60, seed=0)
    state, key = algo.init(jax.random.key(0), digits), jax.random.key(1)   # 4 clients' heads
    message = r"the state holds 4 clients \(its evaluation heads are \[4, ...\]\) but the data has 6"
    with pytest.raises(ValueError, match="round: " + message):
        jax.jit(p.make_round(algo, p.Layout("vmap", "scan")))(state, six, jnp.array([4, 5]), key)
    with pytest.raises(ValueError, match="evaluate: " + message):
        p.make_evaluate(algo)(state, six, key)
    runner = p.RoundRunner(algo, six, p.Layout("sequential", "unrolled", chunk_steps=2))
    with pytest.raises(ValueError, match="RoundRunner.round: " + message):
        runner.round(state, six, [4, 5], key)
    with pytest.raises(ValueError, match="RoundRunner.evaluate: " + message):
        runner.evaluate(state, six, key)
    fedavg = p.FedAvg(small_model(), p.FedAvgConfig(local_epochs=1))   # its heads: the global one, broadcast
    with pytest.raises(ValueError, match="round: the state holds 4 clients"):
        p.make_round(fedavg)(fedavg.init(key, digits), six, [0, 5], key)
    stacked = p.RoundRunner(algo, six, p.Layout("vmap", "scan"), reps=2)   # [R, K, ...]: K read after R
    states = jax.vmap(lambda k: algo.init(k, digits))(jax.random.split(key, 2))
    with pytest.raises(ValueError, match="RoundRunner.round: " + message):
        stacked.round(states, six, np.array([[0, 1], [2, 3]]), jax.random.split(key, 2))
    # the same clients, other inputs (12×12 images): the backbone's shapes are named, not flax's scope error
    small = p.from_arrays(pool.images[:600, 2:14, 2:14], pool.labels[:600], num_clients=4, alpha=1.0, aux_size=60,
                          seed=0)
    with pytest.raises(ValueError, match=r"round: the state's backbone\['Dense_0'\]\['kernel'\] is \(1568, 128\) but "
                                         r"the model on the data's inputs \(12, 12, 1\) makes it \(288, 128\)"):
        p.make_round(fedavg)(fedavg.init(key, digits), small, [0, 1], key)


def test_an_evaluation_backbone_per_client_must_say_so(digits):
    """EvalModels' per_client flag is checked against the backbone's shapes (the model's own, with or
    without a client axis) before anything is traced: a missing flag is named, not a flax shape error."""
    class Unflagged(p.Ditto):
        def eval_models(self, state):
            return super().eval_models(state).replace(per_client=False)

    class Flagged(p.FedPer):
        def eval_models(self, state):
            return super().eval_models(state).replace(per_client=True)

    key = jax.random.key(0)
    for cls, config, message in [(Unflagged, p.DittoConfig(local_epochs=1), r"Unflagged.eval_models gives a "
                                  r"backbone per client \(\[4, ...\]\) without per_client=True"),
                                 (Flagged, p.FedPerConfig(local_epochs=1), "Flagged.eval_models says "
                                  "per_client=True but gives one shared backbone")]:
        algo = cls(small_model(), config)
        state = algo.init(key, digits)
        with pytest.raises(ValueError, match="evaluate: " + message):
            p.make_evaluate(algo)(state, digits, key)
        stacked = p.RoundRunner(algo, digits, p.Layout("vmap", "scan"), reps=2)   # [R, K, ...]: K after R
        with pytest.raises(ValueError, match="RoundRunner.evaluate: " + message):
            stacked.evaluate(jax.vmap(lambda k: algo.init(k, digits))(jax.random.split(key, 2)), digits,
                             jax.random.split(key, 2))
    for algo in (p.Ditto(small_model(), p.DittoConfig(local_epochs=1)),   # the built-in ones evaluate
                 p.FedPer(small_model(), p.FedPerConfig(local_epochs=1))):
        assert 0.0 <= float(p.make_evaluate(algo)(algo.init(key, digits), digits, key)
                            ["personalized_macro_accuracy"]) <= 1.0


def test_before_training_runs_pure_inside_a_users_jit(digits):
    # pFedKDH's warm-up on D_s and its teacher refit, before round 0: the runner's host loop and the
    # pure form inside a jit (a lax.scan of steps) compute the same state
    algo = p.PFedKDH(small_model(), p.PFedKDHConfig(local_epochs=1, batch_size=32, teacher_epochs=1,
                                                    warmup_epochs=1, teacher_refit_at_start=True))
    state, key = algo.init(jax.random.key(0), digits), jax.random.key(4)
    host = p.RoundRunner(algo, digits, p.Layout("sequential", "unrolled", chunk_steps=2)).prepare(state, digits, key)
    pure = jax.jit(p.make_round(algo).prepare)(state, digits, key)
    assert all(not np.allclose(a, b) for a, b in zip(jax.tree_util.tree_leaves(host.backbone),
                                                      jax.tree_util.tree_leaves(state.backbone)))   # warmed up
    for a, b in zip(jax.tree_util.tree_leaves(host), jax.tree_util.tree_leaves(pure)):
        np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    eager = p.make_round(algo, p.Layout("vmap", "scan")).prepare(state, digits, key)
    np.testing.assert_allclose(eager.teacher_head["kernel"], host.teacher_head["kernel"], rtol=2e-4, atol=2e-5)


def test_a_method_of_ones_own_runs_from_the_command_line_and_resumes(registry, tmp_path, capsys):
    import sys

    from pfedkdh_jax.run import cli
    from pfedkdh_jax.run.config import ConfigError, validate
    from pfedkdh_jax.run.experiment import load_run_config
    plugin = str(pathlib.Path(__file__).resolve().parents[1] / "experiments" / "examples" / "own_method.py")

    def forget():   # as a new process would: fedperm unregistered, its plugin not imported
        del registry["fedperm"]
        for name in [k for k in sys.modules if k.startswith("pfedkdh_plugin_own_method")]:
            del sys.modules[name]
    out = tmp_path / "run"
    assert cli.main(["run", "--plugin", plugin, "--method", "fedperm", "--dataset", "digits", "--preset", "smoke",
                     "--rounds", "1", "--clients", "4", "--method-arg", "momentum=0.5", "--out", str(out),
                     "--no-progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["method"] == "fedperm" and 0 <= summary["personalized_macro_accuracy"] <= 1
    # a new process knows nothing of fedperm: the run's config.json names its plugin, which resume imports
    forget()
    cfg = validate(load_run_config(str(out)))
    assert cfg.method_args == (("momentum", "0.5"),) and "fedperm" in registry
    forget()
    with pytest.raises(ConfigError, match=r"got 'fedperm'; did you mean 'fedper'\? \(a method of one's own: "
                                          r"register_method in a module given by --plugin\)"):
        p.make_config(method="fedperm")
    # a run whose config.json names no plugin (started from Python) resumes with --plugin
    stored = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**stored, "plugins": []}))
    (out / "summary.json").unlink()   # killed after its checkpoint: resuming has a round to finish
    assert cli.main(["resume", str(out), "--no-progress"]) == 2
    assert "got 'fedperm'" in capsys.readouterr().err
    assert cli.main(["resume", str(out), "--plugin", plugin, "--no-progress"]) == 0
    # the plugins are not part of a checkpoint's fingerprint: checkpoints written before they existed resume
    from pfedkdh_jax.run.checkpoint import fingerprint
    part = type("P", (), {"aux_idx": [0], "train_idx": [[1]], "test_idx": [[2]]})
    fresh = p.RunConfig().to_dict()
    assert fingerprint(fresh, part) == fingerprint({k: v for k, v in fresh.items() if k != "plugins"}, part)
    forget()
    assert cli.main(["run", "--plugin", plugin, "--method", "fedperm", "--method-arg", "momentum=1.5"]) == 2
    assert "--method-arg momentum must be in [0, 1) for fedperm; got 1.5" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--plugin no_such_module: cannot import it"):
        p.make_config(method="fedperm", plugins=("no_such_module",))


def test_a_dataset_of_ones_own_is_a_run_option(registry, tmp_path):
    from pfedkdh_jax.data import DataError
    from pfedkdh_jax.run.config import ConfigError
    with pytest.raises(ConfigError, match=r"--dataset must be one of .*; got 'blobs' \(a dataset of one's own: "
                                          r"register_dataset in a module given by --plugin\)"):
        p.make_config(dataset="blobs")
    pool = load_pool("digits")
    p.register_dataset("blobs", lambda: p.pool_from_arrays(pool.images[:500], pool.labels[:500]))
    cfg = p.make_config(dataset="blobs", method="fedper", num_clients=4, aux_size=50)
    got = load_pool(cfg.dataset)
    assert got.name == "blobs" and got.images.shape == (500, 28, 28, 1) and got.normalize
    with pytest.raises(DataError, match="'mnist' is one of the package's datasets"):
        p.register_dataset("mnist", lambda: pool)
    # float features the paper's CNN does not take: the dataset names its model
    feats = pool.images[:400].reshape(400, -1).astype(np.float32) / 255.0
    p.register_dataset("feats", lambda: p.pool_from_arrays(feats, pool.labels[:400]),
                       model=lambda classes: p.LinenModel(nn.Dense(32), nn.Dense(classes)))
    summary = p.run(p.make_config("smoke", dataset="feats", method="fedper", rounds=1, num_clients=4,
                                  aux_size=40, out=str(tmp_path / "feats")), progress=False, log=lambda *_: None)
    assert 0 <= summary["personalized_macro_accuracy"] <= 1
    # a pool too small for the presets' |D_s| of 5000 says what its runs take instead; options still win
    p.register_dataset("small", lambda: p.pool_from_arrays(pool.images[:500], pool.labels[:500]),
                       preset=dict(aux_size=50, num_clients=4))
    for name in ("smoke", "default", "paper"):
        cfg = p.make_config(name, dataset="small")
        assert (cfg.aux_size, cfg.num_clients) == (50, 4) and (cfg.rounds == 2) == (name == "smoke")
    assert p.make_config("smoke", dataset="small", aux_size=60).aux_size == 60
    assert p.make_config("smoke", dataset="blobs").aux_size == 5000   # none registered: the presets' own
    p.register_dataset("typo", lambda: pool, preset=dict(aux=50))
    with pytest.raises(ConfigError, match=r"dataset 'typo': its preset \(register_dataset\(preset=\)\) has no run "
                                          r"option 'aux'"):
        p.make_config(dataset="typo")
    with pytest.raises(DataError, match=r"register_dataset\('typo'\): preset must be a dict of run options"):
        p.register_dataset("typo", lambda: pool, preset=[("aux_size", 50)])
    p.register_dataset("broken", lambda: (pool.images, pool.labels))
    with pytest.raises(DataError, match=r"dataset 'broken': its load\(\) must return a pfedkdh_jax Pool"):
        load_pool("broken")


def test_register_method_names_what_it_cannot_take(registry):
    @dataclasses.dataclass(frozen=True)   # (this module's annotations are types, not text)
    class MineConfig(p.LocalConfig):
        width: int = p.option(4, "a width", lambda v: v >= 1, ">= 1")
        clip: typing.Optional[float] = p.option(None, "a clip, or none")
        scale: float = p.option(1, "a scale (an int default)")

    @dataclasses.dataclass(frozen=True)
    class Mine(p.FedPer):   # FedPer's pieces, a config of its own
        model: object
        config: MineConfig = MineConfig()

    with pytest.raises(ValueError, match="'fedper' is one of the package's methods"):
        p.register_method("fedper", Mine, MineConfig)
    with pytest.raises(ValueError, match="a lower-case identifier"):
        p.register_method("My-Method", Mine, MineConfig)
    with pytest.raises(TypeError, match="config must be a dataclass deriving from pfedkdh_jax.LocalConfig"):
        p.register_method("mine", Mine, dict)
    with pytest.raises(ValueError, match="table_metric must be one of"):
        p.register_method("mine", Mine, MineConfig, table_metric="accuracy")
    with pytest.raises(TypeError, match="algorithm must be a class deriving from pfedkdh_jax.Algorithm"):
        p.register_method("mine", int, MineConfig)

    class Bare(p.Algorithm):
        pass
    with pytest.raises(TypeError, match=r"a run builds Bare\(model, config\), which its signature \(\) does not "
                                        r"take: .* or pass factory="):
        p.register_method("bare", Bare, MineConfig)
    spec = p.register_method("mine", Mine, MineConfig)
    assert spec.args == {"width": 4, "clip": None, "scale": 1} and spec.class_name == "Mine"
    with pytest.raises(p.OptionError, match="MineConfig.width must be an int; got '3'"):
        MineConfig(width="3")
    from pfedkdh_jax.algorithms import parse_method_args
    assert parse_method_args("mine", [("clip", "1.5"), ("scale", "0.5")]) == {"width": 4, "clip": 1.5, "scale": 0.5}
    assert parse_method_args("mine", [("clip", "none")])["clip"] is None
    with pytest.raises(ValueError, match=r"--method-arg width='2.5': expected int"):
        parse_method_args("mine", [("width", "2.5")])
    cfg = p.make_config(preset="smoke", method="mine", method_args={"width": 2})
    assert cfg.rounds == 2 and cfg.method_args == (("width", "2"),)
    assert p.make_method("mine", small_model(), width=2).config.width == 2
    with pytest.raises(p.OptionError, match="MineConfig.width must be >= 1; got 0"):
        p.make_method("mine", small_model(), width=0)
    # a run builds it over the run's CNN and budget, or with a factory of one's own (another model)
    built = p.build_algorithm(p.make_config(method="mine", lr=0.05, method_args=(("width", "3"),)), 10)
    assert isinstance(built.model, p.CNN) and (built.config.lr, built.config.width) == (0.05, 3)
    p.register_method("mine_small", Mine, MineConfig,
                      factory=lambda cfg, classes, args: Mine(small_model(), MineConfig(lr=cfg.lr, **args)))
    assert isinstance(p.build_algorithm(p.make_config(method="mine_small"), 10).model, p.LinenModel)


def test_injected_optimizer_and_a_stackable_learning_rate(digits):
    model = small_model()
    adamw = p.FedAvg(model, p.FedAvgConfig(local_epochs=1, optimizer=lambda lr: optax.adamw(lr, weight_decay=1e-4)))
    sgd = p.FedAvg(model, p.FedAvgConfig(local_epochs=1))
    state = sgd.init(jax.random.key(0), digits)
    sel, key = jnp.array([1, 3], jnp.int32), jax.random.key(1)
    a = jax.jit(p.make_round(adamw, p.Layout("vmap", "scan")))(state, digits, sel, key)[0]
    b = jax.jit(p.make_round(sgd, p.Layout("vmap", "scan")))(state, digits, sel, key)[0]
    assert not np.allclose(a.head["kernel"], b.head["kernel"])
    # the learning rate of a factory stays traceable: two values vmapped as one program
    def round_at(lr):
        return p.make_round(adamw.with_hparams({"lr": lr}), p.Layout("vmap", "scan"))(state, digits, sel, key)[0]
    both = jax.jit(jax.vmap(round_at))(jnp.array([0.015, 0.0]))
    np.testing.assert_allclose(both.head["kernel"][0], a.head["kernel"], rtol=1e-5, atol=1e-6)
    # lr 0: unchanged (up to the rounding of the weighted average of identical heads)
    np.testing.assert_allclose(both.head["kernel"][1], state.head["kernel"], rtol=0, atol=1e-7)
    fixed = p.FedAvg(model, p.FedAvgConfig(optimizer=optax.adam(1e-3)))
    with pytest.raises(ValueError, match="FedAvgConfig.lr cannot take a traced value"):
        jax.jit(lambda lr: fixed.with_hparams({"lr": lr}).config.lr)(0.1)
    inner = p.PFedMe(model, p.PFedMeConfig(personal_optimizer=optax.adam(1e-3)))   # pFedMe's inner rate alike
    with pytest.raises(ValueError, match="PFedMeConfig.personal_lr cannot take a traced value: "
                                         "PFedMeConfig.personal_optimizer is a GradientTransformation"):
        jax.jit(lambda nu: inner.with_hparams({"personal_lr": nu}).config.lr)(0.1)
    with pytest.raises(ValueError, match=r"FedAvgConfig.lr takes one value per run .*; got a traced float32\[2\]"):
        jax.jit(lambda lr: adamw.with_hparams({"lr": lr}).config.lr)(jnp.array([0.1, 0.2]))
    with pytest.raises(ValueError, match="FedAvgConfig.local_epochs cannot take a traced value.*traceable fields: lr"):
        sgd.with_hparams({"local_epochs": 3})


def test_the_round_inside_a_users_jit_and_scan_uses_a_scan(digits):
    algo = p.FedPer(small_model(), p.FedPerConfig(local_epochs=1))
    state = algo.init(jax.random.key(0), digits)
    round_fn = p.make_round(algo)                      # the backend's layout (unrolled chunks on a CPU host loop)

    def train(state, key):
        def body(s, t):
            k = jax.random.fold_in(key, t)
            return round_fn(s, digits, p.select_clients(k, 4, 2), k)[0], None
        return jax.lax.scan(body, state, jnp.arange(2))[0]

    jaxpr = str(jax.make_jaxpr(train)(state, jax.random.key(3)))
    assert jaxpr.count("conv_general_dilated") < 12    # the local steps are not unrolled into the program
    out = jax.jit(train)(state, jax.random.key(3))
    # the same two rounds by the host runner, clients from the same selection
    runner, s = p.RoundRunner(algo, digits), state
    for t in range(2):
        k = jax.random.fold_in(jax.random.key(3), t)
        s = runner.round(s, digits, np.asarray(p.select_clients(k, 4, 2)), k)[0]
    np.testing.assert_allclose(out.heads["kernel"], s.heads["kernel"], rtol=2e-4, atol=2e-5)
    schedule = p.sample_schedule(jax.random.key(5), 3, 20, 10)
    assert np.array_equal(schedule[2], np.asarray(p.select_clients(jax.random.fold_in(jax.random.key(5), 2), 20, 10)))


def test_float_features_and_a_natural_partition():
    rng = np.random.default_rng(0)
    y = rng.integers(0, 3, 300)
    x = (rng.random((300, 6)) * 0.5 + y[:, None] * 0.25).astype(np.float32)   # values in [0, 1): kept
    clients = np.repeat(np.arange(5), 60)
    data = p.from_arrays(x, y, client_ids=clients, aux_size=30, seed=1)
    assert data.images.dtype == jnp.float32 and not data.normalize
    np.testing.assert_array_equal(np.asarray(data.images), x)
    assert data.num_clients == 5 and data.num_classes == 3
    total = int(data.train_n.sum() + data.test_n.sum()) + 30
    assert total == 300
    owners = [set(clients[np.asarray(data.train_idx[k, :int(data.train_n[k])])]) for k in range(5)]
    assert owners == [{k} for k in range(5)]


@pytest.mark.parametrize("args, message", [
    (dict(x=np.zeros(10), y=np.zeros(10, int), client_ids=np.arange(10) % 2), "inputs must be"),
    (dict(x=np.zeros((10, 3)), y=np.arange(10) - 1, client_ids=np.arange(10) % 2), "labels must be in"),
    (dict(x=np.zeros((10, 3)), y=np.zeros(9, int), client_ids=np.arange(10) % 2), "one row per sample"),
    (dict(x=np.zeros((10, 3)), y=np.arange(10) % 2, client_ids=np.array([0] * 5 + [2] * 5)), r"client_ids skip id 1.*np.unique"),
    (dict(x=np.zeros((10, 3)), y=np.arange(10) % 2, client_ids=np.array([0] * 9 + [1])), "client 1 holds 1 sample"),
    (dict(x=np.zeros((12, 3)), y=np.arange(12) % 2, client_ids=np.array([0] * 9 + [1, 2, 3])),
     r"client 1 holds 1 sample\(s\) \(so do 2 more: 2, 3\)"),
    (dict(x=np.zeros((10, 3)), y=np.arange(10) % 2), "give the clients one way"),
    (dict(x=np.full((10, 3), np.nan), y=np.zeros(10, int), client_ids=np.arange(10) % 2), "non-finite"),
])
def test_bad_arrays_stop_with_one_line(args, message):
    with pytest.raises(DataError, match=message) as err:
        p.from_arrays(args.pop("x"), args.pop("y"), **args)
    assert "\n" not in str(err.value)


def test_nnx_modules_as_a_model(digits):
    from flax import nnx

    class Body(nnx.Module):
        def __init__(self, rngs):
            self.fc = nnx.Linear(28 * 28, 64, rngs=rngs)

        def __call__(self, x):
            return nnx.relu(self.fc(x.reshape(x.shape[0], -1)))

    model = p.NNXModel(lambda rngs: Body(rngs), lambda rngs: nnx.Linear(64, 10, rngs=rngs))
    algo = p.FedPer(model, p.FedPerConfig(local_epochs=1))
    state = algo.init(jax.random.key(0), digits)
    assert state.heads["kernel"].shape == (4, 64, 10)
    new, metrics = jax.jit(p.make_round(algo, p.Layout("vmap", "scan")))(state, digits, jnp.array([0, 1]),
                                                                          jax.random.key(1))
    assert np.isfinite(float(metrics["train_loss"])) and not np.allclose(new.backbone["fc"]["kernel"],
                                                                         state.backbone["fc"]["kernel"])


def test_the_engine_imports_no_method_and_one_version():
    engine = pathlib.Path(p.__file__).parent / "engine"
    assert not [f.name for f in engine.glob("*.py") if "algorithms" in f.read_text()]
    assert p.__version__ == importlib.metadata.version("pfedkdh_jax")
    root = pathlib.Path(p.__file__).parent.parent
    assert f"version: {p.__version__}\n" in (root / "CITATION.cff").read_text()
    assert "Apache License" in (root / "LICENSE").read_text()


def test_run_called_as_the_package_shows_the_functions_signature():
    """``p.run`` is the run package once one of its modules is imported: it takes and shows the
    function's arguments (``(cfg, **kwargs)`` before) and names the function in its help."""
    import inspect
    from pfedkdh_jax.run import experiment
    p.make_config
    shown, real = inspect.signature(p.run).parameters, inspect.signature(experiment.run).parameters
    assert [(n, x.kind, x.default) for n, x in shown.items()] == [(n, x.kind, x.default) for n, x in real.items()]
    assert "pfedkdh_jax.run.experiment.run" in p.run.__doc__


def test_the_run_config_takes_pfedkdh_options_and_defaults_from_its_config():
    """One source: every pFedKDH run option is a RunConfig field whose default is PFedKDHConfig's, and a
    RunConfig becomes the method's config field by field."""
    from pfedkdh_jax.algorithms import PFEDKDH_OPTIONS
    from pfedkdh_jax.run.config import RunConfig
    fields = {f.name: f for f in dataclasses.fields(RunConfig)}
    assert set(PFEDKDH_OPTIONS) <= set(fields)
    kdh = p.PFedKDHConfig()
    assert {n: fields[n].default for n in PFEDKDH_OPTIONS} == {n: getattr(kdh, n) for n in PFEDKDH_OPTIONS}
    cfg = p.make_config(lam=0.3, kd_gate="confidence")
    algo = p.build_algorithm(cfg, 10)
    assert (algo.config.lam, algo.config.kd_gate, algo.config.mu) == (0.3, "confidence", kdh.mu)


def test_check_method_passes_a_sound_method_and_names_what_a_broken_one_breaks(registry):
    import sys
    path = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "examples" / "own_method.py"
    spec = importlib.util.spec_from_file_location("own_method_checked", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["own_method_checked"] = mod
    spec.loader.exec_module(mod)
    pool = load_pool("digits")
    data = p.from_arrays(pool.images[:300], pool.labels[:300], num_clients=4, alpha=1.0, aux_size=30, seed=0)
    model = p.LinenModel(mod.MLP(), nn.Dense(10))
    config = mod.FedPerMConfig(local_epochs=1, batch_size=16)
    scores = p.check_method(mod.FedPerM(model, config), data)     # every check
    assert 0 <= float(scores["personalized_macro_accuracy"]) <= 1

    with pytest.raises(p.ProtocolError, match=r"check_method\(HostNoise\): Layout\('sequential', 'unrolled'\) "
                                              r"against Layout\('vmap', 'scan'\), the state: .* differs by"):
        p.check_method(with_host_noise(mod.FedPerM)(model, config), data, checks=("layouts",))

    @dataclasses.dataclass(frozen=True)
    class FloatRound(mod.FedPerM):  # the round count comes back a float: the second round compiles again
        def server_update_from_mean(self, *args):
            state, metrics = super().server_update_from_mean(*args)
            return state.replace(round=state.round.astype(jnp.float32)), metrics
    with pytest.raises(p.ProtocolError, match=r"check_method\(FloatRound\): a round compiled again .* "
                                              r"\(.round: int32\[\] → float32\[\]\)"):
        p.check_method(FloatRound(model, config), data, checks=("retrace",))

    @dataclasses.dataclass(frozen=True)
    class HostRead(mod.FedPerM):   # a value read on the host inside the round
        def server_update_from_mean(self, state, data, selected, mean, rest, key):
            if float(jnp.mean(rest.loss)) > 100:
                raise RuntimeError("diverged")
            return super().server_update_from_mean(state, data, selected, mean, rest, key)
    with pytest.raises(p.ProtocolError, match=r"check_method\(HostRead\): a piece of the round reads a traced value "
                                              r"on the host"):
        p.check_method(HostRead(model, config), data, checks=("retrace",))
    @dataclasses.dataclass(frozen=True)
    class OwnBackbones(mod.FedPerM):  # per-client backbones scored without per_client=True
        def eval_models(self, state):
            k = data.num_clients
            return p.EvalModels(backbone=jax.tree.map(lambda b: jnp.broadcast_to(b, (k,) + b.shape), state.backbone),
                                heads=state.heads)
    with pytest.raises(p.ProtocolError, match=r"check_method\(OwnBackbones\): OwnBackbones.eval_models gives a "
                                              r"backbone per client \(\[4, ...\]\) without per_client=True"):
        p.check_method(OwnBackbones(model, config), data, checks=("evaluation",))
    with pytest.raises(ValueError, match="check_method: no check 'speed'"):
        p.check_method(FloatRound(model, config), data, checks=("speed",))


def test_check_method_tells_round_off_from_repetitions_that_depend_on_each_other(digits, monkeypatch):
    """Where a repetition vmapped differs from its run alone, check_method runs the pair again with the
    other repetition's seed changed: unchanged, the repetitions are independent, and the gap is a
    RoundOffWarning saying so (FedFed's VAE amplifies round-off), not a failure pointing at a reduction over
    the leading axis. Here the lone run is shifted by hand, so that only the lone run differs; a repetition
    that reads the other's values still fails, and so does one whose lone run, traced again, computes other
    numbers (a value drawn when traced: no round-off)."""
    from pfedkdh_jax.engine import conformance
    real = conformance._pure_rounds

    def shifted(*args, **kw):
        run = real(*args, **kw)
        return dataclasses.replace(run, state=jax.tree_util.tree_map(lambda x: x + 1 if jnp.issubdtype(
            x.dtype, jnp.floating) else x, run.state))
    monkeypatch.setattr(conformance, "_pure_rounds", shifted)
    algo = p.FedPer(small_model(), p.FedPerConfig(local_epochs=1, batch_size=32))
    with pytest.warns(p.RoundOffWarning, match=r"check_method\(FedPer\): repetition \d of two vmapped against its "
                                               r"run alone, the state: .* differs by 1 .*; yet it is bitwise the same "
                                               r"whatever the other repetition holds: the repetitions are independent"):
        p.check_method(algo, digits, rounds=1, checks=("repetitions",))
    monkeypatch.setattr(conformance, "_pure_rounds", real)

    @dataclasses.dataclass(frozen=True)
    class Pooled(p.FedPer):   # a host callback handed the whole vmapped batch: repetitions read each other
        def server_update_from_mean(self, state, data, selected, mean, rest, key):
            state, metrics = super().server_update_from_mean(state, data, selected, mean, rest, key)
            def pool(x):   # numpy on the host: one repetition's bias alone, or both stacked
                return (x + x.mean(axis=0, keepdims=True) if x.ndim == 2 else 2 * x).astype(x.dtype)
            backbone = jax.tree_util.tree_map(lambda b: jax.pure_callback(
                pool, jax.ShapeDtypeStruct(b.shape, b.dtype), b, vmap_method="expand_dims") if b.ndim == 1 else b,
                state.backbone)
            return state.replace(backbone=backbone), metrics

    with pytest.raises(p.ProtocolError, match=r"check_method\(HostNoise\): repetition \d .* its run alone, traced "
                                              r"again, gives other numbers: a piece draws or reads a value when traced"):
        p.check_method(with_host_noise(p.FedPer)(small_model(), p.FedPerConfig(local_epochs=1, batch_size=32)),
                       digits, rounds=1, checks=("repetitions",))
    pooled = Pooled(small_model(), p.FedPerConfig(local_epochs=1, batch_size=32))
    with pytest.raises(p.ProtocolError, match=r"check_method\(Pooled\): repetition 0 of two vmapped against its run "
                                              r"alone, the state: .* differs by .*; a repetition's round depends on "
                                              r"the other's"):
        p.check_method(pooled, digits, rounds=1, checks=("repetitions",))


def test_check_method_runner_carries_each_clients_state_and_tells_round_off(digits, monkeypatch):
    """FedFed keeps each client's VAE optimizer state across rounds (never uploaded). With its weights
    frozen (lr 0: the states only add up gradients, and nothing grows round-off), two rounds of three of
    the four clients (two train twice, taking their state back) agree between the host runner and the
    pure round to 1e-6, the pure round compiled with the runner's local-training options (on README's
    setting the old comparison, with XLA's defaults, failed by 5.4e-5: experiments/fedfed_runner_check.py).
    A runner that hands the clients' results to the wrong clients fails. Where the pure round compiled
    otherwise moves beyond the tolerance, a runner's largest gap no larger than ten times the pure round's
    own is a RoundOffWarning; larger, or where the pure round does not move, or where the options are XLA's
    defaults (nothing to measure), a ProtocolError."""
    import optax
    from pfedkdh_jax.engine import conformance, runner
    pool = load_pool("digits")
    small = p.from_arrays(pool.images[:240], pool.labels[:240], num_clients=4, alpha=1.0, aux_size=40, seed=0)
    frozen = p.FedFed(small_model(), p.FedFedConfig(
        local_epochs=1, batch_size=32, feature_rounds=5, vae_width=4, optimizer=optax.sgd(0.0),
        vae_optimizer=optax.sgd(0.0, momentum=0.9)))
    with warnings.catch_warnings():
        warnings.simplefilter("error", p.RoundOffWarning)
        p.check_method(frozen, small, rounds=2, clients_per_round=3, checks="runner", tol=1e-6)

    algo = p.FedPer(small_model(), p.FedPerConfig(local_epochs=1, batch_size=32))
    stack = runner._Rows.stack
    monkeypatch.setattr(runner._Rows, "stack", lambda self, rows, n: stack(self, list(rows)[::-1], n))
    with pytest.raises(p.ProtocolError, match=r"check_method\(FedPer\): the host runner \(PhasedRunner\) against "
                                              r"the pure round, the state: .* differs by"):
        p.check_method(algo, digits, rounds=1, checks="runner")
    monkeypatch.setattr(runner._Rows, "stack", stack)

    real = conformance._pure_rounds
    probe = {"shift": 1.0, "skip": "nothing", "integer": 0}   # the pure round compiled otherwise: its shift

    def shifted(*args, options=None):   # the round compiled with the runner's options (+0.5), and otherwise
        run = real(*args, options=options)
        def move(path, x):
            if jnp.issubdtype(x.dtype, jnp.integer) and options is not None:
                return x + probe["integer"]
            if not jnp.issubdtype(x.dtype, jnp.floating):
                return x
            if options is not None:
                return x + 0.5
            return x + (0.5 if probe["skip"] in jax.tree_util.keystr(path) else probe["shift"])
        return dataclasses.replace(run, state=jax.tree_util.tree_map_with_path(move, run.state))
    monkeypatch.setattr(conformance, "_pure_rounds", shifted)
    monkeypatch.setattr(conformance, "local_training_compiler_options", lambda: {})
    with pytest.warns(p.RoundOffWarning, match=r"check_method\(FedPer\): the host runner .* differs by 0.5 .*; yet "
                                               r"the pure round compiled otherwise differs from itself by 0.5 \(in "):
        p.check_method(algo, digits, rounds=1, checks="runner")
    probe["shift"] = 0.5   # compiled otherwise, the pure round is the same: the gap is the runner's
    with pytest.raises(p.ProtocolError, match=r"the host runner .* differs by 0.5 .* \(the pure round compiled "
                                              r"otherwise differs from itself by 0\)"):
        p.check_method(algo, digits, rounds=1, checks="runner")
    # larger than ten times the pure round's own gap: the runner's
    probe.update(shift=0.54)   # the probe 0.04 from the pure round, the runner 0.5
    with pytest.raises(p.ProtocolError, match=r"the host runner .* differs by 0.5 .* differs from itself by 0.04\)"):
        p.check_method(algo, digits, rounds=1, checks="runner")
    # an integer that differs is the runner's whatever the floats do
    probe.update(shift=1.0, integer=1)
    with pytest.raises(p.ProtocolError, match=r"the host runner .* differs by 0.5 .*server_update needs\?$"):
        p.check_method(algo, digits, rounds=1, checks="runner")
    probe.update(integer=0)
    # where the options are XLA's defaults nothing measures another compilation: a gap is an error
    probe.update(skip="nothing")
    monkeypatch.setattr(conformance, "local_training_compiler_options", lambda: None)
    with pytest.raises(p.ProtocolError, match=r"the host runner .* differs by 1 .*server_update needs\?$"):
        p.check_method(algo, digits, rounds=1, checks="runner")


def test_a_traced_personalize_flag_is_named(digits):
    """``personalize`` is static: traced (jit without static_argnames) or an array, it is one TypeError
    saying so, before anything is traced (before: flax or JAX failed deep in the trace, or not at all);
    asked of a method without a personalization, it is a ValueError."""
    algo = p.FedPer(small_model(), p.FedPerConfig(local_epochs=1))
    key = jax.random.key(0)
    state = algo.init(key, digits)
    evaluate = p.make_evaluate(algo)
    with pytest.raises(TypeError, match="personalize must be a Python bool \\(under jax.jit: "
                                        "static_argnames='personalize'\\); got"):
        jax.jit(evaluate)(state, digits, key, personalize=True)
    with pytest.raises(TypeError, match="personalize must be a Python bool"):
        evaluate(state, digits, key, personalize=jnp.array(True))
    # FedPer has no personalization: asked for, it is named (before: no *_ea metric, without a word)
    with pytest.raises(ValueError, match=r"personalize=True: FedPer has no personalization step, so there "
                                         r"are no \*_ea metrics to add"):
        evaluate(state, digits, key, personalize=True)


def test_plugins_of_one_file_name_in_two_folders_are_two_modules(registry, tmp_path):
    """Each file is its own module, imported once however often it is named (before, the second
    replaced the first under one module name and every later load imported them again)."""
    import sys

    from pfedkdh_jax.algorithms import load_plugins
    files = []
    for folder, value in (("a", 1), ("b", 2)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "method.py").write_text(f"VALUE = {value}\n")
        files.append(str(tmp_path / folder / "method.py"))
    load_plugins(files)
    loaded = {m.__file__: m for m in list(sys.modules.values()) if getattr(m, "__file__", None) in files}
    assert sorted(m.VALUE for m in loaded.values()) == [1, 2]
    load_plugins(files + files[:1])
    assert all(sys.modules[m.__name__] is m for m in loaded.values())


def test_what_a_methods_round_changes_or_leaves_out_is_named(digits, registry, capsys):
    """A server step that changes the state's dtype (every round would compile again) or returns no
    train_loss stops the host runner after its first round, naming the leaf; heads without a client
    axis, and pieces without a default left out, are named before anything runs; the command line
    prints each as one line."""
    import flax.struct as struct

    from pfedkdh_jax.engine.protocol import state_change
    from pfedkdh_jax.run import cli

    class FloatRound(p.FedPer):
        def server_update_from_mean(self, state, data, selected, mean, rest, key):
            new, metrics = super().server_update_from_mean(state, data, selected, mean, rest, key)
            return new.replace(round=new.round.astype(jnp.float32)), metrics

    class NoLoss(p.FedPer):
        def server_update_from_mean(self, state, data, selected, mean, rest, key):
            new, metrics = super().server_update_from_mean(state, data, selected, mean, rest, key)
            return new, {"clients": selected}

    class StateOnly(p.FedPer):   # the metrics left out
        def server_update_from_mean(self, state, data, selected, mean, rest, key):
            return super().server_update_from_mean(state, data, selected, mean, rest, key)[0]

    class SharedHead(p.FedPer):
        def eval_models(self, state):
            return super().eval_models(state).replace(heads=p.take(state.heads, 0))

    config, key = p.FedPerConfig(local_epochs=1, batch_size=32), jax.random.key(0)
    layout = p.Layout("sequential", "unrolled", chunk_steps=2)
    for cls, message in [(FloatRound, r"RoundRunner.round: FloatRound's round returns a state unlike the one it was "
                                      r"given \(.round: int32\[\] → float32\[\]\); every round would compile again"),
                         (NoLoss, "RoundRunner.round: NoLoss's server step returns metrics without train_loss"),
                         (StateOnly, r"StateOnly.server_update_from_mean must return \(state, metrics\), the metrics "
                                     r"a dict with train_loss; got a PersonalHeadsState")]:
        algo = cls(small_model(), config)
        with pytest.raises(p.ProtocolError, match=message):
            p.RoundRunner(algo, digits, layout).round(algo.init(key, digits), digits, [0, 1], key)
    # another method's state: named (before: "'PersonalHeadsState' object has no attribute 'head'")
    with pytest.raises(ValueError, match=r"round: FedAvg cannot read a PersonalHeadsState \(.*\): a state of "
                                           r"another method\? Build it with algo.init\(key, data\)"):
        p.make_round(p.FedAvg(small_model(), config))(p.FedPer(small_model(), config).init(key, digits), digits,
                                                     jnp.array([0, 1]), key)
    algo = StateOnly(small_model(), config)   # the pure round too (before: "cannot unpack" in the runner)
    with pytest.raises(p.ProtocolError, match=r"StateOnly.server_update_from_mean must return \(state, metrics\)"):
        jax.jit(p.make_round(algo))(algo.init(key, digits), digits, jnp.array([0, 1]), key)
    shared = SharedHead(small_model(), config)
    with pytest.raises(ValueError, match=r"evaluate: SharedHead.eval_models gives heads without a client axis \(the "
                                         r"model's own head shapes\): .*pfedkdh_jax.broadcast\(head, K\)"):
        p.make_evaluate(shared)(shared.init(key, digits), digits, key)

    class Bare(p.Algorithm):
        def init(self, key, data):
            return {}
    for call, where in [(lambda: p.register_method("bare", Bare, p.LocalConfig, factory=lambda *_: Bare()), "register_method\\('bare'\\)"),
                        (lambda: p.make_round(Bare()), "make_round\\(algo\\)")]:
        with pytest.raises(p.ProtocolError, match=where + r": Bare must define trainer \(a LocalTrainer property\); "
                                                          r"client_start\(state, data, k, key\) -> LocalState; "):
            call()
    assert "bare" not in registry

    @struct.dataclass
    class S:
        table: jax.Array
        seen: int = struct.field(pytree_node=False)
    s = S(jnp.zeros((4, 3)), 0)
    assert state_change(s, S(jnp.ones((4, 3)), 0)) is None                        # values may change
    assert state_change(s, S(jnp.zeros((2, 3)), 0)) == ".table: float32[4, 3] → float32[2, 3]"
    assert state_change(s, S(jnp.zeros((4, 3)), 1)) == ".seen (a static field): 0 → 1"
    assert state_change({"a": s}, {"b": s}) == "leaves differ: ['a'].table is gone; ['b'].table is new"

    def broken():
        raise p.ProtocolError("RoundRunner.round: X's server step returns metrics without train_loss")
    assert cli._guarded(broken) == 2
    err = capsys.readouterr().err.strip()
    assert err == "pfedkdh: error: RoundRunner.round: X's server step returns metrics without train_loss"


def test_a_runner_warns_when_a_configured_warm_up_did_not_run(digits):
    """pFedKDH's warm-up is configured (``prepares``) but the first round comes before ``prepare``: one
    warning naming the call; after ``prepare``, or with nothing to prepare, none."""
    import warnings
    layout, key = p.Layout("sequential", "unrolled", chunk_steps=2), jax.random.key(0)
    for warmup, prepare, warned in [(1, False, True), (1, True, False), (0, False, False)]:
        algo = p.PFedKDH(small_model(), p.PFedKDHConfig(local_epochs=1, batch_size=32, teacher_epochs=1,
                                                        warmup_epochs=warmup))
        assert algo.prepares == bool(warmup)
        runner = p.RoundRunner(algo, digits, layout)
        state = algo.init(key, digits)
        if prepare:
            state = runner.prepare(state, digits, key)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            runner.round(state, digits, [0, 1], key)
        assert [str(w.message) for w in caught if "before_training" in str(w.message)] == (
            ["RoundRunner.round: PFedKDH's before_training is configured but did not run: call "
             "runner.prepare(state, data, key) once before the first round"] if warned else []), (warmup, prepare)


def test_a_key_data_or_count_of_another_kind_is_named(digits):
    with pytest.raises(TypeError, match=r"init\(key, data\): key must be a JAX random key .*; got int 0"):
        p.FedAvg(small_model()).init(0, digits)
    for method in ("FedPer", "PFedKDH", "FedFed"):
        with pytest.raises(TypeError, match=r"data must be a FederatedData: build it with from_arrays.*; got a Pool"):
            getattr(p, method)(small_model()).init(jax.random.key(0), load_pool("digits"))
    with pytest.raises(TypeError, match=r"init\(key, data\): key must be a JAX random key"):
        p.FedAvg(small_model()).init(np.uint32(3), digits)
    algo = p.FedAvg(small_model(), p.FedAvgConfig(local_epochs=1, batch_size=32))
    state = algo.init(jax.random.PRNGKey(0), digits)   # a legacy key is a key
    with pytest.raises(TypeError, match=r"round: data must be a FederatedData .*; got a tuple"):
        p.make_round(algo)(state, (1, 2), [0, 1], jax.random.key(1))
    with pytest.raises(TypeError, match=r"RoundRunner.round: data must be a FederatedData; got a dict"):
        p.RoundRunner(algo, digits).round(state, {}, [0, 1], jax.random.key(1))
    with pytest.raises(TypeError, match=r"RoundRunner\(algo, data\): data must be a FederatedData .*; got a tuple"):
        p.RoundRunner(p.FedAvg(small_model()), (np.zeros((4, 8, 8, 1)), np.zeros(4, int)))
    with pytest.raises(TypeError, match=r"sample_schedule: per_round must be an int; got float 2.0"):
        p.sample_schedule(jax.random.key(0), 3, 10, 2.0)
    with pytest.raises(ValueError, match=r"Layout\(client_parallel='vmapp'\): must be one of \('vmap', 'sequential'\) "
                                         r"or None"):   # when built (before: at the first round)
        p.Layout("vmapp", "scan")
    with pytest.raises(DataError, match=r"ragged list cannot be stacked"):
        p.from_arrays([[1.0, 2.0], [3.0]], [0, 1], num_clients=2, alpha=1.0)


class Pair(nn.Module):
    """A backbone that returns two arrays."""

    @nn.compact
    def __call__(self, x):
        h = nn.Dense(8)(x.reshape(x.shape[0], -1))
        return h, h


def test_a_model_given_the_wrong_way_is_named(digits):
    """Linen modules handed to NNXModel, and a backbone that returns a tuple, are one TypeError each
    saying what to do (before: flax's 'Can't call compact methods on unbound modules', and
    "'tuple' object has no attribute 'ndim'")."""
    with pytest.raises(TypeError, match=r"NNXModel\(backbone=...\) takes flax.nnx modules; got a flax.linen Dense: "
                                        r"linen modules go in LinenModel\(backbone, head\)"):
        p.NNXModel(nn.Dense(8), nn.Dense(3))
    with pytest.raises(TypeError, match=r"the backbone must return one array of features \[B, ...\]; it returned a "
                                        r"tuple"):
        p.FedAvg(p.LinenModel(Pair(), nn.Dense(10))).init(jax.random.key(0), digits)
    # the paper's CNN on images without a channel axis, or channels first: the remedy (before: "use a model
    # of your own" for both)
    for shape, remedy in [((28, 28), r"grey images without a channel axis: give from_arrays images\[..., None\]"),
                          ((1, 28, 28), r"channels first: give from_arrays images.transpose\(0, 2, 3, 1\)"),
                          ((6,), r"use a model of your own for other inputs")]:
        with pytest.raises(ValueError, match=r"CNN.init: the paper's CNN takes images \(H, W, C\) .*" + remedy):
            p.CNN(10).init(jax.random.key(0), shape)


class HalfBackbone(nn.Module):
    """A bfloat16 perceptron (parameters stored in bfloat16)."""

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(16, param_dtype=jnp.bfloat16)(x.reshape(x.shape[0], -1)))


def test_a_bfloat16_model_keeps_its_dtypes_through_rounds_and_files(digits, tmp_path):
    """A model stored in bfloat16: the server steps that average (FedAvg's stacked mean, Ditto's, pFedSim's
    mixed downloads after its warm-up) give its state back in bfloat16, as the protocol asks of a
    server step (before: float32, so the second round compiled again and a scan over rounds failed),
    the host loop's running sums too; save_state / load_state round-trip it (before: read back as the
    void dtype .npz stores it under, and refused)."""
    model = p.LinenModel(HalfBackbone(), nn.Dense(10, param_dtype=jnp.bfloat16))
    dtypes = lambda s: [x.dtype for x in jax.tree_util.tree_leaves(s)]  # noqa: E731
    for algo in (p.FedAvg(model, p.FedAvgConfig(local_epochs=1, batch_size=32)),
                 p.Ditto(model, p.DittoConfig(local_epochs=1, batch_size=32)),
                 p.PFedSim(model, p.PFedSimConfig(local_epochs=1, batch_size=32, rounds=2, warmup=1))):
        state = algo.init(jax.random.key(0), digits)
        assert jnp.bfloat16 in dtypes(state)
        round_ = jax.jit(p.make_round(algo, p.Layout("vmap", "scan")))
        after = state
        for t in range(2):   # pFedSim: its warm-up round, then a round of mixed downloads
            after = round_(after, digits, jnp.array([0, 1]), jax.random.key(t))[0]
            assert dtypes(after) == dtypes(state), type(algo).__name__
    fedavg = p.FedAvg(model, p.FedAvgConfig(local_epochs=1, batch_size=32))
    state = fedavg.init(jax.random.key(0), digits)
    hosted = p.RoundRunner(fedavg, digits, p.Layout("sequential", "unrolled", chunk_steps=2)).round(
        state, digits, np.array([0, 1]), jax.random.key(1))[0]
    pure = jax.jit(p.make_round(fedavg, p.Layout("vmap", "scan")))(state, digits, jnp.array([0, 1]), jax.random.key(1))[0]
    assert dtypes(hosted) == dtypes(pure) == dtypes(state)
    back = p.load_state(p.save_state(tmp_path / "half.npz", pure), pure)
    assert dtypes(back) == dtypes(pure)
    # check_method compares bfloat16 leaves to its tolerance (before: bit for bit, numpy's floating leaves it out)
    from pfedkdh_jax.engine import conformance
    one, near = {"w": jnp.ones(2, jnp.bfloat16)}, {"w": jnp.full(2, 1.0078125, jnp.bfloat16)}
    conformance._compare("layouts", one, near, 0.1, "")
    with pytest.raises(p.ProtocolError, match=r"layouts: .*w.* differs by 0.00781 \(tolerance 0.0001\)"):
        conformance._compare("layouts", one, near, 1e-4, "")
    # what is averaged must be floating (a mean of integers cut back to integers, silently, before)
    from pfedkdh_jax.engine.protocol import sample_mean
    with pytest.raises(TypeError, match=r"sample_mean: averages floating leaves only; \['n'\] is int32"):
        sample_mean({"n": jnp.ones((2, 3), jnp.int32), "x": jnp.ones((2, 3))}, jnp.ones(2))
    assert all(np.array_equal(np.asarray(a), np.asarray(b))
               for a, b in zip(jax.tree_util.tree_leaves(pure), jax.tree_util.tree_leaves(back)))


def test_a_users_loop_saves_and_loads_its_state(digits, tmp_path):
    """save_state / load_state: a round's state (and a typed key beside it) round-trips exactly; a state
    of another shape is named by its leaf's path."""
    algo = p.FedPer(small_model(), p.FedPerConfig(local_epochs=1, batch_size=32))
    state = algo.init(jax.random.key(0), digits)
    state = jax.jit(p.make_round(algo, p.Layout("vmap", "scan")))(state, digits, jnp.array([0, 1]), jax.random.key(1))[0]
    carry = {"state": state, "key": jax.random.key(7), "round": jnp.int32(1), "step": 3}
    path = p.save_state(tmp_path / "deeper" / "carry.npz", carry)   # its folder made, no temporary left
    assert sorted(x.name for x in (tmp_path / "deeper").iterdir()) == ["carry.npz"]
    back = p.load_state(path, carry)
    assert back["step"] == 3 and isinstance(back["step"], int)
    from pfedkdh_jax.run.checkpoint import Checkpoints   # a run's checkpoints take typed keys too
    ck = Checkpoints(str(tmp_path / "run"), {"config": "c"})
    ck.save(1, carry, [])
    assert np.array_equal(jax.random.key_data(ck.restore_latest(carry)[1]["key"]), jax.random.key_data(carry["key"]))
    plain = lambda x: jax.random.key_data(x) if getattr(x, "dtype", None) == carry["key"].dtype else x  # noqa: E731
    for a, b in zip(jax.tree_util.tree_leaves(carry), jax.tree_util.tree_leaves(back)):
        assert np.array_equal(plain(a), plain(b))
    assert back["key"].dtype == carry["key"].dtype
    other = p.FedPer(p.LinenModel(SmallBackbone(), nn.Dense(10))).init(jax.random.key(0), p.from_arrays(
        load_pool("digits").images[:600], load_pool("digits").labels[:600], num_clients=5, alpha=1.0, aux_size=60))
    with pytest.raises(ValueError, match=r"leaf \['state'\]\.heads\['bias'\] is float32\[4, 10\], the state's is "
                                         r"float32\[5, 10\]"):
        p.load_state(path, {**carry, "state": other})
    with pytest.raises(ValueError, match="does not exist"):
        p.load_state(tmp_path / "none.npz", carry)
    cut = tmp_path / "cut.npz"
    cut.write_bytes(pathlib.Path(path).read_bytes()[:200])
    with pytest.raises(ValueError, match="is not a state written by save_state"):
        p.load_state(cut, carry)
    with pytest.raises(ValueError, match="like holds an abstract random key"):
        p.load_state(path, jax.eval_shape(lambda: carry))


class _Identity(nn.Module):
    @nn.compact
    def __call__(self, x):
        return x


def _tabular(n=160, d=6, k=3, dtype=np.float32):
    rng = np.random.default_rng(0)
    y = rng.integers(0, k, n)
    x = (rng.normal(size=(k, d))[y] * 2 + rng.normal(size=(n, d))).astype(np.float32)
    return p.from_arrays(np.asarray(jnp.asarray(x, dtype)), y, client_ids=np.repeat(np.arange(4), n // 4))


def test_an_outside_users_models_optimizers_and_mistakes():
    """What an outside user met (a review): each failed before its fix as said."""
    data = _tabular()
    one_round = lambda a: jax.jit(p.make_round(a))(a.init(jax.random.key(0), data), data,  # noqa: E731
                                                   jnp.array([0, 1]), jax.random.key(1))
    cfg = dict(local_epochs=1, batch_size=8)
    # a part without parameters (logistic regression: an identity backbone; KeyError 'params' before)
    state, _ = one_round(p.FedAvg(p.LinenModel(_Identity(), nn.Dense(3)), p.FedAvgConfig(**cfg)))
    assert state.backbone == {}
    # a mask over the whole model's leaves: FedBABU's body-only training takes it (a pytree error before);
    # a head trained alone (FedRep's head epochs) cannot, and says what to give instead
    mlp = p.LinenModel(nn.Dense(8), nn.Dense(3))
    params = mlp.init(jax.random.key(0), (6,))
    tx = optax.adamw(1e-3, mask=jax.tree.map(lambda a: a.ndim > 1, params))
    one_round(p.FedBABU(mlp, p.FedBABUConfig(**cfg, finetune_epochs=1, optimizer=tx)))
    with pytest.raises(ValueError, match="give it as a function of the parameters"):
        one_round(p.FedRep(mlp, p.FedRepConfig(**cfg, head_epochs=1, optimizer=tx)))
    # an optimizer whose update needs more than (grads, state, params): one line (a TypeError deep in optax before)
    with pytest.raises(TypeError, match="needs arguments local training does not pass"):
        one_round(p.FedAvg(mlp, p.FedAvgConfig(**cfg, optimizer=optax.contrib.reduce_on_plateau())))
    # no client with a test sample: evaluation says so (a ZeroDivisionError before)
    part = p.Partition(aux_idx=np.zeros(0, np.int64), train_idx=(np.arange(0, 30), np.arange(40, 60)),
                       test_idx=(np.zeros(0, np.int64),) * 2, num_clients=2)
    x = np.asarray(data.images)[:100]
    bare = p.from_arrays(x, np.arange(100) % 3, partition=part)
    algo = p.FedPer(mlp, p.FedPerConfig(**cfg))
    with pytest.raises(DataError, match="no client holds a test sample"):
        p.make_evaluate(algo)(algo.init(jax.random.key(0), bare), bare, jax.random.key(2))
    # bfloat16 features are floats (refused as not real numbers before)
    assert _tabular(dtype=jnp.bfloat16).images.dtype == jnp.bfloat16
    # the wrong object where a method is due, named
    with pytest.raises(TypeError, match="give a method, not its class"):
        p.RoundRunner(p.FedPer, data)
    for thing in (p.FedPerConfig(), mlp, None):
        with pytest.raises(TypeError, match="takes a method"):
            p.make_round(thing)
    with pytest.raises(TypeError, match=r"FedPer\(model=None\): a method needs a model"):
        p.FedPer(None, p.FedPerConfig())
    with pytest.raises(ValueError, match="reps must be None"):
        p.RoundRunner(algo, data, reps=0)
    p.check_method(algo, data, rounds=1, checks="evaluation")   # one check by name ("no check 'e'" before)
    # the round made again for the same method object is the one made before: a new jit of it finds the
    # program compiled before (it compiled again); an equal method (lr=1 against np.float64(1.0) may compute
    # otherwise) and a traced config are not shared or kept
    from pfedkdh_jax.engine import round as round_module
    assert p.make_round(algo) is p.make_round(algo) and p.make_evaluate(algo) is p.make_evaluate(algo)
    assert p.make_round(algo) is not p.make_round(p.FedPer(mlp, p.FedPerConfig(**cfg)))
    kept = dict(round_module._PIECES)
    jax.vmap(lambda lr: p.make_round(algo.with_hparams({"lr": lr})) and lr)(jnp.ones(2))
    assert round_module._PIECES == kept
    # the names the README gives
    assert p.run_stacked.__module__ == "pfedkdh_jax.run.experiment" and issubclass(p.StateError, ValueError)


def test_nnx_dropout_is_said_to_stay_off():
    from flax import nnx

    class Body(nnx.Module):
        def __init__(self, rngs):
            self.lin, self.drop = nnx.Linear(6, 8, rngs=rngs), nnx.Dropout(0.5)

        def __call__(self, x):
            return self.drop(nnx.relu(self.lin(x)))

    with pytest.warns(UserWarning, match="nnx.Dropout stays off in training too"):
        p.NNXModel(lambda r: Body(r), lambda r: nnx.Linear(8, 3, rngs=r))
