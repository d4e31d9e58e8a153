"""pFedSim: the hand checks of method.md §5.1 and its two phases on the tiny federation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms import fedavg, pfedsim
from pfedkdh_jax.engine.client_rows import ClientRows
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.protocol import Algorithm
from pfedkdh_jax.engine.runner import RoundRunner
from pfedkdh_jax.model import CNN

LC = dict(lr=0.05, batch_size=16, local_epochs=1)
SELECTED = [np.array([2, 0]), np.array([1, 3]), np.array([0, 1]), np.array([3, 0])]


def leaves_equal(a, b):
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


def test_mixing_weights_by_hand():
    """W row [self, 0.5, 0, 0.9]: g = −log(1 − w) with the self entry 0.9999 → a = g / Σ g."""
    a = pfedsim.mixing_weights(jnp.array([0.3, 0.5, 0.0, 0.9]), jnp.int32(0))
    np.testing.assert_allclose(a, [0.75457, 0.05679, 0.0, 0.18864], atol=2e-5)
    # no positive off-diagonal entry (and negative ones clipped): the client keeps its own body
    np.testing.assert_allclose(pfedsim.mixing_weights(jnp.array([0.0, -0.4, 0.0]), jnp.int32(1)), [0, 1, 0])
    # collinear classifiers (w = 1) stay finite
    assert np.all(np.isfinite(pfedsim.mixing_weights(jnp.array([1.0, 1.0]), jnp.int32(0))))


def test_classifier_similarity_is_scale_free_and_clamped():
    eye = jnp.eye(2)
    heads = {"out": {"kernel": jnp.stack([eye, jnp.diag(jnp.array([2.0, 5.0])), -eye]),
                     "bias": jnp.array([[9.0, 9.0], [-3.0, 1.0], [0.0, 0.0]])}}   # bias excluded
    w = pfedsim.classifier_similarity(CNN(2), heads, 2)
    assert float(w[0, 1]) == pytest.approx(1.0, abs=1e-6)       # scale-free
    assert float(w[0, 2]) == 0.0 and float(w[1, 2]) == 0.0       # opposite: clamped at 0
    np.testing.assert_allclose(w, w.T)


def test_similarity_update_touches_only_pairs_selected_together():
    w = jnp.full((4, 4), 0.25).at[jnp.diag_indices(4)].set(1.0)
    sim = jnp.array([[1.0, 0.6], [0.6, 1.0]])
    new = np.asarray(pfedsim.update_similarity(w, jnp.array([3, 1]), sim))
    assert new[3, 1] == pytest.approx(0.6) and new[1, 3] == pytest.approx(0.6)
    mask = np.ones((4, 4), bool)
    mask[3, 1] = mask[1, 3] = False
    np.testing.assert_array_equal(new[mask], np.asarray(w)[mask])   # the diagonal and every other pair


def runs(tiny, algo, rounds):
    _, _, data = tiny
    runner = RoundRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=4))
    states = [algo.init(jax.random.key(0), data)]
    for t, sel in enumerate(SELECTED[:rounds]):
        states.append(runner.round(states[-1], data, sel, jax.random.key(100 + t))[0])
    return runner, states


def test_warmup_rounds_equal_fedavg_exactly(tiny):
    _, _, data = tiny
    model = CNN(data.num_classes)
    sim = pfedsim.PFedSim(model, pfedsim.PFedSimConfig(**LC, rounds=4, warmup=0.5))   # R_w = 2

    class StackedFedAvg(fedavg.FedAvg):
        """FedAvg given the stacked uploads, as pFedSim's warm-up averages them (the runner would otherwise
        sum FedAvg's uploads as they come, equal only to float32 rounding)."""
        def server_update(self, *args):
            return Algorithm.server_update(self, *args)
    avg = StackedFedAvg(model, C.LocalConfig(**LC))
    runner, states = runs(tiny, sim, 2)
    avg_runner, avg_states = runs(tiny, avg, 2)
    for s, a in zip(states, avg_states):
        assert leaves_equal(s.params, {"backbone": a.backbone, "head": a.head})
    # scored with the global model during the warm-up: FedAvg's numbers
    m = runner.evaluate(states[1], data, jax.random.key(0))
    m_avg = avg_runner.evaluate(avg_states[1], data, jax.random.key(0))
    for key in ("personalized_macro_accuracy", "personalized_per_client_accuracy"):
        np.testing.assert_array_equal(m[key], m_avg[key])
    # after the last warm-up round every stored model is the global model and W is the identity
    last = states[2]
    for k in range(data.num_clients):
        assert leaves_equal(C.take(last.models, k), last.params)
    np.testing.assert_array_equal(last.similarity, np.eye(data.num_clients))


