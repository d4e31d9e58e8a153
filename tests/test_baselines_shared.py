"""FedAvg, FedProx, FedPer, FedRep and FedBABU on the tiny federation.

For each method a hand-checkable case of what makes it different, then tracing (nothing recompiles
after the first round) and a 2-round CLI smoke run of each on the digits demo set.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfedkdh_jax import algorithms as methods
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms import fedavg, fedbabu, fedper, fedprox, fedrep
from pfedkdh_jax.run.config import ConfigError, make_config
from pfedkdh_jax.engine.protocol import ClientUpdate, EvalModels
from pfedkdh_jax.engine.evaluate import make_evaluate
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.data.device import gather_inputs
from pfedkdh_jax.model import CNN
from pfedkdh_jax.engine.runner import RoundRunner

LC = dict(lr=0.05, batch_size=8, local_epochs=1)
SELECTED = [np.array([2, 0]), np.array([1, 2]), np.array([3, 1])]
NAMES = ["fedavg", "fedprox", "fedper", "fedrep", "fedbabu"]
tmap = jax.tree_util.tree_map


def make_algo(name, data, dropout=0.0, **kw):
    model = CNN(data.num_classes, dropout)
    if name == "fedavg":
        return fedavg.FedAvg(model, C.LocalConfig(**LC))
    if name == "fedprox":
        return fedprox.FedProx(model, fedprox.FedProxConfig(**LC, **{"mu": 1.0, **kw}))
    if name == "fedper":
        return fedper.FedPer(model, C.LocalConfig(**LC))
    if name == "fedrep":
        return fedrep.FedRep(model, fedrep.FedRepConfig(**LC, **{"head_epochs": 1, **kw}))
    return fedbabu.FedBABU(model, fedbabu.FedBABUConfig(**LC, **{"finetune_epochs": 1, **kw}))


def make(name, tiny, form=("sequential", "unrolled"), **kw):
    _, _, data = tiny
    algo = make_algo(name, data, **kw)
    runner = RoundRunner(algo, data, Layout(*form, chunk_steps=2))
    return algo, runner, algo.init(jax.random.key(0), data)


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def client(tree, k):
    return tmap(lambda x: x[k], tree)


def assert_tree_close(a, b, **tol):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        np.testing.assert_allclose(x, y, **tol)


def stacked_finals(algo, state, data, selected, params_list):
    """The selected clients' updates with the given parameters (as if they had trained)."""
    return ClientUpdate(params=tree_stack(params_list), loss=jnp.zeros(len(params_list)))


def stepper(trainer):
    """One jitted local step of ``trainer`` on a client's row (the engine's own step)."""
    return jax.jit(lambda s, row, d: trainer.step(s, None, row, d, gate="where"))


@functools.lru_cache(maxsize=None)
def _predict(model):
    return jax.jit(lambda p, d: jnp.argmax(model.logits(p, gather_inputs(d, d.test_flat)[0]), -1))


def direct_accuracy(model, params, data, k):
    """Accuracy of ``params`` on client k's test split, computed without the evaluation module."""
    mine = np.asarray(data.test_client) == k
    pred = np.asarray(_predict(model)(params, data))[mine]
    return float(np.mean(pred == np.asarray(data.labels)[np.asarray(data.test_flat)[mine]]))


@pytest.fixture(scope="module")
def trained(tiny):
    """Three rounds of a method with the CPU default form, keeping every state (built on demand)."""
    _, _, data = tiny
    cache = {}

    def get(name):
        if name not in cache:
            algo, runner, state = make(name, tiny)
            states, metrics = [state], []
            for r, sel in enumerate(SELECTED):
                state, m = runner.round(state, data, sel, jax.random.key(100 + r))
                states.append(state)
                metrics.append(m)
            cache[name] = (algo, runner, states, metrics)
        return cache[name]
    return get


