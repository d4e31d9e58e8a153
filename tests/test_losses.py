"""Loss terms against values computed by hand."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from pfedkdh_jax import losses
from pfedkdh_jax.model import CNN, param_count
from pfedkdh_jax.algorithms.common import weighted_average
from pfedkdh_jax.algorithms.pfedkdh import PFedKDH, PFedKDHConfig


def test_masked_mean_ignores_padding_and_empty_mask():
    v = jnp.array([1.0, 2.0, 3.0, 100.0])
    assert float(losses.masked_mean(v, jnp.array([1, 1, 1, 0]))) == pytest.approx(2.0)
    assert float(losses.masked_mean(v, jnp.zeros(4))) == 0.0


def test_kl_is_teacher_to_student_and_scaled_by_t_squared():
    student = jnp.array([[jnp.log(3.0), 0.0]])
    teacher = jnp.array([[0.0, 0.0]])
    # T = 1: q_t = (1/2, 1/2), q_s = (3/4, 1/4): KL(q_t || q_s) = 1/2 ln(4/3) = 0.143841;
    # the reverse direction KL(q_s || q_t) = 0.130812 must not be what is computed.
    assert float(losses.distillation_kl(student, teacher, 1.0)[0]) == pytest.approx(0.5 * np.log(4 / 3), abs=1e-6)
    # T = 2: logits halved, then T² = 4 times the KL.
    qs = np.array([np.sqrt(3), 1.0]) / (np.sqrt(3) + 1)
    expected = 4.0 * np.sum(0.5 * np.log(0.5 / qs))
    assert float(losses.distillation_kl(student, teacher, 2.0)[0]) == pytest.approx(expected, abs=1e-6)


def test_kl_gives_no_gradient_to_the_teacher():
    g = jax.grad(lambda t: losses.distillation_kl(jnp.array([[1.0, 0.0]]), t, 2.0).sum())(jnp.array([[0.3, 0.1]]))
    assert np.all(np.asarray(g) == 0)


def test_proximal_term():
    p = {"a": jnp.array([1.0, 2.0]), "b": jnp.array([[3.0]])}
    a = {"a": jnp.array([0.0, 0.0]), "b": jnp.array([[1.0]])}
    # mu/2 * (1 + 4 + 4) = 0.05 * 9
    assert float(losses.proximal(p, a, 0.1)) == pytest.approx(0.45)


def test_weighted_average_by_sample_counts():
    trees = {"w": jnp.array([[1.0, 10.0], [3.0, 30.0]])}
    out = weighted_average(trees, jnp.array([1, 3]))
    np.testing.assert_allclose(out["w"], [2.5, 25.0], rtol=1e-6)


def test_local_objective_composition():
    model = CNN(10)
    algo = PFedKDH(model, PFedKDHConfig(lam=0.3, temperature=3.0, mu=0.2))
    k1, k2, k3 = jax.random.split(jax.random.key(0), 3)
    params = model.init(k1, (28, 28, 1))
    glob = model.init(k2, (28, 28, 1))
    ctx = {"backbone": glob["backbone"], "teacher_head": glob["head"]}
    x = jax.random.normal(k3, (5, 28, 28, 1))
    y = jnp.array([0, 1, 2, 3, 4])
    mask = jnp.array([1, 1, 1, 1, 0])
    s = np.asarray(model.logits(params, x))[:4]
    t = np.asarray(model.logits(glob, x))[:4]

    def log_softmax(z):
        z = z - z.max(-1, keepdims=True)
        return z - np.log(np.exp(z).sum(-1, keepdims=True))
    ce = -np.mean(log_softmax(s)[np.arange(4), np.asarray(y)[:4]])
    lt, ls = log_softmax(t / 3.0), log_softmax(s / 3.0)
    kd = np.mean(9.0 * np.sum(np.exp(lt) * (lt - ls), -1))
    sq = sum(float(np.sum((np.asarray(a) - np.asarray(b)) ** 2)) for a, b in
             zip(jax.tree_util.tree_leaves(params["backbone"]), jax.tree_util.tree_leaves(glob["backbone"])))
    expected = 0.7 * ce + 0.3 * kd + 0.1 * sq
    got = float(algo.local_loss(params, ctx, x, y, mask, None))
    assert got == pytest.approx(expected, rel=1e-4)


def test_model_shapes_and_parameter_count():
    model = CNN(10, dropout_rate=0.5)
    params = model.init(jax.random.key(0), (28, 28, 1))
    assert set(params) == {"backbone", "head"}
    # conv1 5*5*1*32+32, conv2 5*5*32*64+64, fc 1024*512+512, head 512*10+10
    assert param_count(params["backbone"]) == 832 + 51264 + 524800
    assert param_count(params["head"]) == 5130
    x = jnp.zeros((3, 28, 28, 1))
    assert model.logits(params, x).shape == (3, 10)
    assert model.features(params["backbone"], x).shape == (3, 512)
    cifar = CNN(100).init(jax.random.key(0), (32, 32, 3))
    assert cifar["backbone"]["fc"]["kernel"].shape == (1600, 512)
    # dropout only with a key
    a = model.features(params["backbone"], jnp.ones((2, 28, 28, 1)), rng=jax.random.key(1))
    b = model.features(params["backbone"], jnp.ones((2, 28, 28, 1)))
    assert not np.allclose(a, b)


@pytest.mark.parametrize("shape", [(2, 8, 8, 3), (1, 7, 9, 2), (3, 2, 4, 6, 5)])
def test_masked_max_pool_matches_flax_max_pool(shape):
    import flax.linen as nn

    from pfedkdh_jax.model import masked_max_pool_2x2 as max_pool_2x2

    # Continuous random values: no ties inside a window, so the gradients agree too.
    x = jax.random.normal(jax.random.key(0), shape)
    ours = max_pool_2x2(x)
    ref = nn.max_pool(x, (2, 2), strides=(2, 2))
    assert ours.shape == ref.shape
    np.testing.assert_array_equal(ours, ref)
    w = jax.random.normal(jax.random.key(1), ref.shape)
    g_ours = jax.grad(lambda v: jnp.sum(max_pool_2x2(v) * w))(x)
    g_ref = jax.grad(lambda v: jnp.sum(nn.max_pool(v, (2, 2), strides=(2, 2)) * w))(x)
    np.testing.assert_array_equal(g_ours, g_ref)
    # each window passes its gradient to exactly one entry
    assert int(jnp.sum(g_ours != 0)) == ref.size
    # under vmap and jit too
    g_vm = jax.jit(jax.vmap(jax.grad(lambda v, u: jnp.sum(max_pool_2x2(v) * u))))(x, w)
    np.testing.assert_allclose(g_vm, g_ours, rtol=0, atol=0)


def test_masked_max_pool_splits_the_gradient_of_tied_entries():
    from pfedkdh_jax.model import masked_max_pool_2x2

    x = jnp.array([[1.0, 1.0], [0.0, 1.0]]).reshape(1, 2, 2, 1)
    g = jax.grad(lambda v: jnp.sum(3.0 * masked_max_pool_2x2(v)))(x)
    np.testing.assert_allclose(g[0, :, :, 0], [[1.0, 1.0], [0.0, 1.0]])


@pytest.mark.parametrize("backend, split", [("cpu", True), ("gpu", False), ("tpu", False)])
def test_backbone_pooling_form_follows_the_backend(monkeypatch, backend, split):
    from pfedkdh_jax import model

    monkeypatch.setattr(model.jax, "default_backend", lambda: backend)
    x = jnp.array([[1.0, 1.0], [0.0, 1.0]]).reshape(1, 2, 2, 1)  # three entries tie for the maximum
    np.testing.assert_array_equal(model.max_pool_2x2(x), [[[[1.0]]]])
    g = np.asarray(jax.grad(lambda v: jnp.sum(3.0 * model.max_pool_2x2(v)))(x))
    if split:  # the masked form: shared between the tied entries
        np.testing.assert_allclose(g[0, :, :, 0], [[1.0, 1.0], [0.0, 1.0]])
    else:  # select_and_scatter: all of it to one of them
        assert sorted(g.ravel().tolist()) == [0.0, 0.0, 0.0, 3.0]


def test_patch_conv_form_has_the_same_parameters_values_and_gradients():
    """The matmul-over-patches convolution: the same parameters as nn.Conv from the same key, the
    same outputs and gradients, also vmapped over per-member weights (where nn.Conv becomes a grouped
    convolution and the patch form a batched matmul)."""
    from pfedkdh_jax.model import CNN, patch_matmul_conv

    x = jax.random.normal(jax.random.key(1), (3, 16, 16, 3))   # the smallest input the CNN takes
    k = jax.random.normal(jax.random.key(2), (5, 5, 3, 4))
    want = jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"))
    np.testing.assert_allclose(patch_matmul_conv(x, k), want, rtol=1e-4, atol=1e-4)
    lax_model, patch_model = CNN(10, conv_form="lax"), CNN(10, conv_form="patches")
    p = lax_model.init(jax.random.key(0), (16, 16, 3))
    q = patch_model.init(jax.random.key(0), (16, 16, 3))
    assert jax.tree_util.tree_structure(p) == jax.tree_util.tree_structure(q)
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)):
        np.testing.assert_array_equal(a, b)
    y = jnp.arange(3) % 10

    def loss(model):
        return lambda params, xb: jnp.mean(optax.softmax_cross_entropy_with_integer_labels(model.logits(params, xb), y))
    members = jax.tree_util.tree_map(lambda a: jnp.stack([a, 1.1 * a]), p)   # per-member weights [2, ...]
    xs = jnp.stack([x, -x])
    for form in (lambda f: f, jax.vmap):
        args = (p, x) if form is not jax.vmap else (members, xs)
        (la, ga), (lb, gb) = (jax.jit(form(jax.value_and_grad(loss(m))))(*args) for m in (lax_model, patch_model))
        np.testing.assert_allclose(la, lb, rtol=1e-5)
        for a, b in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
            np.testing.assert_allclose(a, b, rtol=2e-4, atol=2e-5)
    with pytest.raises(ValueError, match="conv_form"):
        CNN(10, conv_form="fft")


@pytest.mark.parametrize("backend, custom", [("cpu", True), ("gpu", False)])
def test_col2im_conv_gradient_matches_xla_and_follows_the_backend(monkeypatch, backend, custom):
    """The CPU convolution's input gradient (a matmul and col2im): XLA's values and kernel gradient to
    float32 rounding, plainly and vmapped over per-member weights; used by the backbone's ``lax``
    form on CPU only, and only in the backbone's case (another stride goes to XLA's convolution)."""
    from pfedkdh_jax import model

    monkeypatch.setattr(model.jax, "default_backend", lambda: backend)
    x = jax.random.normal(jax.random.key(1), (3, 12, 12, 4))
    k = jax.random.normal(jax.random.key(2), (5, 5, 4, 6))
    w = jax.random.normal(jax.random.key(3), (3, 8, 8, 6))
    dn = ("NHWC", "HWIO", "NHWC")

    def xla(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=dn)
    want = jax.grad(lambda x, k: jnp.sum(xla(x, k) * w), argnums=(0, 1))(x, k)
    got = jax.grad(lambda x, k: jnp.sum(model.col2im_grad_conv(x, k) * w), argnums=(0, 1))(x, k)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
    ks, ws = jnp.stack([k, -k]), jnp.stack([w, 2 * w])
    vm = jax.jit(jax.vmap(jax.grad(lambda k, w: jnp.sum(model.col2im_grad_conv(x, k) * w)), in_axes=(0, 0)))(ks, ws)
    ref = jax.vmap(jax.grad(lambda k, w: jnp.sum(xla(x, k) * w)))(ks, ws)
    np.testing.assert_allclose(vm, ref, rtol=1e-4, atol=1e-4)
    # the backbone's convolutions go through it on CPU only; a strided call never does
    cnn = model.CNN(10, conv_form="lax")
    p = cnn.init(jax.random.key(0), (16, 16, 3))
    jaxpr = str(jax.make_jaxpr(lambda p: cnn.logits(p, jnp.ones((2, 16, 16, 3))))(p))
    pools = 2 if backend == "cpu" else 0   # the pooling's custom gradient is per backend too
    assert jaxpr.count("custom_vjp_call") == pools + (2 if custom else 0)
    strided = lambda x: model.cpu_conv_general_dilated(x, k, (2, 2), "VALID", dimension_numbers=model._NHWC)  # noqa: E731
    assert "custom_vjp_call" not in str(jax.make_jaxpr(strided)(x))


def test_winograd_matrices_are_exact():
    """Aᵀ((G g) ⊙ (Bᵀ d)) is the correlation of d with g, exactly (in fractions), for the backbone's
    F(4, 5) and two other sizes."""
    from fractions import Fraction

    from pfedkdh_jax.model import winograd_matrices

    rng = np.random.default_rng(0)
    for m, r in ((4, 5), (2, 5), (2, 3)):
        at, g, bt = winograd_matrices(m, r)
        n = m + r - 1
        d = [Fraction(int(v)) for v in rng.integers(-9, 10, n)]
        k = [Fraction(int(v)) for v in rng.integers(-9, 10, r)]
        gk = [sum(g[t][j] * k[j] for j in range(r)) for t in range(n)]
        bd = [sum(bt[t][l] * d[l] for l in range(n)) for t in range(n)]
        y = [sum(at[i][t] * gk[t] * bd[t] for t in range(n)) for i in range(m)]
        assert y == [sum(d[i + j] * k[j] for j in range(r)) for i in range(m)]


def test_winograd_conv_matches_xla_values_and_gradients():
    """F(4×4, 5×5): XLA's convolution's values, input gradient and kernel gradient to float32 rounding, on
    an output side that is a multiple of 4 (MNIST's conv2, 8×8) and one that is not (CIFAR-10's, 10×10),
    plainly and vmapped over per-member kernels."""
    from pfedkdh_jax.model import winograd_conv

    dn = ("NHWC", "HWIO", "NHWC")

    def xla(x, k):
        return jax.lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=dn,
                                            precision=jax.lax.Precision.HIGHEST)
    for side in (12, 14):
        x = jax.random.normal(jax.random.key(1), (3, side, side, 16))
        k = 0.05 * jax.random.normal(jax.random.key(2), (5, 5, 16, 8))
        w = jax.random.normal(jax.random.key(3), (3, side - 4, side - 4, 8))
        np.testing.assert_allclose(winograd_conv(x, k), xla(x, k), rtol=1e-4, atol=2e-5)
        want = jax.grad(lambda x, k: jnp.sum(xla(x, k) * w), argnums=(0, 1))(x, k)
        got = jax.jit(jax.grad(lambda x, k: jnp.sum(winograd_conv(x, k) * w), argnums=(0, 1)))(x, k)
        for a, b in zip(got, want):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(b))))
        ks, ws = jnp.stack([k, -k]), jnp.stack([w, 2 * w])
        vm = jax.jit(jax.vmap(jax.grad(lambda k, w: jnp.sum(winograd_conv(x, k) * w))))(ks, ws)
        ref = jax.vmap(jax.grad(lambda k, w: jnp.sum(xla(x, k) * w)))(ks, ws)
        np.testing.assert_allclose(vm, ref, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(ref))))


@pytest.mark.parametrize("backend, form", [("cpu", "winograd"), ("gpu", "lax")])
def test_winograd_form_takes_conv2_at_training_batches_only(monkeypatch, measured_conv_form, backend, form):
    """The ``winograd`` form: the same parameters and, to float32 rounding, the same logits and gradients as
    XLA's convolution; conv2 only (conv1's 1 or 3 channels stay XLA's), and only up to
    ``WINOGRAD_MAX_BATCH`` samples (evaluation's chunks stay XLA's); ``auto`` is it on a CPU only."""
    from pfedkdh_jax import model

    monkeypatch.setattr(model.jax, "default_backend", lambda: backend)
    assert model.auto_conv_form() == form
    wino, lax_model = model.CNN(10, conv_form="winograd"), model.CNN(10, conv_form="lax")
    p = lax_model.init(jax.random.key(0), (16, 16, 3))
    q = wino.init(jax.random.key(0), (16, 16, 3))
    for a, b in zip(jax.tree_util.tree_leaves(p), jax.tree_util.tree_leaves(q)):
        np.testing.assert_array_equal(a, b)
    x = jax.random.normal(jax.random.key(1), (4, 16, 16, 3))
    loss = lambda m: lambda params: jnp.sum(m.logits(params, x) ** 2)  # noqa: E731
    (la, ga), (lb, gb) = (jax.value_and_grad(loss(m))(p) for m in (lax_model, wino))
    np.testing.assert_allclose(lb, la, rtol=1e-5)
    for a, b in zip(jax.tree_util.tree_leaves(ga), jax.tree_util.tree_leaves(gb)):
        np.testing.assert_allclose(b, a, rtol=1e-4, atol=1e-4 * float(jnp.max(jnp.abs(a))))

    def convolutions(batch):
        return str(jax.make_jaxpr(lambda p: wino.logits(p, jnp.ones((batch, 16, 16, 3))))(p)).count("conv_general_dilated")
    assert convolutions(4) == 1                                 # conv1 only
    assert convolutions(model.WINOGRAD_MAX_BATCH + 1) == 2      # both XLA's


def test_a_run_resolves_auto_conv_form_by_backend_and_step_loop(monkeypatch, measured_conv_form):
    """``--conv-form auto`` on a CPU: Winograd, but the matmul over patches where local steps are scanned
    (a convolution inside a loop is slow on XLA:CPU); XLA's elsewhere; a chosen form is kept."""
    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.run import experiment
    from pfedkdh_jax.run.config import make_config

    cfg = make_config("smoke")
    assert experiment.resolved_conv_form(cfg, Layout("sequential", "unrolled")) == "winograd"
    assert experiment.resolved_conv_form(cfg, Layout("vmap", "unrolled")) == "winograd"
    assert experiment.resolved_conv_form(cfg, Layout("vmap", "scan")) == "patches"
    assert experiment.resolved_conv_form(make_config("smoke", conv_form="lax"), Layout("vmap", "scan")) == "lax"
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    assert experiment.resolved_conv_form(cfg, Layout("vmap", "scan")) == "lax"
    assert experiment.resolved_conv_form(cfg, Layout("sequential", "unrolled")) == "lax"