def test_personalized_rounds(tiny):
    _, _, data = tiny
    algo = pfedsim.PFedSim(CNN(data.num_classes), pfedsim.PFedSimConfig(**LC, rounds=4, warmup=1))  # R_w = 1
    _, states = runs(tiny, algo, 3)
    before, after = states[1], states[2]          # round 2 is the first personalized round: [1, 3]
    # with W = I, a client's download is its own stored model (= the warm-up global model)
    start = jax.jit(algo.client_start)(before, data, jnp.int32(1), jax.random.key(0))
    assert leaves_equal(start.params, C.take(before.models, 1))
    # the selected clients' uploads are stored, the others untouched; W set for the selected pair only
    for k in range(data.num_clients):
        assert leaves_equal(C.take(after.models, k), C.take(before.models, k)) == (k not in (1, 3))
    assert leaves_equal(after.params, before.params)               # the global model no longer moves
    w = np.asarray(after.similarity)
    assert 0.0 <= w[1, 3] == w[3, 1] <= 1.0
    off = ~np.eye(4, dtype=bool)
    off[1, 3] = off[3, 1] = False
    assert not w[off].any() and np.all(np.diag(w) == 1.0)
    # the next download mixes the bodies with the weights of W's row
    third = states[2]
    start = jax.jit(algo.client_start)(third, data, jnp.int32(3), jax.random.key(0))
    a = pfedsim.mixing_weights(third.similarity[3], jnp.int32(3))
    want = jax.tree_util.tree_map(lambda x: jnp.tensordot(a, x, axes=1), third.models["backbone"])
    for x, y in zip(jax.tree_util.tree_leaves(start.params["backbone"]), jax.tree_util.tree_leaves(want)):
        np.testing.assert_allclose(x, y, rtol=1e-6, atol=1e-7)
    assert leaves_equal(start.params["head"], C.take(third.models["head"], 3))   # own classifier


def test_stored_models_in_rows_for_the_clients_trained_since_the_warmup_compute_the_same_run(tiny, monkeypatch):
    """R_w = 1, then rounds of [1, 3], [0, 1], [3, 0]: three rows hold every model stored since the
    warm-up, W over them; the stored models, W, the downloads and the evaluation are the dense run's.
    With two rows, one client finds none and the round says so (rows_lost)."""
    _, _, data = tiny

    def algo(rows):
        return pfedsim.PFedSim(CNN(data.num_classes), pfedsim.PFedSimConfig(**LC, rounds=4, warmup=1,
                                                                           personal_rows=rows))
    dense_runner, dense = runs(tiny, algo(0), 4)
    rows_runner, rows = runs(tiny, algo(3), 4)
    last = rows[-1].models
    assert isinstance(last, ClientRows) and last.capacity == 3 and int(last.lost) == 0
    assert rows[-1].similarity.shape == (3, 3) and rows[-1].downloads is None
    slot = np.asarray(last.slot)
    assert sorted(slot[[0, 1, 3]]) == [0, 1, 2] and slot[2] == -1        # client 2: never trained since R_w
    for t in range(1, 5):
        assert_trees_close(rows[t].params, dense[t].params)
        assert_trees_close(rows[t].models.dense(), dense[t].models)
    w_dense = np.asarray(dense[-1].similarity)
    w_rows = np.asarray(rows[-1].similarity)
    for i in (0, 1, 3):
        for j in (0, 1, 3):
            assert w_rows[slot[i], slot[j]] == pytest.approx(w_dense[i, j], abs=1e-6)
    assert w_dense[2, [0, 1, 3]].max() == 0.0
    # a download mixed by round_start (the runner's) and one mixed by the client itself agree
    ready = rows_runner.round_fn.algo.round_start(rows[-1], data, jnp.array([2, 3]))
    for k in (2, 3):
        got = jax.jit(rows_runner.algo.client_start)(ready, data, jnp.int32(k), jax.random.key(0)).params
        own = jax.jit(dense_runner.algo.client_start)(dense[-1], data, jnp.int32(k), jax.random.key(0)).params
        assert_trees_close(got, own)
    from pfedkdh_jax.engine import runner as runner_module
    monkeypatch.setattr(runner_module, "BASE_PASS_SHARE", 0.1)   # 1 of the 5 owner chunks is client 2's
    m_rows = rows_runner.evaluate(rows[-1], data, jax.random.key(0))
    m_dense = dense_runner.evaluate(dense[-1], data, jax.random.key(0))
    np.testing.assert_array_equal(m_rows["personalized_per_client_accuracy"], m_dense["personalized_per_client_accuracy"])
    assert "base_owned_features" in rows_runner.traces   # client 2's test features: the base's, shared
    # the pure round (one program: round_start, clients vmapped, steps scanned) reads and writes the rows alike
    fused = pfedsim.PFedSim(CNN(data.num_classes), pfedsim.PFedSimConfig(**LC, rounds=4, warmup=1, personal_rows=3))
    fused_runner = RoundRunner(fused, data, Layout("vmap", "scan"))
    state = fused.init(jax.random.key(0), data)
    for t, sel in enumerate(SELECTED):
        state = fused_runner.round(state, data, sel, jax.random.key(100 + t))[0]
    assert "round" in fused_runner.traces
    assert_trees_close(state.models.dense(), dense[-1].models, tol=2e-5)
    # two rows for three clients: the third (client 0, round 3) finds none
    short_runner = RoundRunner(algo(2), data, Layout("sequential", "unrolled", chunk_steps=4))
    state = short_runner.algo.init(jax.random.key(0), data)
    lost = []
    for t, sel in enumerate(SELECTED):
        state, metrics = short_runner.round(state, data, sel, jax.random.key(100 + t))
        lost.append(int(metrics["rows_lost"]))
    assert lost == [0, 0, 1, 2]     # every placement that failed, so far: client 0 in rounds 3 and 4