# ------------------------------------------------------------------------------------- registry
def test_registry_defaults_options_and_budget():
    assert methods.METHODS["fedavg"].args == {} and methods.METHODS["fedper"].args == {}
    assert methods.METHODS["fedprox"].args == {"mu": 1.0}          # FedProxConfig's default
    assert methods.METHODS["fedrep"].args == {"head_epochs": 10}
    assert methods.METHODS["fedbabu"].args == {"finetune_epochs": 5, "finetune_part": "full"}
    assert methods.parse_method_args("fedprox", [("mu", "0.01")]) == {"mu": 0.01}
    for name, pair, match in [("fedbabu", ("finetune_part", "body"), "finetune_part"),
                              ("fedrep", ("head_epochs", "-1"), "head_epochs"),
                              ("fedprox", ("mu", "-1"), "mu"), ("fedavg", ("mu", "1"), "not an option")]:
        with pytest.raises(ValueError, match=match):
            methods.parse_method_args(name, [pair])
    with pytest.raises(ConfigError, match="warmup"):
        make_config(method="fedavg", warmup_epochs=1)
    # the shared budget comes from the run config, the method's own options from --method-arg
    cfg = make_config("smoke", method="fedrep", method_args=(("head_epochs", "3"),), lr=0.1,
                      batch_size=16, local_epochs=2)
    algo = methods.build(cfg, 10)
    assert algo.config == fedrep.FedRepConfig(lr=0.1, batch_size=16, local_epochs=2, head_epochs=3)
    assert algo.trainer.epochs == 2 and algo.head_phase.epochs == 3  # body epochs; head epochs
    babu = methods.build(make_config(method="fedbabu"), 10)   # (the smoke preset scales it to 1)
    assert (babu.personalization.trainer.epochs, babu.config.finetune_part) == (5, "full")


# --------------------------------------------------------------------------------------- FedAvg
def test_fedavg_averages_full_models_weighted_by_n(tiny):
    _, _, data = tiny
    algo, _, state = make("fedavg", tiny)
    p = {"backbone": state.backbone, "head": state.head}
    sel = np.array([2, 0])
    n2, n0 = data.train_sizes[2], data.train_sizes[0]
    finals = stacked_finals(algo, state, data, sel, [p, tmap(lambda x: x + 1.0, p)])
    new, m = jax.jit(algo.server_update)(state, data, jnp.asarray(sel), finals, jax.random.key(0))
    want = tmap(lambda x: x + n0 / (n0 + n2), p)          # head included: the full model is averaged
    assert_tree_close({"backbone": new.backbone, "head": new.head}, want, rtol=1e-6, atol=1e-6)
    assert int(new.round) == 1 and np.isfinite(float(m["train_loss"]))


def test_fedavg_is_scored_with_the_global_model(tiny, trained):
    _, _, data = tiny
    algo, runner, states, _ = trained("fedavg")
    for state in (states[0], states[1]):
        m = runner.evaluate(state, data, jax.random.key(0))
        for kind in ("macro", "micro", "per_client"):
            np.testing.assert_array_equal(m[f"personalized_{kind}_accuracy"], m[f"global_{kind}_accuracy"])
        params = {"backbone": state.backbone, "head": state.head}
        per = [direct_accuracy(algo.model, params, data, k) for k in range(data.num_clients)]
        np.testing.assert_allclose(m["global_per_client_accuracy"], per, atol=1e-6)
        assert float(m["global_macro_accuracy"]) == pytest.approx(np.mean(per), abs=1e-6)


