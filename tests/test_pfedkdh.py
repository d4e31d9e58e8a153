"""pFedKDH's round on a tiny federation: persistence, aggregation, refit, engine forms, tracing."""

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.protocol import ClientUpdate
from pfedkdh_jax.model import CNN
from pfedkdh_jax.algorithms.pfedkdh import PFedKDH, PFedKDHConfig
from pfedkdh_jax.engine.runner import RoundRunner, sample_schedule

HP = PFedKDHConfig(lr=0.05, batch_size=8, local_epochs=1, lam=0.5, temperature=2.0, mu=0.01,
                   teacher_epochs=1, ea_steps=3)
FORMS = [("sequential", "unrolled"), ("sequential", "scan"), ("vmap", "unrolled"), ("vmap", "scan")]
SELECTED = [np.array([2, 0]), np.array([1, 2]), np.array([3, 1])]


def make(tiny, client_parallel="sequential", step_loop="unrolled", hp=HP, dropout=0.2):
    _, _, data = tiny
    algo = PFedKDH(CNN(data.num_classes, dropout), hp)
    runner = RoundRunner(algo, data, Layout(client_parallel, step_loop, chunk_steps=4))
    return algo, runner, algo.init(jax.random.key(0), data)


def leaves_equal(a, b):
    """Same tree structure and bit-identical leaves."""
    if jax.tree_util.tree_structure(a) != jax.tree_util.tree_structure(b):
        return False
    return all(np.array_equal(x, y) for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)))


@pytest.fixture(scope="module")
def trained(tiny):
    """Three rounds with the CPU default form, keeping every intermediate state."""
    _, _, data = tiny
    algo, runner, state = make(tiny)
    states, metrics = [state], []
    for r, sel in enumerate(SELECTED):
        state, m = runner.round(state, data, sel, jax.random.key(100 + r))
        states.append(state)
        metrics.append(m)
    return algo, runner, states, metrics


def test_state_axes(tiny, trained):
    _, _, data = tiny
    _, _, states, _ = trained
    chex.assert_tree_shape_prefix(states[-1].heads, (data.num_clients,))
    assert int(states[-1].round) == 3


def test_unselected_heads_are_bit_identical(trained):
    _, _, states, _ = trained
    for r, sel in enumerate(SELECTED):
        before, after = states[r].heads, states[r + 1].heads
        for k in range(4):
            same = leaves_equal(jax.tree_util.tree_map(lambda h: h[k], before),
                                jax.tree_util.tree_map(lambda h: h[k], after))
            assert same == (k not in sel), (r, k)


def server_step(algo, state, backbones, selected, data, key):
    """The server step (``server_update``, the runner's path) on the selected clients' uploaded
    ``backbones`` ``[C, ...]``, their heads as the state holds them: (θ_g, φ_g, teacher loss)."""
    sel = jnp.asarray(selected)
    heads = jax.tree_util.tree_map(lambda h: h[sel], state.heads)
    updates = ClientUpdate(params={"backbone": backbones, "head": heads}, loss=jnp.zeros(len(selected)))
    new, metrics = algo.server_update(state, data, sel, updates, key)
    return new.backbone, new.teacher_head, metrics["teacher_loss"]


def test_selected_heads_stay_with_their_client(tiny, trained):
    """The server step's θ_g and φ_g read only the uploaded backbones: client heads cannot influence them."""
    _, _, data = tiny
    algo, _, states, _ = trained
    state = states[1]
    uploads = jax.tree_util.tree_map(lambda x: jnp.stack([x, 0.5 * x]), state.backbone)
    key = jax.random.key(7)
    a = server_step(algo, state, uploads, [0, 2], data, key)
    scrambled = state.replace(heads=jax.tree_util.tree_map(lambda h: h * -3.0 + 1.0, state.heads))
    b = server_step(algo, scrambled, uploads, [0, 2], data, key)
    assert leaves_equal(a, b)


def test_backbone_is_weighted_average_and_refit_touches_only_the_head(tiny):
    _, _, data = tiny
    algo, _, state = make(tiny)
    uploads = jax.tree_util.tree_map(lambda x: jnp.stack([x, x + 1.0]), state.backbone)
    n0, n1 = (float(data.train_n[k]) for k in (0, 1))
    backbone, head, loss = server_step(algo, state, uploads, [0, 1], data, jax.random.key(1))
    expected = jax.tree_util.tree_map(lambda x: x + n1 / (n0 + n1), state.backbone)   # weighted by n_k
    for got, want in zip(jax.tree_util.tree_leaves(backbone), jax.tree_util.tree_leaves(expected)):
        np.testing.assert_allclose(got, want, rtol=1e-6, atol=1e-6)
    assert not leaves_equal(head, state.teacher_head)
    assert np.isfinite(float(loss))
    # the refit is head-only SGD over features of the frozen backbone: zero epochs = unchanged head
    no_refit = PFedKDH(algo.model, PFedKDHConfig(**{**HP.__dict__, "teacher_epochs": 0}))
    _, head0, _ = server_step(no_refit, state, uploads, [0, 1], data, jax.random.key(1))
    assert leaves_equal(head0, state.teacher_head)


def test_refit_lowers_the_teacher_loss_on_ds(tiny):
    _, _, data = tiny
    algo, _, state = make(tiny)
    hp = PFedKDHConfig(**{**HP.__dict__, "teacher_epochs": 20})
    long = PFedKDH(algo.model, hp)
    x = data.images[data.aux_idx]
    head, _ = long.refit_teacher(state.backbone, state.teacher_head, data, jax.random.key(0))

    def ce(h):
        from pfedkdh_jax.data.device import gather_inputs
        xs, ys = gather_inputs(data, data.aux_idx)
        logits = algo.model.logits({"backbone": state.backbone, "head": h}, xs)
        return float(jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), ys[:, None], 1)))
    assert x.shape[0] == 40
    assert ce(head) < ce(state.teacher_head) - 0.05


