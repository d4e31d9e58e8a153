"""Ditto, pFedMe, FedProto and FedALA on the tiny federation: what makes each method different, the
per-client evaluation path, no retracing after the first round, and a 2-round CLI run of each."""


import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfedkdh_jax import losses
from pfedkdh_jax.run import cli
from pfedkdh_jax.algorithms import ditto, fedala, fedproto, pfedme
from pfedkdh_jax.algorithms.common import take
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import LocalTrainer
from pfedkdh_jax.data.device import gather_inputs
from pfedkdh_jax.algorithms import parse_method_args
from pfedkdh_jax.model import CNN
from pfedkdh_jax.algorithms.common import weighted_average
from pfedkdh_jax.engine.client_rows import ClientRows
from pfedkdh_jax.engine.runner import RoundRunner

SHARED = dict(lr=0.05, batch_size=8, local_epochs=1)
SELECTED = [np.array([2, 0]), np.array([1, 2]), np.array([3, 1])]


def make_algo(name, data, dropout=0.2, **hp):
    model = CNN(data.num_classes, dropout)
    if name == "ditto":
        return ditto.Ditto(model, ditto.DittoConfig(**SHARED, **hp))
    if name == "pfedme":
        return pfedme.PFedMe(model, pfedme.PFedMeConfig(**SHARED, **{"inner_steps": 2, **hp}))
    if name == "fedproto":
        return fedproto.FedProto(model, fedproto.FedProtoConfig(**SHARED, **hp))
    return fedala.FedALA(model, fedala.FedALAConfig(**SHARED, **{"start_epochs": 3, **hp}))


def leaves_equal(a, b):
    la, lb = jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)
    return len(la) == len(lb) and all(np.array_equal(x, y) for x, y in zip(la, lb))


def assert_close(a, b, tol=1e-5):
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b), strict=True):
        if jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(x, y)


def runs(tiny, name, form=("sequential", "unrolled"), rounds=3, **hp):
    """``rounds`` rounds of ``name`` (dropout on) keeping every state, then an evaluation."""
    _, _, data = tiny
    algo = make_algo(name, data, **hp)
    runner = RoundRunner(algo, data, Layout(*form, chunk_steps=4))
    states, metrics = [algo.init(jax.random.key(0), data)], []
    for r, sel in enumerate(SELECTED[:rounds]):
        state, m = runner.round(states[-1], data, sel, jax.random.key(100 + r))
        states.append(state)
        metrics.append(m)
    return algo, runner, states, metrics, runner.evaluate(states[-1], data, jax.random.key(0))


@pytest.fixture(scope="module")
def trained(tiny):
    """``trained(name)``: the CPU-default runs of a method, computed once per module."""
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = runs(tiny, name)
        return cache[name]
    return get


METHODS = ["ditto", "pfedme", "fedproto", "fedala"]
PERSONAL = {"ditto": lambda s: s.personal, "pfedme": lambda s: s.personal,
            "fedproto": lambda s: s.models, "fedala": lambda s: s.local}


# ----------------------------------------------------------------------------------- all four methods
@pytest.mark.parametrize("name", METHODS)
def test_client_axis_and_untouched_clients(tiny, trained, name):
    _, _, data = tiny
    _, _, states, metrics, evaluation = trained(name)
    personal = PERSONAL[name]
    chex.assert_tree_shape_prefix(personal(states[-1]), (data.num_clients,))
    for r, sel in enumerate(SELECTED):
        for k in range(data.num_clients):
            same = leaves_equal(take(personal(states[r]), k), take(personal(states[r + 1]), k))
            assert same == (k not in sel), (name, r, k)
    assert int(states[-1].round) == 3
    assert all(np.isfinite(float(m["train_loss"])) for m in metrics)
    for key in ("personalized_macro_accuracy", "personalized_micro_accuracy"):
        assert 0.0 <= float(evaluation[key]) <= 1.0
    assert np.asarray(evaluation["personalized_per_client_accuracy"]).shape == (data.num_clients,)
    assert ("global_macro_accuracy" in evaluation) == (name != "fedproto")
    assert ("head_macro_accuracy" in evaluation) == (name == "fedproto")