# -------------------------------------------------------------------------------------- FedProx
def test_fedprox_with_mu_zero_is_fedavg(tiny, trained):
    _, _, data = tiny
    _, _, avg_states, avg_metrics = trained("fedavg")
    _, runner, state = make("fedprox", tiny, mu=0.0)
    for r, sel in enumerate(SELECTED):
        state, m = runner.round(state, data, sel, jax.random.key(100 + r))
        assert_tree_close(state, avg_states[r + 1], rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(m["train_loss"], avg_metrics[r]["train_loss"], rtol=1e-6)


def test_fedprox_pulls_clients_toward_the_global_model(tiny, trained):
    _, _, avg_states, _ = trained("fedavg")
    _, _, prox_states, _ = trained("fedprox")                      # μ = 1
    start = avg_states[0]
    assert leaves_equal(start, prox_states[0])

    def dist(s):
        return sum(float(jnp.sum((a - b) ** 2)) for a, b in zip(jax.tree_util.tree_leaves((s.backbone, s.head)),
                                                                jax.tree_util.tree_leaves((start.backbone, start.head))))
    assert 0 < dist(prox_states[1]) < dist(avg_states[1])


def test_fedprox_gradient_is_ce_plus_mu_times_the_drift(tiny):
    _, _, data = tiny
    algo = make_algo("fedprox", data, mu=0.5)
    state = algo.init(jax.random.key(0), data)
    params = tmap(lambda x: x + 0.01, algo.context(state))        # w = w_g + 0.01 in every entry
    x, y = gather_inputs(data, data.train_idx[1, :8])
    mask = jnp.ones(8, bool)
    g = jax.jit(jax.grad(algo.local_loss))(params, algo.context(state), x, y, mask, None)
    g_ce = jax.jit(jax.grad(C.cross_entropy_loss(algo.model)))(params, None, x, y, mask, None)
    for a, b in zip(jax.tree_util.tree_leaves(g), jax.tree_util.tree_leaves(g_ce)):   # head too
        np.testing.assert_allclose(a - b, 0.5 * 0.01, atol=1e-6)


# ------------------------------------------------------------------------- FedPer (and FedRep)
@pytest.mark.parametrize("name", ["fedper", "fedrep"])
def test_heads_persist_with_their_clients(tiny, trained, name):
    _, _, data = tiny
    _, _, states, _ = trained(name)
    chex.assert_tree_shape_prefix(states[-1].heads, (data.num_clients,))
    for r, sel in enumerate(SELECTED):
        for k in range(data.num_clients):
            same = leaves_equal(client(states[r].heads, k), client(states[r + 1].heads, k))
            assert same == (k not in sel), (r, k)
        assert not leaves_equal(states[r].backbone, states[r + 1].backbone)


def test_fedper_server_keeps_uploaded_heads_and_averages_only_the_base(tiny):
    _, _, data = tiny
    algo, _, state = make("fedper", tiny)
    sel = np.array([2, 0])
    b, h = state.backbone, client(state.heads, 0)
    h2, h0 = tmap(lambda x: 2.0 * x + 1.0, h), tmap(lambda x: x - 3.0, h)
    finals = stacked_finals(algo, state, data, sel, [{"backbone": b, "head": h2},
                                                     {"backbone": tmap(lambda x: x + 1.0, b), "head": h0}])
    update = jax.jit(algo.server_update)
    new, _ = update(state, data, jnp.asarray(sel), finals, jax.random.key(0))
    n2, n0 = data.train_sizes[2], data.train_sizes[0]
    assert_tree_close(new.backbone, tmap(lambda x: x + n0 / (n0 + n2), b), rtol=1e-6, atol=1e-6)
    assert leaves_equal(client(new.heads, 2), h2) and leaves_equal(client(new.heads, 0), h0)  # not averaged
    for k in (1, 3):
        assert leaves_equal(client(new.heads, k), client(state.heads, k))
    # the base average never reads the clients' heads
    scrambled = state.replace(heads=tmap(lambda x: -7.0 * x, state.heads))
    other, _ = update(scrambled, data, jnp.asarray(sel), finals, jax.random.key(0))
    assert leaves_equal(other.backbone, new.backbone)


# --------------------------------------------------------------------------------------- FedRep
def test_fedrep_trains_the_head_then_the_body(tiny):
    _, _, data = tiny
    algo = make_algo("fedrep", data, head_epochs=2)               # E = 1 body epoch
    state = algo.init(jax.random.key(0), data)
    k, round_key = 1, jax.random.key(1)
    spe = -(-int(data.train_sizes[k]) // LC["batch_size"])
    head0 = client(state.heads, k)
    ls = jax.jit(algo.client_start)(state, data, jnp.int32(k), round_key)

    # head epochs (in client_start, on cached features): the body is untouched, and the head equals
    # head-only SGD of the whole model on the images, batch for batch
    assert leaves_equal(ls.params["backbone"], state.backbone)
    assert not leaves_equal(ls.params["head"], head0)
    ref_trainer = C.sgd_trainer(C.cross_entropy_loss(algo.model), C.head_only(optax.sgd(LC["lr"])),
                                algo.config, epochs=2)
    key = jax.random.fold_in(jax.random.fold_in(round_key, k), fedrep.HEAD_PHASE_STREAM)
    ref = ref_trainer.init({"backbone": state.backbone, "head": head0}, key, data.train_n[k],
                           data.max_train)
    ref_step = stepper(ref_trainer)
    for _ in range(2 * spe):
        ref = ref_step(ref, data.train_idx[k], data)
    assert leaves_equal(ref.params["backbone"], state.backbone)
    assert_tree_close(ls.params["head"], ref.params["head"], rtol=1e-5, atol=1e-6)

    # representation epochs (the engine's trainer): the head is frozen, the body moves
    np.testing.assert_array_equal(algo.trainer.num_steps(data.train_n),
                                  -(-np.asarray(data.train_sizes) // LC["batch_size"]))
    step = stepper(algo.trainer)
    for i in range(spe + 2):
        new = step(ls, data.train_idx[k], data)
        same_body = leaves_equal(new.params["backbone"], ls.params["backbone"])
        same_head = leaves_equal(new.params["head"], ls.params["head"])
        if i < spe:
            assert same_head and not same_body, i                 # body epochs: head frozen
        else:
            assert same_head and same_body, i                     # past the client's steps: no-op
        ls = new
    assert int(ls.step) == spe


def test_fedrep_without_head_epochs_is_fedper_with_a_frozen_head(tiny):
    _, _, data = tiny
    algo = make_algo("fedrep", data, head_epochs=0)
    state = algo.init(jax.random.key(0), data)
    ls = jax.jit(algo.client_start)(state, data, jnp.int32(2), jax.random.key(1))
    assert leaves_equal(ls.params["head"], client(state.heads, 2))


def test_fedrep_phases_are_the_same_in_the_fused_form(tiny, trained):
    """vmap + scan (one compiled call per round, ``lax.cond`` gating) computes the same rounds."""
    _, _, data = tiny
    _, _, states, metrics = trained("fedrep")
    _, runner, state = make("fedrep", tiny, ("vmap", "scan"))
    for r, sel in enumerate(SELECTED):
        state, m = runner.round(state, data, sel, jax.random.key(100 + r))
    # float32 round-off of a different op order (scan + cond vs unrolled + where) only
    assert_tree_close(state, states[-1], rtol=1e-4, atol=1e-4)
    # (on CPU YNNPACK takes the unrolled form's plain dots, not the fused form's batched ones)
    np.testing.assert_allclose(m["train_loss"], metrics[-1]["train_loss"], rtol=5e-5)
    assert dict(runner.traces) == {"round": 1}


# -------------------------------------------------------------------------------------- FedBABU
def test_fedbabu_head_stays_at_its_initialisation(tiny, trained):
    _, _, data = tiny
    algo, _, states, _ = trained("fedbabu")
    for s in states:
        assert leaves_equal(s.head, states[0].head)
    assert not leaves_equal(states[-1].backbone, states[0].backbone)
    # inside a client's local training too: the body moves, the head does not
    step = stepper(algo.trainer)
    ls = jax.jit(algo.client_start)(states[1], data, jnp.int32(1), jax.random.key(3))
    for _ in range(3):
        ls = step(ls, data.train_idx[1], data)
    assert leaves_equal(ls.params["head"], states[0].head)
    assert not leaves_equal(ls.params["backbone"], states[1].backbone)


def test_fedbabu_is_scored_after_fine_tuning(tiny, trained):
    """Personalized accuracy = each client's fine-tuned copy of (θ_g, φ⁰) on its own test split."""
    _, _, data = tiny
    algo, runner, states, _ = trained("fedbabu")
    state, key = states[0], jax.random.key(5)
    m = runner.evaluate(state, data, key)
    ft = algo.personalization
    step, start = stepper(ft.trainer), jax.jit(ft.start)
    for k in range(data.num_clients):
        ls = start(state, data, jnp.int32(k), key)
        for _ in range(int(ft.trainer.num_steps(data.train_sizes[k]))):
            ls = step(ls, data.train_idx[k], data)
        acc = direct_accuracy(algo.model, ls.params, data, k)
        assert float(m["personalized_per_client_accuracy"][k]) == pytest.approx(acc, abs=1e-6), k
    # the global accuracies are those of the un-fine-tuned global model (θ_g, φ⁰)
    glob = [direct_accuracy(algo.model, {"backbone": state.backbone, "head": state.head}, data, k)
            for k in range(data.num_clients)]
    np.testing.assert_allclose(m["global_per_client_accuracy"], glob, atol=1e-6)
    assert float(m["personalized_macro_accuracy"]) > float(m["global_macro_accuracy"])


def test_fedbabu_fine_tunes_the_chosen_part(tiny):
    _, _, data = tiny
    for part, body_moves in (("full", True), ("head", False)):
        algo = make_algo("fedbabu", data, finetune_part=part)
        state = algo.init(jax.random.key(0), data)
        ft = algo.personalization
        ls = jax.jit(ft.start)(state, data, jnp.int32(1), jax.random.key(0))
        new = stepper(ft.trainer)(ls, data.train_idx[1], data)
        assert not leaves_equal(new.params["head"], state.head)
        assert leaves_equal(new.params["backbone"], state.backbone) == (not body_moves)
    assert make_algo("fedbabu", data, finetune_epochs=0).personalization is None
    with pytest.raises(ValueError, match="finetune_part"):
        make_algo("fedbabu", data, finetune_part="body")


@pytest.mark.parametrize("form", [("vmap", "unrolled"), ("vmap", "scan")])
def test_fine_tuned_evaluation_is_the_same_in_every_engine_form(tiny, trained, form):
    _, _, data = tiny
    _, runner, states, _ = trained("fedbabu")
    want = runner.evaluate(states[1], data, jax.random.key(2))
    _, other, _ = make("fedbabu", tiny, form)
    got = other.evaluate(states[1], data, jax.random.key(2))
    assert set(got) == set(want)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-6, err_msg=key)


def test_per_client_scoring_matches_the_shared_scoring(tiny, trained):
    """Every client holding the global model as a model of its own (owner-grouped features) scores
    exactly what the shared-backbone path scores."""
    _, _, data = tiny
    algo, runner, states, _ = trained("fedavg")
    state = states[1]
    shared = runner.evaluate(state, data, jax.random.key(0))
    k = data.num_clients
    own = EvalModels(backbone=C.broadcast(state.backbone, k), heads=C.broadcast(state.head, k), per_client=True)
    pieces = make_evaluate(algo, Layout("vmap", "scan"))
    got = jax.jit(lambda m, d: pieces.score(m, pieces.test_features(m, d), d))(own, data)
    for key, value in got.items():
        np.testing.assert_allclose(value, shared[key], atol=1e-6, err_msg=key)


# -------------------------------------------------------------------------------------- tracing
@pytest.mark.parametrize("name", NAMES)
def test_no_recompilation_after_first_round(tiny, trained, name):
    _, _, data = tiny
    _, runner, states, _ = trained(name)      # three rounds with different clients (sizes) done
    state = states[-1]
    runner.evaluate(state, data, jax.random.key(0))
    first = dict(runner.traces)
    for r in range(2):
        state, _ = runner.round(state, data, np.array([r, 3]), jax.random.key(r))
        runner.evaluate(state, data, jax.random.key(r))
    assert dict(runner.traces) == first
    assert first and all(v == 1 for v in first.values()), first


# The CLI smoke runs of every method: tests/test_smoke_presets.py