@pytest.mark.parametrize("form", FORMS[1:])
def test_engine_forms_compute_the_same_numbers(tiny, trained, form):
    _, _, data = tiny
    _, _, states, metrics = trained
    _, runner, state = make(tiny, *form)
    for r, sel in enumerate(SELECTED):
        state, m = runner.round(state, data, sel, jax.random.key(100 + r))
    for got, want in zip(jax.tree_util.tree_leaves(state), jax.tree_util.tree_leaves(states[-1])):
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(m["train_loss"], metrics[-1]["train_loss"], rtol=1e-5)
    # nothing recompiles after the first round
    assert runner.traces and all(v == 1 for v in runner.traces.values()), runner.traces


def test_no_recompilation_after_first_round(tiny, trained):
    _, _, data = tiny
    _, runner, states, _ = trained
    before = dict(runner.traces)
    state = states[-1]
    for r in range(2):
        state, _ = runner.round(state, data, np.array([r, 3]), jax.random.key(r))
        runner.evaluate(state, data, jax.random.key(r), personalize=True)
    after_first_eval = dict(runner.traces)
    for r in range(2):
        state, _ = runner.round(state, data, np.array([0, 2]), jax.random.key(9 + r))
        runner.evaluate(state, data, jax.random.key(r), personalize=True)
    assert dict(runner.traces) == after_first_eval
    assert all(before[k] == after_first_eval[k] for k in before)


def test_local_steps_visit_every_sample_once_per_epoch(tiny):
    _, _, data = tiny
    algo, _, state = make(tiny, hp=PFedKDHConfig(**{**HP.__dict__, "local_epochs": 3}))
    ls = algo.client_start(state, data, jnp.int32(1), jax.random.key(0))
    n = int(data.train_n[1])
    assert ls.perms.shape == (3, data.max_train)
    for e in range(3):
        assert sorted(np.asarray(ls.perms[e, :n]).tolist()) == list(range(n))
    assert int(algo.trainer.num_steps(n)) == 3 * -(-n // 8)


def test_ea_does_not_change_persistent_heads(tiny, trained):
    _, _, data = tiny
    _, runner, states, _ = trained
    state = states[-1]
    fair = runner.evaluate(state, data, jax.random.key(0))
    ea = runner.evaluate(state, data, jax.random.key(0), personalize=True)
    assert "personalized_macro_accuracy_ea" in ea
    np.testing.assert_array_equal(fair["personalized_per_client_accuracy"], ea["personalized_per_client_accuracy"])
    # a round after an EA evaluation is the same as a round without one
    a, _ = runner.round(state, data, np.array([0, 1]), jax.random.key(5))
    runner.evaluate(state, data, jax.random.key(1), personalize=True)
    b, _ = runner.round(state, data, np.array([0, 1]), jax.random.key(5))
    assert leaves_equal(a, b)


def test_evaluation_counts_every_test_sample_of_every_client(tiny, trained):
    _, part, data = tiny
    _, runner, states, _ = trained
    m = runner.evaluate(states[-1], data, jax.random.key(0))
    per = np.asarray(m["personalized_per_client_accuracy"])
    assert per.shape == (4,)
    sizes = np.array([len(t) for t in part.test_idx])
    # micro = test-size-weighted mean of the per-client accuracies; macro = their plain mean
    assert float(m["personalized_micro_accuracy"]) == pytest.approx(float(np.sum(per * sizes) / sizes.sum()), abs=1e-6)
    assert float(m["personalized_macro_accuracy"]) == pytest.approx(float(per.mean()), abs=1e-6)


def test_training_learns_the_tiny_task(tiny):
    _, _, data = tiny
    _, runner, state = make(tiny, dropout=0.0)
    before = runner.evaluate(state, data, jax.random.key(0))
    for r, sel in enumerate(sample_schedule(jax.random.key(3), 6, 4, 2)):
        state, _ = runner.round(state, data, sel, jax.random.key(r))
    after = runner.evaluate(state, data, jax.random.key(0))
    assert float(after["personalized_macro_accuracy"]) > max(0.8, float(before["personalized_macro_accuracy"]) + 0.2)


def test_sampling_schedule():
    s = sample_schedule(jax.random.key(0), 50, 20, 10)
    assert s.shape == (50, 10)
    assert all(len(set(row)) == 10 for row in s)
    assert s.min() >= 0 and s.max() < 20
    assert np.array_equal(s, sample_schedule(jax.random.key(0), 50, 20, 10))


def test_average_heads_ablation_gives_every_client_the_weighted_mean_head(tiny):
    """--average-heads: the selected clients' trained heads are averaged (n_k) and replace every head."""
    _, _, data = tiny
    algo, runner, state = make(tiny, hp=PFedKDHConfig(**{**HP.__dict__, "persistent_heads": False}))
    sel = np.array([2, 0])
    new, _ = runner.round(state, data, sel, jax.random.key(100))
    # the same round with persistent heads trains the same heads (the first round starts from φ⁰ for all)
    persistent, runner_p, _ = make(tiny)
    kept, _ = runner_p.round(state, data, sel, jax.random.key(100))
    n = np.asarray(data.train_n)[sel].astype(np.float64)
    for got, trained in zip(jax.tree_util.tree_leaves(new.heads), jax.tree_util.tree_leaves(kept.heads)):
        want = np.tensordot(n / n.sum(), np.asarray(trained)[sel], axes=1)
        for k in range(data.num_clients):
            np.testing.assert_allclose(np.asarray(got)[k], want, rtol=1e-5, atol=1e-6)