@pytest.mark.parametrize("name", METHODS)
def test_no_retrace_after_first_round(tiny, trained, name):
    _, _, data = tiny
    _, runner, states, _, _ = trained(name)
    state = states[-1]
    state, _ = runner.round(state, data, np.array([0, 3]), jax.random.key(7))
    runner.evaluate(state, data, jax.random.key(1))
    after_first = dict(runner.traces)
    for r in range(2):
        state, _ = runner.round(state, data, np.array([r, 2]), jax.random.key(9 + r))
        runner.evaluate(state, data, jax.random.key(r))
    assert dict(runner.traces) == after_first
    assert all(v == 1 for v in after_first.values()), after_first


@pytest.mark.parametrize("name", METHODS)
def test_each_sample_is_scored_with_its_owners_model(tiny, trained, name):
    """The per-client evaluation equals a direct computation, client by client."""
    _, part, data = tiny
    algo, _, states, _, evaluation = trained(name)
    models = algo.eval_models(states[-1])
    assert models.per_client
    backbones, heads, global_model = models.backbone, models.heads, models.global_model
    extra = models.extra_heads or {}
    for prefix, all_heads in {"personalized": heads, **extra}.items():
        per = []
        for k, idx in enumerate(part.test_idx):
            x, y = gather_inputs(data, jnp.asarray(idx))
            z = algo.model.features(take(backbones, k), x)
            rule = models.head_logits if prefix == "personalized" and models.head_logits else \
                algo.model.logits_from_features
            pred = np.argmax(rule(take(all_heads, k), z), -1)
            per.append(np.mean(pred == np.asarray(y)))
        np.testing.assert_allclose(evaluation[f"{prefix}_per_client_accuracy"], per, atol=1e-6)
    if global_model is not None:
        flat = np.concatenate(part.test_idx)
        x, y = gather_inputs(data, jnp.asarray(flat))
        pred = np.argmax(algo.model.logits(global_model, x), -1)
        accuracy = float(np.mean(pred == np.asarray(y)))
        assert float(evaluation["global_micro_accuracy"]) == pytest.approx(accuracy, abs=1e-6)


@pytest.mark.parametrize("name", ["fedproto", "fedala"])
def test_vmap_scan_form_computes_the_same_numbers(tiny, trained, name):
    """The fused one-call round (client_finish / aux vmapped) and the lax.map evaluation agree with the
    CPU default form (two rounds: FedALA's ALA runs in the second)."""
    _, _, data = tiny
    _, default_runner, states, _, _ = trained(name)
    _, runner, states_v, _, evaluation_v = runs(tiny, name, form=("vmap", "scan"), rounds=2)
    assert_close(states_v[-1], states[2], tol=2e-5)
    evaluation = default_runner.evaluate(states[2], data, jax.random.key(0))
    for key in ("personalized_per_client_accuracy", "personalized_micro_accuracy"):
        np.testing.assert_allclose(evaluation_v[key], evaluation[key], atol=1e-6)
    assert "round" in runner.traces and "owned_features_scan" in runner.traces


# ------------------------------------------------------------------- personal models of trained clients
def test_client_rows_place_new_clients_in_order_and_count_those_that_do_not_fit():
    base = {"w": jnp.arange(3.0)}
    rows = ClientRows.create(base, num_clients=6, capacity=3)
    put = jax.jit(lambda r, c, v: r.put(c, v))
    rows = put(rows, jnp.array([4, 1]), {"w": jnp.full((2, 3), 1.0)})
    rows = put(rows, jnp.array([1, 5, 0]), {"w": jnp.stack([jnp.full(3, 2.0), jnp.full(3, 3.0), jnp.full(3, 4.0)])})
    np.testing.assert_array_equal(rows.slot, [-1, 1, -1, -1, 0, 2])     # client 0 found no free row
    assert int(rows.used) == 3 and int(rows.lost) == 1
    got = rows.dense()["w"][:, 0]
    np.testing.assert_array_equal(got, [0.0, 2.0, 0.0, 0.0, 1.0, 3.0])   # clients without a row read base
    np.testing.assert_array_equal(take(rows, jnp.array([5, 2]))["w"], [[3.0] * 3, [0.0, 1.0, 2.0]])


