"""pFedKDH's teacher-to-client transfer forms: class-aware targets and per-sample trust gates."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax import losses
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.model import CNN
from pfedkdh_jax.algorithms.pfedkdh import PFedKDH, PFedKDHConfig, client_labels
from pfedkdh_jax.engine.runner import RoundRunner

LN43 = 0.5 * np.log(4 / 3)  # KL((1/2, 1/2) ‖ (3/4, 1/4))


def test_restricted_kl_ignores_classes_off_the_support():
    support = jnp.array([True, True, False])
    student = jnp.array([[np.log(3.0), 0.0, 7.0]])
    teacher = jnp.array([[0.0, 0.0, 5.0]])
    assert float(losses.restricted_distillation_kl(student, teacher, 1.0, support)[0]) == pytest.approx(LN43, abs=1e-6)
    # the plain KL sees the teacher's mass on class 2 and differs
    assert abs(float(losses.distillation_kl(student, teacher, 1.0)[0]) - LN43) > 0.1
    # no gradient reaches the student's logit of an absent class
    g = jax.grad(lambda s: losses.restricted_distillation_kl(s, teacher, 2.0, support).sum())(student)
    assert float(g[0, 2]) == 0.0 and np.all(np.isfinite(np.asarray(g)))
    # a one-class support leaves nothing to distil
    one = jnp.array([False, True, False])
    assert float(losses.restricted_distillation_kl(student, teacher, 1.0, one)[0]) == pytest.approx(0.0, abs=1e-7)


def test_prior_adjusted_teacher_is_the_bayes_correction():
    support = jnp.array([True, True, False])
    adjusted = losses.prior_adjusted_logits(jnp.zeros((1, 3)), jnp.array([np.log(2.0), 0.0, 0.0]), support)
    np.testing.assert_allclose(jax.nn.softmax(adjusted)[0], [2 / 3, 1 / 3, 0.0], atol=1e-6)


def _transfer(target, gate, student, teacher, y, labels=None, lam=0.5):
    algo = PFedKDH(CNN(3), PFedKDHConfig(lam=lam, temperature=1.0, kd_target=target, kd_gate=gate))
    return algo.transfer(jnp.asarray(student), jnp.asarray(teacher), jnp.asarray(y), labels)


def test_gates():
    # sample 0: the teacher is right and surer of the truth than the student; sample 1: the teacher is
    # wrong; sample 2: right, but less sure than the student
    student = np.log(np.array([[0.4, 0.3, 0.3], [0.2, 0.6, 0.2], [0.9, 0.05, 0.05]]))
    teacher = np.log(np.array([[0.7, 0.2, 0.1], [0.1, 0.1, 0.8], [0.6, 0.2, 0.2]]))
    y = [0, 1, 0]
    _, none = _transfer("plain", "none", student, teacher, y)
    _, conf = _transfer("plain", "confidence", student, teacher, y)
    _, correct = _transfer("plain", "correct", student, teacher, y)
    _, better = _transfer("plain", "better", student, teacher, y)
    np.testing.assert_allclose(none, [1, 1, 1])
    np.testing.assert_allclose(conf, [0.7, 0.1, 0.6], atol=1e-6)
    np.testing.assert_allclose(correct, [1, 0, 1])
    np.testing.assert_allclose(better, [1, 0, 0])


def test_adaptive_gate_is_one_batch_weight_that_falls_as_the_student_overtakes_the_teacher():
    # true-class probabilities: teacher 0.8, 0.6 (mean 0.7); student 0.4, 0.2 (mean 0.3): the teacher's
    # margin 0.4 weights every sample
    teacher = np.log(np.array([[0.8, 0.1, 0.1], [0.2, 0.6, 0.2]]))
    student = np.log(np.array([[0.4, 0.3, 0.3], [0.4, 0.2, 0.4]]))
    y = [0, 1]
    _, trust = _transfer("plain", "adaptive", student, teacher, y)
    np.testing.assert_allclose(trust, [0.4, 0.4], atol=1e-6)
    # a student better on average than the teacher gets no distillation, even where the teacher is
    # better on a sample (the per-sample "better" gate would distil that one)
    _, trust = _transfer("plain", "adaptive", teacher, student, y)
    np.testing.assert_allclose(trust, [0, 0])
    student2 = np.log(np.array([[0.9, 0.05, 0.05], [0.3, 0.5, 0.2]]))   # 0.9 > 0.8 but 0.5 < 0.6
    _, trust = _transfer("plain", "adaptive", student2, teacher, y)
    np.testing.assert_allclose(trust, [0, 0], atol=1e-6)   # mean 0.7 = 0.7: no margin
    _, better = _transfer("plain", "better", student2, teacher, y)
    np.testing.assert_allclose(better, [0, 1])
    # near-perfect models give a near-zero weight (a tiny margin, not a ratio of tiny gaps)
    sure_t = np.log(np.array([[0.999, 0.0005, 0.0005], [0.0005, 0.999, 0.0005]]))
    sure_s = np.log(np.array([[0.99, 0.005, 0.005], [0.005, 0.99, 0.005]]))
    _, trust = _transfer("plain", "adaptive", sure_s, sure_t, y)
    np.testing.assert_allclose(trust, [0.009, 0.009], atol=1e-5)
    # padded samples do not count: with the second sample masked, the means are 0.8 vs 0.4 → 0.4
    algo = PFedKDH(CNN(3), PFedKDHConfig(lam=0.5, temperature=1.0, kd_gate="adaptive"))
    student3 = np.log(np.array([[0.4, 0.3, 0.3], [0.1, 0.8, 0.1]]))
    _, trust = algo.transfer(jnp.asarray(student3), jnp.asarray(teacher), jnp.asarray(y), None,
                             jnp.array([1.0, 0.0]))
    np.testing.assert_allclose(trust, [0.4, 0.4], atol=1e-6)
    # no gradient flows through the weight
    g = jax.grad(lambda s: _transfer("plain", "adaptive", s, teacher, y)[1].sum())(jnp.asarray(student))
    np.testing.assert_array_equal(np.asarray(g), 0.0)


def test_gated_sample_keeps_its_full_cross_entropy():
    """With λ_i = 0 a sample's loss is its CE alone (not (1 − λ)·CE): the local loss of a batch the
    teacher gets wrong equals the plain CE."""
    model = CNN(3)
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = model.init(k1, (28, 28, 1))
    glob = model.init(k2, (28, 28, 1))
    x = jax.random.normal(k3, (6, 28, 28, 1))
    ctx = {"backbone": glob["backbone"], "teacher_head": glob["head"]}
    teacher_pred = jnp.argmax(model.logits(glob, x), -1)
    y = (teacher_pred + 1) % 3  # the teacher is wrong on every sample
    mask = jnp.ones(6)
    gated = PFedKDH(model, PFedKDHConfig(lam=0.5, mu=0.0, kd_gate="correct"))
    ce = losses.masked_mean(losses.cross_entropy(model.logits(params, x), y), mask)
    assert float(gated.local_loss(params, ctx, x, y, mask, None)) == pytest.approx(float(ce), rel=1e-6)
    plain = PFedKDH(model, PFedKDHConfig(lam=0.5, mu=0.0))
    assert abs(float(plain.local_loss(params, ctx, x, y, mask, None)) - float(ce)) > 1e-3


def test_client_labels_are_the_train_split_support(tiny):
    _, part, data = tiny
    pool_labels = np.asarray(data.labels)
    for k in range(data.num_clients):
        got = client_labels(data, jnp.int32(k))
        counts = np.bincount(pool_labels[part.train_idx[k]], minlength=data.num_classes)
        np.testing.assert_array_equal(np.asarray(got["support"]), counts > 0)
        aux = np.bincount(pool_labels[part.aux_idx], minlength=data.num_classes) + 1.0
        want = np.where(counts > 0, np.log(np.maximum(counts, 1) / counts.sum()) - np.log(aux / aux.sum()), 0.0)
        np.testing.assert_allclose(np.asarray(got["log_prior_ratio"]), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("target,gate", [("support", "better"), ("prior", "confidence")])
def test_class_aware_rounds_agree_across_layouts(tiny, target, gate, monkeypatch):
    # On CPU, local training hands YNNPACK the sequential form's plain dots but not the vmapped form's
    # batched ones, so the two round differently, and a per-sample gate ("better") can flip on that
    # rounding; the layouts' logic is compared under one arithmetic (YNNPACK off in training).
    from pfedkdh_jax.engine import runner as runner_module
    monkeypatch.setattr(runner_module, "local_training_compiler_options",
                        lambda backend=None: {"xla_cpu_experimental_ynn_fusion_type": ""}
                        if jax.default_backend() == "cpu" else None)
    _, _, data = tiny
    hp = PFedKDHConfig(lr=0.05, batch_size=8, local_epochs=1, lam=0.5, temperature=2.0, mu=0.01,
                       teacher_epochs=1, kd_target=target, kd_gate=gate)
    algo = PFedKDH(CNN(data.num_classes), hp)
    finals = []
    for form in [("sequential", "unrolled"), ("vmap", "scan")]:
        runner = RoundRunner(algo, data, Layout(*form, chunk_steps=1))
        state = algo.init(jax.random.key(0), data)
        for r, sel in enumerate([np.array([2, 0]), np.array([1, 3]), np.array([0, 1])]):
            state, m = runner.round(state, data, sel, jax.random.key(10 + r))
        assert all(v == 1 for v in runner.traces.values()), runner.traces
        finals.append(state)
    for a, b in zip(jax.tree_util.tree_leaves(finals[0]), jax.tree_util.tree_leaves(finals[1])):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)
    # the class-aware round differs from the paper's form under the same keys
    plain = PFedKDH(CNN(data.num_classes), PFedKDHConfig(**{**hp.__dict__, "kd_target": "plain", "kd_gate": "none"}))
    runner = RoundRunner(plain, data, Layout("sequential", "unrolled", chunk_steps=1))
    state = plain.init(jax.random.key(0), data)
    for r, sel in enumerate([np.array([2, 0]), np.array([1, 3]), np.array([0, 1])]):
        state, _ = runner.round(state, data, sel, jax.random.key(10 + r))
    assert not np.allclose(np.asarray(state.backbone["fc"]["kernel"]), np.asarray(finals[0].backbone["fc"]["kernel"]))


def test_bad_forms_are_rejected():
    with pytest.raises(ValueError, match="kd_target"):
        PFedKDHConfig(kd_target="nope")
    with pytest.raises(ValueError, match="kd_gate"):
        PFedKDHConfig(kd_gate="nope")
