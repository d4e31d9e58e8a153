"""Runs that differ in plain-number hyperparameters (lr; pFedKDH's λ, T, μ; the methods' own, FedProx's
μ, say) stacked along the
repetition axis: each repetition's algorithm is rebuilt from its own traced values, so one program
serves them all, and each run must compute what it computes alone with its values as constants."""

import dataclasses
import json
import os

import jax
import flax.linen as nn
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax import algorithms
from pfedkdh_jax.adapters import LinenModel
from pfedkdh_jax.algorithms import common as C
from pfedkdh_jax.data import make_partition
from pfedkdh_jax.data.device import build_federated_data
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.packing import make_packed_round
from pfedkdh_jax.engine.round import make_round
from pfedkdh_jax.engine.runner import RoundRunner
from pfedkdh_jax.run.config import ConfigError, make_config
from pfedkdh_jax.run.experiment import _varied, run, run_stacked, stack_key
from pfedkdh_jax.run.sweep import _stacks, make_sweep, points

from conftest import synthetic_pool
from test_protocol import close

# two pFedKDH runs apart in every traced field; λ = 0 against λ > 0 (a term switched off by its weight)
VALUES = [dict(lr=0.05, lam=0.0, temperature=4.0, mu=0.01), dict(lr=0.02, lam=0.5, temperature=2.0, mu=0.0)]
SEEDS = [3, 4]
SCHEDULE = [np.array([2, 0]), np.array([1, 3])]


def _algo(values, kd_target="support"):
    cfg = make_config("smoke", method="pfedkdh", batch_size=16, local_epochs=1, rounds=2,
                      kd_target=kd_target, **values)
    return algorithms.build(cfg, 4)


def _hparams(fields=("lr", "lam", "temperature", "mu")):
    return {f: jnp.asarray([v[f] for v in VALUES], jnp.float32) for f in fields}


@pytest.fixture(scope="module")
def data():
    pool = synthetic_pool()
    part = make_partition(pool.labels, num_clients=4, alpha=1.0, aux_size=40, min_client_samples=10, seed=0)
    return build_federated_data(pool, part, eval_chunk=64)


def _solo(values, data, layout):
    algo = _algo(values)
    round_fn = jax.jit(make_round(algo, layout))
    states = []
    for s in SEEDS:
        state = algo.init(jax.random.key(s), data)
        for t, sel in enumerate(SCHEDULE):
            state, _ = round_fn(state, data, jnp.asarray(sel), jax.random.key(100 * s + t))
        states.append(state)
    return states


def test_may_be_nonzero_keeps_a_traced_weight():
    assert not C.may_be_nonzero(0.0) and not C.may_be_nonzero(0) and C.may_be_nonzero(0.5)
    assert jax.jit(lambda x: jnp.float32(C.may_be_nonzero(x)))(jnp.float32(0.0)) == 1.0


def test_with_hparams_replaces_config_fields_only():
    algo = _algo(VALUES[0])
    other = algo.with_hparams({"lam": 0.5, "mu": 0.0})
    assert (other.config.lam, other.config.mu, other.config.lr) == (0.5, 0.0, algo.config.lr)
    assert other.model is algo.model and other.config.kd_target == "support" and algo.config.lam == 0.0


@pytest.mark.slow   # the run_stacked test below covers the default set (CI's 20 minutes)
def test_the_runner_stacks_hyperparameter_values(data):
    """The host runner (sequential + unrolled, two runs of other lr / λ / T / μ as two repetitions
    of one set of compiled pieces) = each run alone with its values as constants; nothing retraces."""
    layout = Layout("sequential", "unrolled", chunk_steps=2)
    algo = _algo(VALUES[0])
    runner = RoundRunner(algo, data, layout, reps=2, hparams=_hparams())
    state = tree_stack([algo.init(jax.random.key(s), data) for s in SEEDS])
    for t, sel in enumerate(SCHEDULE):
        keys = jnp.stack([jax.random.key(100 * s + t) for s in SEEDS])
        state, _ = runner.round(state, data, np.stack([sel, sel]), keys)
    assert runner.traces["client_start"] == 1 and runner.traces["server_update_from_mean"] == 1
    for r, values in enumerate(VALUES):
        close(jax.tree_util.tree_map(lambda x: x[r], state), _solo(values, data, layout)[r], 1e-5)
    # the evaluation with EA (its trainer's lr is traced too) = the solo evaluation
    got = runner.evaluate(state, data, jnp.stack([jax.random.key(7)] * 2), personalize=True)
    for r, values in enumerate(VALUES):
        solo = RoundRunner(_algo(values), data, layout)
        want = solo.evaluate(jax.tree_util.tree_map(lambda x: x[r], state), data, jax.random.key(7), personalize=True)
        for key in want:
            np.testing.assert_allclose(got[key][r], want[key], atol=1e-5, err_msg=f"run {r} {key}")
    with pytest.raises(ValueError, match="need reps"):
        RoundRunner(algo, data, layout, hparams=_hparams())