def test_ditto_with_rows_for_the_trained_clients_only_computes_the_same_run(tiny, trained):
    """Two rounds select clients 2, 0, 1: three rows hold every personal model that moved, and the
    state, the round metrics and the evaluation are the dense run's."""
    _, _, data = tiny
    _, _, states, metrics, _ = trained("ditto")
    algo, _, rows_states, rows_metrics, evaluation = runs(tiny, "ditto", rounds=2, personal_rows=3)
    last = rows_states[-1]
    assert isinstance(last.personal, ClientRows) and last.personal.capacity == 3
    assert int(last.personal.used) == 3 and int(last.personal.lost) == 0
    assert_close(last.params, states[2].params, tol=0)
    assert_close(last.personal.dense(), states[2].personal, tol=0)
    assert [int(m["rows_lost"]) for m in rows_metrics] == [0, 0]
    assert_close([{k: m[k] for k in metrics[0]} for m in rows_metrics], metrics[:2], tol=0)
    dense_eval = RoundRunner(make_algo("ditto", data), data, Layout("sequential", "unrolled", chunk_steps=4)) \
        .evaluate(states[2], data, jax.random.key(0))
    for key in ("personalized_per_client_accuracy", "global_macro_accuracy"):
        np.testing.assert_array_equal(evaluation[key], dense_eval[key])
    # the pure round (one program: clients vmapped, steps scanned) reads and writes the rows alike
    _, _, fused_states, _, _ = runs(tiny, "ditto", form=("vmap", "scan"), rounds=2, personal_rows=3)
    assert_close(fused_states[-1].personal.dense(), states[2].personal, tol=2e-5)


def test_fedala_with_rows_for_the_trained_clients_only_computes_the_same_run(tiny, trained):
    _, _, data = tiny
    _, _, states, _, _ = trained("fedala")
    _, _, rows_states, _, evaluation = runs(tiny, "fedala", rounds=2, personal_rows=3)
    assert isinstance(rows_states[-1].local, ClientRows)
    assert_close(rows_states[-1].local.dense(), states[2].local, tol=0)
    dense_eval = RoundRunner(make_algo("fedala", data), data, Layout("sequential", "unrolled", chunk_steps=4)) \
        .evaluate(states[2], data, jax.random.key(0))
    np.testing.assert_array_equal(evaluation["personalized_per_client_accuracy"],
                                  dense_eval["personalized_per_client_accuracy"])


def test_a_run_stops_when_a_client_finds_no_row():
    from pfedkdh_jax.run import records
    assert records.divergence({"rows_lost": 0.0}, 0) is None
    assert "personal_rows is below the clients trained" in records.divergence({"rows_lost": 2.0}, 0)


def test_a_run_keeps_rows_for_rounds_times_clients_per_round_when_fewer_than_its_clients():
    from pfedkdh_jax import algorithms
    from pfedkdh_jax.run.config import make_config

    def rows(**kw):
        cfg = make_config("default", method="ditto", **kw)
        return algorithms.build(cfg, 10).config.personal_rows
    assert rows(num_clients=1000, participation=0.05, rounds=10) == 500
    assert rows(num_clients=20, participation=0.5, rounds=50) == 0           # the paper's setting: one per client
    assert rows(num_clients=1000, participation=0.05, rounds=10, method_args=(("personal_rows", "0"),)) == 0
    cfg = make_config("default", method="fedala", num_clients=1000, participation=0.05, rounds=10)
    assert algorithms.build(cfg, 10).config.personal_rows == 500


# ---------------------------------------------------------------------------------------------- Ditto
def test_ditto_global_model_is_fedavg_with_the_same_keys(tiny, trained):
    """Training a personal model next to it leaves the global copy's local SGD untouched (dropout on,
    same keys): the new global model is the n_k-weighted average of plain-CE local runs."""
    _, _, data = tiny
    algo, _, states, _, _ = trained("ditto")
    state, sel, key = states[0], SELECTED[0], jax.random.key(100)
    ce = LocalTrainer(loss_fn=lambda p, c, x, y, m, r: losses.masked_mean(
                          losses.cross_entropy(algo.model.logits(p, x, rng=r), y), m),
                      tx=optax.sgd(SHARED["lr"]), gather=gather_inputs, epochs=1, batch_size=8)
    steps = ce.num_steps(int(data.train_n.max()))
    fedavg_local = jax.jit(lambda s, row: ce.run_scan(s, None, row, data, steps))
    uploads = []
    for k in sel:
        s = ce.init(state.params, jax.random.fold_in(key, int(k)), data.train_n[k], data.max_train)
        uploads.append(fedavg_local(s, data.train_idx[k]).params)
    expected = weighted_average(jax.tree_util.tree_map(lambda *x: jnp.stack(x), *uploads), data.train_n[sel])
    assert_close(states[1].params, expected)
    assert not leaves_equal(take(states[1].personal, 0), take(state.personal, 0))


