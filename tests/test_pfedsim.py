"""pFedSim: the hand checks of method.md §5.1 and its two phases on the tiny federation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.algorithms import fedavg, pfedsim
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