@pytest.mark.slow   # lanes are the accelerators' layout
def test_the_packed_round_stacks_hyperparameter_values(data):
    """Lanes holding jobs of two runs of other values: each job steps with its own run's values."""
    layout = Layout("vmap", "scan", lanes=3)
    algo = _algo(VALUES[0])
    packed = jax.jit(make_packed_round(algo, layout))
    state = tree_stack([algo.init(jax.random.key(s), data) for s in SEEDS])
    for t, sel in enumerate(SCHEDULE):
        keys = jnp.stack([jax.random.key(100 * s + t) for s in SEEDS])
        state, _ = packed(state, data, jnp.asarray(np.stack([sel, sel])), keys, _hparams())
    for r, values in enumerate(VALUES):
        close(jax.tree_util.tree_map(lambda x: x[r], state), _solo(values, data, Layout("vmap", "scan"))[r], 1e-5)


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


@pytest.mark.parametrize("mode", ["vmap", pytest.param("sequential", marks=pytest.mark.slow)])
def test_run_stacked_runs_other_values_as_their_solo_runs(tmp_path, mode):
    """λ = 0 and λ = 0.5 (with another lr) of pFedKDH on the digits demo set as one stacked run (the
    partition shared, not stacked): the λ = 0.5 directory holds its solo run's numbers (the runner
    test above checks both runs' states)."""
    base = dict(dataset="digits", rounds=2, num_clients=4, aux_size=100, local_epochs=1, checkpoint_every=0,
                reps_mode=mode, method="pfedkdh", ea_steps=2, ea_every=2, chunk_steps=4)
    cfgs = [make_config("default", **base, lam=lam, lr=lr, out=str(tmp_path / f"lam{lam}"))
            for lam, lr in ((0.0, 0.015), (0.5, 0.03))]
    assert stack_key(cfgs[0]) == stack_key(cfgs[1])
    run_stacked(cfgs, progress=False, log=lambda m: None)
    c = cfgs[1]
    solo = run(dataclasses.replace(c, out=c.out + "-solo"), progress=False, log=lambda m: None)
    got, want = _rows(c.out), _rows(solo["out"])
    assert len(got) == 2
    for g, w in zip(got, want):
        for key, value in w.items():
            if isinstance(value, float) and "seconds" not in key:
                assert abs(g[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, g[key], value)
    assert _rows(cfgs[0].out)[-1]["train_loss"] != got[-1]["train_loss"]   # each trained with its own values


def test_a_sweep_stacks_the_values_of_a_grid():
    """``--grid lam=0,0.5 --stack``: the two λ points (and the two α) form one group; without
    ``--stack``, one point at a time; a method-arg or a static option still splits groups."""
    sweep = make_sweep(["digits"], [0.5, 1.0], ["pfedkdh", "fedper"], grid={"lam": (0.0, 0.5), "lr": (0.01, 0.02)},
                       options={"rounds": 1}, stack=True)
    groups = _stacks(sweep, points(sweep, "x"))
    sizes = sorted(len(g) for g in groups)
    assert sizes == [4, 8]   # fedper: 2 α × 2 lr; pfedkdh: 2 α × 2 λ × 2 lr
    assert len(_stacks(dataclasses.replace(sweep, stack=False), points(sweep, "x"))) == 12
    split = make_sweep(["digits"], [0.5], ["pfedkdh"], grid={"local_epochs": (1, 2)}, options={"rounds": 1},
                       stack=True)
    assert sorted(len(g) for g in _stacks(split, points(split, "x"))) == [1, 1]


class _Dense(nn.Module):
    """A dense backbone: the methods' own hyperparameters below are about arithmetic, not convolutions."""

    @nn.compact
    def __call__(self, x):
        return nn.relu(nn.Dense(16)(x.reshape(x.shape[0], -1)))


# each method's own traceable options (MethodSpec.traced_args), two values apart in every one
OWN = {"fedprox": [dict(mu=0.0), dict(mu=0.5)],
       "ditto": [dict(lam=0.0), dict(lam=2.0)],
       "fedproto": [dict(lam=0.0), dict(lam=1.5)],
       "pfedme": [dict(lam=15.0, personal_lr=0.01, beta=1.0), dict(lam=5.0, personal_lr=0.03, beta=0.5)],
       "fedala": [dict(eta=1.0), dict(eta=0.2)]}


def test_every_traceable_option_is_a_method_arg_or_a_run_option():
    for name, spec in algorithms.METHODS.items():
        assert set(spec.traced) | set(spec.traced_args) == set(spec.config.TRACEABLE), name
        assert set(spec.traced_args) <= set(spec.args) and not set(spec.traced) & set(spec.args), name
    assert {n: set(algorithms.METHODS[n].traced_args) for n in OWN} == {n: set(v[0]) for n, v in OWN.items()}


# pFedMe (three options, β's mix) and FedProto (two rounds) by default; the others with --runslow (CI's 20 minutes)
@pytest.mark.parametrize("name", [n if n in ("pfedme", "fedproto") else pytest.param(n, marks=pytest.mark.slow)
                                  for n in OWN])
def test_own_options_stacked_as_traced_values_are_each_runs_constants(data, name):
    """Two repetitions of one vmapped round, each rebuilt from its own traced values of the method's
    own options (``with_hparams``) = each value's round alone, its values constants in the program."""
    spec = algorithms.METHODS[name]
    model = LinenModel(_Dense(), nn.Dense(data.num_classes))
    base = dict(local_epochs=1, batch_size=16, lr=0.05, **spec.smoke)
    algos = [spec.algorithm_class()(model, spec.config(**base, **v)) for v in OWN[name]]
    layout = Layout("vmap", "scan")
    hp = {f: jnp.asarray([v[f] for v in OWN[name]], jnp.float32) for f in OWN[name][0]}
    def one(h, state, sel, key):   # a repetition's round, its algorithm rebuilt from its values
        return make_round(algos[0].with_hparams(h), layout)(state, data, sel, key)[0]
    stacked_round = jax.jit(jax.vmap(one, in_axes=(0, 0, None, None)))
    stacked = tree_stack([algos[0].init(jax.random.key(0), data)] * 2)
    alone = [a.init(jax.random.key(0), data) for a in algos]
    for t, sel in enumerate(SCHEDULE):   # two rounds: FedProto's first has no prototypes to be near
        stacked = stacked_round(hp, stacked, jnp.asarray(sel), jax.random.key(t))
        alone = [jax.jit(make_round(a, layout))(s, data, jnp.asarray(sel), jax.random.key(t))[0]
                 for a, s in zip(algos, alone)]
    for r in range(2):
        close(jax.tree_util.tree_map(lambda x: x[r], stacked), alone[r], 1e-5)
    moved = [not np.allclose(a, b) for a, b in zip(*(jax.tree_util.tree_leaves(s) for s in alone))]
    assert any(moved), "the two values train alike: the test would not see a value ignored"


def test_a_sweep_scoring_some_clients_stacks_only_points_of_one_partition(tmp_path):
    """--eval-clients scores one partition's chosen clients: a sweep stacks the grid's points per α, and
    run_stacked refuses runs of two α before partitioning anything (one line)."""
    sweep = make_sweep(["digits"], [0.5, 1.0], ["fedper"], grid={"lr": (0.01, 0.02)},
                       options={"rounds": 1, "eval_clients": 2}, stack=True)
    groups = _stacks(sweep, points(sweep, "x"))
    assert sorted(len(g) for g in groups) == [2, 2] and all(len({c.alpha for _, c in g}) == 1 for g in groups)
    cfgs = [make_config("default", dataset="digits", method="fedper", rounds=1, eval_clients=2, alpha=a,
                        out=str(tmp_path / f"a{a}")) for a in (0.5, 1.0)]
    with pytest.raises(ConfigError, match="--eval-clients scores one partition's clients"):
        run_stacked(cfgs, progress=False, log=lambda m: None)
    assert not any(os.path.exists(c.out) for c in cfgs)


def test_a_sweep_stacks_a_grid_of_a_methods_own_option():
    """``--grid fedprox:mu=... --stack``: FedProx's μ points are one group (their method_args differ only
    in a traced option); a non-traced own option (FedRep's head_epochs) still splits them."""
    sweep = make_sweep(["digits"], [0.5, 1.0], ["fedprox", "fedrep"], grid={"fedprox:mu": (0.01, 0.1),
                       "fedrep:head_epochs": (1, 2)}, options={"rounds": 1}, stack=True)
    todo = points(sweep, "x")
    sizes = sorted((cfg.method, len(g)) for g in _stacks(sweep, todo) for cfg in [g[0][1]])
    assert sizes == [("fedprox", 4), ("fedrep", 2), ("fedrep", 2)]
    prox = [cfg for _, cfg in todo if cfg.method == "fedprox"]
    assert stack_key(prox[0]) == stack_key(prox[-1]) and stack_key(prox[0])["method_args"] == ()
    assert list(_varied(prox)) == ["mu"] and sorted(_varied(prox)["mu"]) == [0.01, 0.01, 0.1, 0.1]


def test_run_stacked_runs_other_values_of_an_own_option_as_their_solo_runs(tmp_path):
    """FedProx μ = 0 and μ = 1 (``--method-arg``) as one stacked run: the μ = 1 directory holds its solo
    run's numbers, and the μ = 0 run trained otherwise."""
    base = dict(dataset="digits", rounds=1, num_clients=4, aux_size=100, local_epochs=1, checkpoint_every=0,
                reps_mode="vmap", method="fedprox", chunk_steps=4)
    cfgs = [make_config("default", **base, method_args={"mu": mu}, out=str(tmp_path / f"mu{mu}"))
            for mu in (0.0, 1.0)]
    run_stacked(cfgs, progress=False, log=lambda m: None)
    c = cfgs[1]
    solo = run(dataclasses.replace(c, out=c.out + "-solo"), progress=False, log=lambda m: None)
    got, want = _rows(c.out), _rows(solo["out"])
    for g, w in zip(got, want, strict=True):
        for key, value in w.items():
            if isinstance(value, float) and "seconds" not in key:
                assert abs(g[key] - value) <= 1e-5 * max(1.0, abs(value)), (key, g[key], value)
    assert _rows(cfgs[0].out)[-1]["train_loss"] != got[-1]["train_loss"]