def test_ditto_gradients_are_fedavg_and_proximal(tiny):
    """∂/∂w_k = ∇F(w_k) and ∂/∂v = ∇F(v) + λ(v − w^t): SGD on the pair is FedAvg's step for the
    global copy and Ditto's personal step for v."""
    _, _, data = tiny
    lam = 3.0
    algo = make_algo("ditto", data, dropout=0.0, lam=lam)
    w_t = algo.init(jax.random.key(0), data).params
    w_k = jax.tree_util.tree_map(lambda p: p - 0.02, w_t)
    v = jax.tree_util.tree_map(lambda p: p + 0.01, w_t)
    x, y = gather_inputs(data, data.train_idx[1][:8])
    mask, rng = jnp.arange(8) < 6, jax.random.key(2)
    joint = jax.grad(algo.local_loss)({"global": w_k, "personal": v}, w_t, x, y, mask, rng)

    def f(p, r):
        return losses.masked_mean(losses.cross_entropy(algo.model.logits(p, x, rng=r), y), mask)
    g_global, g_personal = jax.grad(f)(w_k, rng), jax.grad(f)(v, jax.random.fold_in(rng, 1))
    assert_close(joint["global"], g_global)
    assert_close(joint["personal"], jax.tree_util.tree_map(lambda g, vi, wi: g + lam * (vi - wi),
                                                           g_personal, v, w_t))


# --------------------------------------------------------------------------------------------- pFedMe
def test_pfedme_one_inner_step_from_w_is_sgd(tiny):
    """From θ = w with K = 1 and ν·λ = 1: θ' = w − ν∇f(w) and w' = w − η·λ·ν·∇f(w), by hand."""
    _, _, data = tiny
    lr, lam, nu = 0.05, 10.0, 0.1
    algo = make_algo("pfedme", data, lam=lam, personal_lr=nu, inner_steps=1)
    state = algo.init(jax.random.key(0), data)
    x, y = gather_inputs(data, data.train_idx[2][:8])
    mask, rng = jnp.ones(8, bool), jax.random.key(3)
    params = {"w": state.params, "theta": state.params}
    loss, new, _ = algo.local_update(params, algo.trainer.tx.init(params), None, x, y, mask, rng)
    value, g = jax.value_and_grad(algo.batch_loss)(state.params, None, x, y, mask, jax.random.fold_in(rng, 0))
    assert float(loss) == pytest.approx(float(value), rel=1e-6)
    assert_close(new["theta"], jax.tree_util.tree_map(lambda w, gw: w - nu * gw, state.params, g))
    assert_close(new["w"], jax.tree_util.tree_map(lambda w, gw: w - lr * lam * nu * gw, state.params, g))


def test_pfedme_server_mixing(tiny):
    """β = 1 is exactly the n_k-weighted average; β = 2 extrapolates: (1 − β)·w + β·avg."""
    _, _, data = tiny
    state = make_algo("pfedme", data).init(jax.random.key(0), data)
    uploads = jax.tree_util.tree_map(lambda x: jnp.stack([x, x + 1.0]), state.params)
    w = jnp.array([1, 3])
    one = make_algo("pfedme", data, beta=1.0).aggregate(state.params, uploads, w)
    assert leaves_equal(one, weighted_average(uploads, w))
    assert_close(one, jax.tree_util.tree_map(lambda x: x + 0.75, state.params))
    two = make_algo("pfedme", data, beta=2.0).aggregate(state.params, uploads, w)
    assert_close(two, jax.tree_util.tree_map(lambda x: x + 1.5, state.params))


def test_pfedme_global_model_moves_and_beta_zero_is_rejected(trained):
    _, _, states, _, _ = trained("pfedme")
    assert not leaves_equal(states[1].params, states[0].params)
    with pytest.raises(ValueError, match="freeze"):
        parse_method_args("pfedme", [("beta", "0")])


# ------------------------------------------------------------------------------------------- FedProto
def test_class_prototypes_by_hand():
    feats = jnp.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0], [7.0, 9.0]])
    labels = jnp.array([0, 0, 2, 1])
    valid = jnp.array([True, True, True, False])  # the last row is padding
    protos, counts = fedproto.class_prototypes(feats, labels, valid, 3)
    np.testing.assert_array_equal(counts, [2, 0, 1])
    np.testing.assert_array_equal(protos, [[2.0, 3.0], [0.0, 0.0], [5.0, 6.0]])


