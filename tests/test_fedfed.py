"""FedFed: the hand checks of method.md §5.2, the pool, what a client trains on, and its two phases."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax.algorithms import fedfed
from pfedkdh_jax.algorithms.vae import VAE, UpConv, kl_term, latent_size, reconstruction
from pfedkdh_jax.data.device import gather_inputs
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.runner import PhasedRunner
from pfedkdh_jax.model import CNN, param_count

CFG = fedfed.FedFedConfig(lr=0.05, batch_size=16, local_epochs=1, feature_rounds=2, vae_batch_size=16,
                          vae_width=8)  # a narrow VAE keeps the tests quick; test_vae_shapes_and_size checks the full one
SELECTED = [np.array([2, 0]), np.array([1, 3]), np.array([0, 1]), np.array([3, 2])]


def make(data):
    return fedfed.FedFed(CNN(data.num_classes), CFG)


def test_noise_statistics_with_a_stub_reconstruction():
    """x_r ≡ 0.5: s1 − (x − 0.5) has mean ≈ 0 and std ≈ 0.15 (s2: 0.25)."""
    x01 = jax.random.uniform(jax.random.key(0), (64, 28, 28, 1))
    s1, s2 = fedfed.noisy_copies(x01 - 0.5, jax.random.key(1), (0.15, 0.25))
    for s, std in ((s1, 0.15), (s2, 0.25)):
        d = np.asarray(s - (x01 - 0.5))
        assert abs(d.mean()) < 2e-3 and d.std() == pytest.approx(std, rel=0.01)
    assert not np.allclose(s1, s2)


def test_normalised_kl_and_reconstruction_by_hand():
    assert float(kl_term(jnp.ones((32, 1568)), jnp.zeros((32, 1568)), jnp.ones(32))) == pytest.approx(0.08333, abs=1e-5)
    # padded samples do not count
    mask = jnp.array([1.0] * 32 + [0.0] * 8)
    assert float(kl_term(jnp.ones((40, 1568)), jnp.zeros((40, 1568)), mask)) == pytest.approx(0.08333, abs=1e-5)
    x = jnp.zeros((2, 4, 4, 1))
    assert float(reconstruction(x + 0.5, x, jnp.array([1.0, 0.0]))) == pytest.approx(0.25)


def test_vae_shapes_and_size():
    assert latent_size((28, 28, 1)) == 1568 and latent_size((32, 32, 3)) == 2048
    v = jax.jit(VAE(1).init)(jax.random.key(0), jnp.zeros((1, 28, 28, 1)))
    (x_r, mean, _) = jax.jit(VAE(1).apply)(v, jnp.zeros((3, 28, 28, 1)))
    assert x_r.shape == (3, 28, 28, 1) and mean.shape == (3, 1568)
    assert float(x_r.min()) >= 0.0 and float(x_r.max()) <= 1.0          # a sigmoid output
    cnn = jax.eval_shape(lambda k: CNN(10).init(k, (28, 28, 1)), jax.random.key(0))
    ratio = param_count(v["params"]) / param_count(cnn)
    assert 12 < ratio < 14                                               # ≈ 13× the CNN


@pytest.mark.parametrize("channels,features,side", [(4, 3, 5), (3, 1, 4)])
def test_upconv_is_flax_conv_transpose(channels, features, side):
    """The decoder's form: flax's stride-2 4×4 transposed convolution's parameters, initialisation,
    values and both gradients (to float32 rounding), at odd and even sides."""
    import flax.linen as nn
    x = jnp.asarray(np.random.default_rng(0).normal(size=(2, side, side, channels)).astype(np.float32))
    ref, up = nn.ConvTranspose(features, (4, 4), strides=(2, 2)), UpConv(features)
    params = ref.init(jax.random.key(1), x)
    assert jax.tree.map(jnp.shape, params) == jax.tree.map(jnp.shape, up.init(jax.random.key(1), x))
    assert all(bool(jnp.array_equal(a, b)) for a, b in zip(jax.tree.leaves(params),
                                                            jax.tree.leaves(up.init(jax.random.key(1), x))))
    params = jax.tree.map(lambda a: a + 0.1, params)     # a bias that is not zero
    loss = lambda m: lambda p, x: jnp.sum(jnp.sin(m.apply(p, x)))  # noqa: E731
    np.testing.assert_allclose(up.apply(params, x), ref.apply(params, x), rtol=1e-5, atol=1e-5)
    for a, b in zip(jax.tree.leaves(jax.grad(loss(up), (0, 1))(params, x)),
                    jax.tree.leaves(jax.grad(loss(ref), (0, 1))(params, x))):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_upconv_keeps_flax_dtypes_under_x64():
    """As flax's layers, UpConv keeps float32 parameters under jax_enable_x64 and computes in the wider of
    theirs and the input's (its kernel followed the default float, float64, and the convolution refused
    float32 features: the VAE could not be initialised)."""
    import flax.linen as nn
    with jax.enable_x64(True):
        x = jnp.ones((1, 4, 4, 2), jnp.float32)
        for m in (UpConv(3), nn.ConvTranspose(3, (4, 4), strides=(2, 2))):
            params = m.init(jax.random.key(1), x)
            assert {a.dtype for a in jax.tree.leaves(params)} == {jnp.dtype(jnp.float32)}
            assert m.apply(params, x).dtype == jnp.float32 and m.apply(params, x.astype(jnp.float64)).dtype == jnp.float64
        v = VAE(1, 4).init(jax.random.key(0), jnp.zeros((1, 8, 8, 1), jnp.float32))
        assert {a.dtype for a in jax.tree.leaves(v)} == {jnp.dtype(jnp.float32)}


def test_ce_reaches_the_vae_and_mse_does_not_reach_f(tiny):
    _, _, data = tiny
    algo = make(data)
    state = algo.init(jax.random.key(0), data)
    x, y = gather_inputs(data, data.train_idx[1][:8])
    mask = jnp.ones(8)
    bs = state.vae["batch_stats"]

    def ce_part(f, vp):
        x01 = fedfed.to_unit(x)
        x_r, _, _, _ = algo._vae_apply(vp, bs, x01, jax.random.key(1), mask, 1)
        s1, s2 = fedfed.noisy_copies(x01 - x_r, jax.random.key(2), CFG.noise_std)
        from pfedkdh_jax import losses
        logits = algo.model.logits(f, jnp.concatenate([s1, s2]))
        return losses.masked_mean(losses.cross_entropy(logits, jnp.concatenate([y, y])), jnp.ones(16))

    def recon_part(f, vp):
        x01 = fedfed.to_unit(x)
        x_r, mean, logvar, _ = algo._vae_apply(vp, bs, x01, jax.random.key(1), mask, 1)
        return algo.recon_terms(x_r, x01, mean, logvar, mask) + 0.0 * sum(jnp.sum(a) for a in jax.tree_util.tree_leaves(f))

    g_f, g_v = jax.jit(jax.grad(ce_part, argnums=(0, 1)))(state.params, state.vae["params"])
    assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree_util.tree_leaves(g_v))   # through x_s
    g_f, g_v = jax.jit(jax.grad(recon_part, argnums=(0, 1)))(state.params, state.vae["params"])
    assert all(float(jnp.abs(a).max()) == 0 for a in jax.tree_util.tree_leaves(g_f))
    assert any(float(jnp.abs(a).max()) > 0 for a in jax.tree_util.tree_leaves(g_v))


def test_mixup_partners_are_valid_other_samples():
    mask = jnp.array([True] * 5 + [False] * 3)
    partner = np.asarray(fedfed.mixup_partner(jax.random.key(0), mask))
    assert sorted(partner[:5].tolist()) == list(range(5)) and all(partner[i] != i for i in range(5))
    assert partner[5:].tolist() == [5, 6, 7]


@pytest.fixture(scope="module")
def phases_run(tiny):
    """Two rounds of phase A, then two of phase B, with the host runner (CPU layout)."""
    _, _, data = tiny
    algo = make(data)
    # chunks of one step: the fewest steps to compile (FedFed's phase A step is a large program)
    runner = PhasedRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=1))
    states = [algo.init(jax.random.key(0), data)]
    traces = []
    runner.metrics = []
    for t, sel in enumerate(SELECTED):
        state, metrics = runner.round(states[-1], data, sel, jax.random.key(10 + t), t)
        states.append(state)
        runner.metrics.append(metrics)
        runner.evaluate(states[-1], data, jax.random.key(0), t)
        traces.append(dict(runner.traces))
    return algo, runner, states, traces


def test_phase_b_reports_its_pool_and_an_empty_one_shows(tiny, phases_run):
    """pool_entries: every train sample's two copies once phase B is entered; 0 from a phase B round run
    on a state that never entered it (a loop of one's own that forgot phase.enter)."""
    _, part, data = tiny
    _, runner, states, _ = phases_run
    n = sum(len(t) for t in part.train_idx)
    assert [int(m["pool_entries"]) for m in runner.metrics[2:]] == [2 * n, 2 * n]
    assert all("pool_entries" not in m for m in runner.metrics[:2])     # phase A has no pool
    _, forgot = runner.runners[-1].round(states[2], data, SELECTED[2], jax.random.key(12))
    assert int(forgot["pool_entries"]) == 0


def test_pool_holds_two_noisy_copies_of_every_train_sample(tiny, phases_run):
    _, part, data = tiny
    _, _, states, _ = phases_run
    assert not bool(states[2].pool_valid.any())                       # before phase B: no pool
    state = states[3]                                                  # phase B entered at round 3
    n = sum(len(t) for t in part.train_idx)
    valid = np.asarray(state.pool_valid)
    assert valid.sum() == 2 * n
    flat = np.asarray(data.train_flat)
    s = flat.shape[0]
    labels = np.asarray(data.labels)
    for block in (0, 1):
        v = valid[block * s:(block + 1) * s]
        np.testing.assert_array_equal(np.asarray(state.pool_y)[block * s:(block + 1) * s][v], labels[flat][v])
    x = np.asarray(state.pool_x, np.float32)
    assert np.all(np.isfinite(x)) and not np.allclose(x[:s][valid[:s]], x[s:][valid[s:]])  # two different copies


def test_feature_range_images_maps_the_features_as_the_images(tiny, phases_run):
    """``feature_range="images"`` (the default): the pool (and f's input in the joint pass) is 2s − 1 of
    ``"pixels"``'s."""
    import dataclasses
    _, _, data = tiny
    mapped, _, states, _ = phases_run
    assert mapped.config.feature_range == "images"
    algo = dataclasses.replace(mapped, config=dataclasses.replace(CFG, feature_range="pixels"))
    key = jax.random.key(5)
    pixels, images = (jax.jit(a.build_pool)(states[2], data, key) for a in (algo, mapped))
    valid = np.asarray(pixels.pool_valid)
    np.testing.assert_allclose(np.asarray(images.pool_x, np.float32)[valid],
                               2 * np.asarray(pixels.pool_x, np.float32)[valid] - 1, atol=2e-3)   # float16
    s = jnp.linspace(0.0, 1.0, 5)
    np.testing.assert_allclose(np.asarray(mapped.as_f_input(s)), 2 * np.asarray(s) - 1)
    np.testing.assert_array_equal(np.asarray(algo.as_f_input(s)), np.asarray(s))
    # the joint pass feeds f the mapped features: same batch and keys, another loss
    x, y = gather_inputs(data, data.train_idx[1][:8])
    st = states[1]
    losses = [float(jax.jit(a._joint)(st.params, st.vae["params"], st.vae["batch_stats"], x, y, jnp.ones(8),
                                      jax.random.key(6))[0]) for a in (algo, mapped)]
    assert losses[0] != losses[1]


def test_a_client_trains_only_on_its_own_train_samples_and_pool_samples(tiny, phases_run):
    _, part, data = tiny
    algo, _, states, _ = phases_run
    state = states[3]
    b = fedfed.FedFedAvg(algo.model, CFG)
    n_img = data.images.shape[0]
    test_set = set(np.concatenate(part.test_idx).tolist())
    for k in range(data.num_clients):
        local = jax.jit(b.client_start)(state, data, jnp.int32(k), jax.random.key(3))
        n = int(data.train_n[k])
        assert int(local.n) == 2 * n
        row = np.asarray(local.row)[: 2 * n]                        # the slots a client ever visits
        own, pool = row[row < n_img], row[row >= n_img] - n_img
        assert sorted(own.tolist()) == sorted(part.train_idx[k].tolist())   # its train split, each once
        assert not set(own.tolist()) & test_set
        assert len(pool) == n and len(set(pool.tolist())) == n and np.asarray(state.pool_valid)[pool].all()
        # a batch gathered from the row holds exactly those samples
        x, y = fedfed.gather_with_pool(data, jnp.asarray(row), b.context(state))
        np.testing.assert_array_equal(np.asarray(y)[: n], np.asarray(data.labels)[row[:n]])
        np.testing.assert_array_equal(np.asarray(y)[n:], np.asarray(state.pool_y)[pool])
        np.testing.assert_array_equal(np.asarray(x)[n:], np.asarray(state.pool_x, np.float32)[pool])
    # redrawn every round: another key, other draws
    a1 = jax.jit(b.client_start)(state, data, jnp.int32(0), jax.random.key(3)).row
    a2 = jax.jit(b.client_start)(state, data, jnp.int32(0), jax.random.key(4)).row
    assert not np.array_equal(np.asarray(a1), np.asarray(a2))


def test_no_recompilation_within_a_phase(phases_run):
    """Every compiled piece of each phase is traced once (a piece may first be needed in a later
    round, but none is traced again)."""
    _, _, _, traces = phases_run
    assert all(v == 1 for t in traces for v in t.values()), traces[-1]
    assert not any(k.startswith("phase2/") for k in traces[1])     # phase B compiled only when entered
    assert any(k.startswith("phase2/") for k in traces[2])


def test_phase_a_averages_f_and_the_vae_and_keeps_optimizer_states(tiny, phases_run):
    _, _, states, _ = phases_run
    before, after = states[0], states[1]            # round 1 selected clients 2 and 0
    moved = [not np.array_equal(np.asarray(jax.tree_util.tree_leaves(before.vae_opt)[1])[k],
                                np.asarray(jax.tree_util.tree_leaves(after.vae_opt)[1])[k]) for k in range(4)]
    assert moved == [True, False, True, False]
    assert not np.array_equal(np.asarray(before.vae["params"]["mean"]["kernel"]),
                              np.asarray(after.vae["params"]["mean"]["kernel"]))
    # phase B trains f only: the VAE stays as phase A left it
    assert np.array_equal(np.asarray(states[2].vae["params"]["mean"]["kernel"]),
                          np.asarray(states[4].vae["params"]["mean"]["kernel"]))


def test_feature_rounds_must_leave_rounds_for_phase_b():
    from pfedkdh_jax.run.config import ConfigError, make_config
    with pytest.raises(ConfigError, match="feature_rounds must be below --rounds 3"):
        make_config("default", method="fedfed", rounds=3)  # default feature_rounds = 15
    make_config("default", method="fedfed", rounds=3, method_args=(("feature_rounds", "2"),))