def test_a_run_keeps_rows_for_the_clients_it_trains_after_the_warmup_when_fewer_than_its_clients():
    from pfedkdh_jax import algorithms
    from pfedkdh_jax.run.config import make_config

    def rows(**kw):
        return algorithms.build(make_config("default", method="pfedsim", **kw), 10).config.personal_rows
    assert rows(num_clients=1000, participation=0.05, rounds=10) == 250      # (10 − 5) × 50
    assert rows(num_clients=20, participation=0.5, rounds=50) == 0           # the paper's setting
    assert rows(num_clients=1000, participation=0.05, rounds=10, method_args=(("personal_rows", "0"),)) == 0


def assert_trees_close(a, b, tol=1e-6):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=tol, atol=tol)


def test_round_start_and_the_rows_view_hand_back_the_leaves_they_pass_through():
    """A compiled call outputs fresh buffers: the runner's round_start and ClientRows view return the
    state's own arrays for what they leave unchanged (the stored models), not copies of them."""
    from pfedkdh_jax.engine.runner import _NewLeaves
    calls = []

    def compiled(name, make, axes):
        calls.append(name)
        return jax.jit(make(None))
    add = _NewLeaves(compiled, "add", lambda a: lambda s, x: {**s, "new": s["big"][:1] * x}, (0, 0))
    state = {"big": jnp.arange(6.0), "small": jnp.ones(2)}
    out = add(state, 2.0)
    assert out["big"] is state["big"] and out["small"] is state["small"]
    np.testing.assert_array_equal(out["new"], [0.0])
    out = add(state, 3.0)   # the second call: the passthrough recorded at the trace
    assert out["big"] is state["big"] and calls == ["add"]


def test_a_runner_that_may_donate_the_state_computes_the_same_rounds_and_frees_what_it_was_given(tiny):
    """donate_state (the CLI's loop): each round's input state is consumed, the server step writing the
    stored models in place; the rounds' values are those of a runner that keeps its inputs."""
    _, _, data = tiny
    algo = pfedsim.PFedSim(CNN(data.num_classes), pfedsim.PFedSimConfig(**LC, rounds=4, warmup=1, personal_rows=3))
    _, kept = runs(tiny, algo, 3)
    runner = RoundRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=4), donate_state=True)
    state = algo.init(jax.random.key(0), data)
    for t, sel in enumerate(SELECTED[:3]):
        given = state
        state = runner.round(given, data, sel, jax.random.key(100 + t))[0]
        if t:   # a fresh init's leaves may share buffers: the runner copies those before donating
            assert given.models.rows["backbone"]["fc"]["kernel"].is_deleted()
    assert_trees_close(state.models.rows, kept[-1].models.rows, tol=0)
    np.testing.assert_array_equal(state.similarity, kept[-1].similarity)