def test_client_prototypes_are_masked_class_means(tiny, trained):
    _, part, data = tiny
    algo, _, states, _, _ = trained("fedproto")
    state = states[-1]
    final = jax.jit(algo.client_finish)
    for k in range(data.num_clients):
        ls = algo.client_start(state, data, jnp.int32(k), jax.random.key(0))
        out = final(state, data, jnp.int32(k), ls, jax.random.key(0))
        x, y = gather_inputs(data, jnp.asarray(part.train_idx[k]))
        z, y = np.asarray(algo.model.features(take(state.models, k)["backbone"], x)), np.asarray(y)
        for c in range(data.num_classes):
            if (y == c).any():
                np.testing.assert_allclose(out.aux["protos"][c], z[y == c].mean(0), rtol=1e-5, atol=1e-5)
            else:
                assert float(out.aux["counts"][c]) == 0.0 and not np.any(out.aux["protos"][c])
        np.testing.assert_array_equal(out.aux["counts"], np.bincount(y, minlength=data.num_classes))
        assert np.all(np.isfinite(out.aux["protos"]))
    assert np.all(np.isfinite(state.protos)) and bool(state.has_proto.all())


def test_prototype_aggregation_by_hand(tiny):
    _, _, data = tiny
    old = jnp.full((3, 2), 9.0)
    local = jnp.array([[[1.0, 1.0], [0.0, 0.0], [2.0, 0.0]],
                       [[3.0, 5.0], [0.0, 0.0], [0.0, 0.0]]])      # [S=2, C=3, D=2]
    counts = jnp.array([[1.0, 0.0, 4.0], [3.0, 0.0, 0.0]])         # class 1: nobody; class 2: client 0
    for weighting, c0 in [("count", [2.5, 4.0]), ("uniform", [2.0, 3.0])]:
        algo = make_algo("fedproto", data, proto_weighting=weighting)
        protos, has = algo.aggregate(old, jnp.array([False, True, False]), local, counts)
        np.testing.assert_allclose(protos, [c0, [9.0, 9.0], [2.0, 0.0]])
        np.testing.assert_array_equal(has, [True, True, True])
        assert np.all(np.isfinite(protos))


def test_prototype_head_is_the_nearest_prototype(tiny):
    z = jax.random.normal(jax.random.key(0), (50, 512))
    protos = jax.random.normal(jax.random.key(1), (4, 512))
    has = jnp.array([True, False, True, True])
    head = fedproto.prototype_head(protos, has)
    pred = jnp.argmax(fedproto.prototype_logits(head, z), -1)
    dist = jnp.where(has, jnp.sum((z[:, None] - protos[None]) ** 2, -1), jnp.inf)
    np.testing.assert_array_equal(pred, jnp.argmin(dist, -1))


def test_fedproto_first_round_has_no_prototype_term(tiny):
    """Without global prototypes the local objective is plain cross-entropy (no NaN from missing ones)."""
    _, _, data = tiny
    algo = make_algo("fedproto", data, lam=7.0)
    state = algo.init(jax.random.key(0), data)
    params = take(state.models, 0)
    x, y = gather_inputs(data, data.train_idx[1][:8])
    mask = jnp.ones(8, bool)
    loss = algo.local_loss(params, algo.context(state), x, y, mask, None)
    ce = losses.masked_mean(losses.cross_entropy(algo.model.logits(params, x), y), mask)
    assert float(loss) == pytest.approx(float(ce), rel=1e-6)


# --------------------------------------------------------------------------------------------- FedALA
def test_ala_weights_stay_in_unit_interval_and_lower_layers_are_global(tiny, trained):
    _, _, data = tiny
    _, _, states, _, _ = trained("fedala")
    algo = make_algo("fedala", data, eta=1e4)  # a huge η pushes weights onto the bounds
    start = jax.jit(algo.client_start)
    state = states[2]  # after two rounds: local heads differ from the global head
    for k in (1, 3):  # client 1 ran its start-phase ALA in round 2; client 3 still has the initial model
        ls = start(state, data, jnp.int32(k), jax.random.key(4))
        w = ls.aux["weights"]
        leaves = np.concatenate([np.ravel(x) for x in jax.tree_util.tree_leaves(w)])
        assert leaves.min() >= 0.0 and leaves.max() <= 1.0
        assert (leaves == 0.0).any() and (leaves < 1.0).any()  # learned and clipped
        assert leaves_equal(ls.params["backbone"], state.params["backbone"])
        expected = fedala.mix_heads(take(state.local, k)["head"], state.params["head"], w)
        assert_close(ls.params["head"], expected)
        assert bool(ls.aux["started"])
    # Round 1: every local model is the initial (= global) one, so ALA is skipped.
    ls = start(states[0], data, jnp.int32(2), jax.random.key(1))
    assert leaves_equal(ls.params, states[0].params)
    assert all(np.all(x == 1.0) for x in jax.tree_util.tree_leaves(ls.aux["weights"]))
    assert not bool(ls.aux["started"])


def test_ala_update_by_hand(tiny):
    """∇_W CE = ∇_φ̂ CE ⊙ (φ_g − φ_k), then a step of η clipped to [0, 1]."""
    _, _, data = tiny
    algo = make_algo("fedala", data, eta=2.0)
    local = CNN(4).init(jax.random.key(1), data.input_shape)["head"]
    glob = CNN(4).init(jax.random.key(2), data.input_shape)["head"]
    w = jax.tree_util.tree_map(lambda x: jnp.full(x.shape, 0.5), local)
    z = jax.random.normal(jax.random.key(3), (8, 512))
    y, mask = jnp.array([0, 1, 2, 3, 0, 1, 2, 3]), jnp.ones(8, bool)
    ctx = {"local": local, "global": glob}
    _, new, _ = algo.ala_update(w, None, ctx, z, y, mask, None)
    mixed = fedala.mix_heads(local, glob, w)
    g_head = jax.grad(lambda h: losses.masked_mean(
        losses.cross_entropy(algo.model.logits_from_features(h, z), y), mask))(mixed)
    expected = jax.tree_util.tree_map(lambda wi, g, gl, lo: jnp.clip(wi - 2.0 * g * (gl - lo), 0.0, 1.0),
                                      w, g_head, glob, local)
    assert_close(new, expected)


def test_fedala_server_averages_whole_models(tiny, trained):
    _, _, data = tiny
    _, _, states, _, _ = trained("fedala")
    for r, sel in enumerate(SELECTED):
        uploads = jax.tree_util.tree_map(lambda x: x[sel], states[r + 1].local)
        assert_close(states[r + 1].params, weighted_average(uploads, data.train_n[sel]))
    assert np.array_equal(states[1].started, [False] * 4)       # round 1: ALA skipped everywhere
    assert np.array_equal(states[2].started, [False, True, True, False])


# ---------------------------------------------------------------------------------------------- CLI
# The CLI smoke runs of every method: tests/test_smoke_presets.py


def test_cli_rejects_bad_method_args(capsys):
    rc = cli.main(["run", "--no-progress", "--method", "pfedme", "--method-arg", "beta=0", "--out", "unused"])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith("pfedkdh: error:") and "beta" in err and err.count("\n") == 1
    assert parse_method_args("fedala", [("rand_percent", "50")])["rand_percent"] == 50
    with pytest.raises(ValueError, match="rand_percent"):
        parse_method_args("fedala", [("rand_percent", "0")])


def test_ditto_personal_models_take_the_optimizer_unless_given_their_own(tiny):
    """``personal_optimizer=None`` is ``optimizer`` (the personal models are what Ditto scores): a
    factory of a step-less SGD stops both copies; a personal optimizer of its own moves only v."""
    _, _, data = tiny
    def updates(**hp):
        tx = make_algo("ditto", data, dropout=0.0, optimizer=lambda lr: optax.sgd(0.0), **hp).trainer.tx
        params = {"global": {"w": jnp.ones(3)}, "personal": {"w": jnp.ones(3)}}
        grads = jax.tree_util.tree_map(jnp.ones_like, params)
        return tx.update(grads, tx.init(params), params)[0]
    same = updates()
    assert not np.any(same["global"]["w"]) and not np.any(same["personal"]["w"])
    own = updates(personal_optimizer=optax.sgd(0.1))
    assert not np.any(own["global"]["w"]) and np.allclose(own["personal"]["w"], -0.1)
