"""Runs of different partitions (other α values, other data seeds) stacked along the repetition axis.

Two partitions of one pool, of different client sizes, stack into one FederatedData (the index tables
padded to the wider run); each stacked run must compute what it computes alone on its own, unpadded
data: the pure round vmapped over runs, its evaluation, the host runner's plans and the packed round.
"""

import dataclasses
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax import algorithms
from pfedkdh_jax.data import make_partition
from pfedkdh_jax.data.device import build_federated_data, data_axes, run_slice, stack_partitions
from pfedkdh_jax.engine.evaluate import make_evaluate
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.packing import make_packed_round
from pfedkdh_jax.engine.round import make_round
from pfedkdh_jax.engine.runner import RoundRunner
from pfedkdh_jax.run.config import ConfigError, make_config
from pfedkdh_jax.run.experiment import resume, run, run_stacked

from conftest import synthetic_pool
from test_protocol import LAYOUT_TOL, build, close

SEEDS = [3, 4]
SCHEDULE = [[np.array([2, 0]), np.array([1, 3])], [np.array([0, 1]), np.array([3, 2])]]   # per run, per round
# two methods of different state layouts by default (a shared backbone, K stored bodies); every
# other one with --runslow (pFedSim's stacked run too: CI's 20 minutes)
QUICK = ("pfedkdh",)
NAMES = [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in algorithms.METHODS if n != "fedfed"]


@pytest.fixture(scope="module")
def two_partitions():
    pool = synthetic_pool()
    datas = []
    for alpha, seed in ((1.0, 0), (0.3, 1)):   # other α, other data seed: other client sizes
        part = make_partition(pool.labels, num_clients=4, alpha=alpha, aux_size=40, min_client_samples=10,
                              seed=seed)
        datas.append(build_federated_data(pool, part, eval_chunk=64))
    assert datas[0].train_sizes != datas[1].train_sizes
    return datas, stack_partitions(datas)


def test_stacking_pads_every_table_and_keeps_each_run(two_partitions):
    datas, stacked = two_partitions
    assert stacked.runs == 2 and stacked.stacked and not datas[0].stacked
    np.testing.assert_array_equal(stacked.train_n, [datas[0].train_sizes, datas[1].train_sizes])
    assert stacked.train_sizes == tuple(max(a, b) for a, b in zip(datas[0].train_sizes, datas[1].train_sizes))
    assert stacked.images is datas[0].images or stacked.images.shape == datas[0].images.shape
    for r, d in enumerate(datas):
        one = run_slice(stacked, r)
        assert not one.stacked and one.train_idx.shape == stacked.train_idx.shape[1:]
        n = np.asarray(d.train_n)
        np.testing.assert_array_equal(one.train_n, n)
        for k in range(d.num_clients):   # each client's own samples, in order, then padding
            np.testing.assert_array_equal(one.train_idx[k, :n[k]], d.train_idx[k, :n[k]])
        # the padded test list holds the same (sample, owner) pairs; padding belongs to no client
        real = np.asarray(one.test_client) < d.num_clients
        np.testing.assert_array_equal(np.asarray(one.test_flat)[real], np.asarray(d.test_flat)[np.asarray(d.test_client) < d.num_clients])
        assert one.owned_idx.shape[0] * one.owned_idx.shape[1] == one.owned_slot.shape[0]
    axes = data_axes(stacked)
    assert axes.images is None and axes.train_idx == 0 and data_axes(datas[0]) is None
    with pytest.raises(ValueError, match="share the pool"):
        stack_partitions([datas[0], build_federated_data(synthetic_pool(n=200), make_partition(
            synthetic_pool(n=200).labels, num_clients=4, alpha=1.0, aux_size=40, min_client_samples=10, seed=0),
            eval_chunk=64)])


def _solo(algo, data, layout, seed, schedule):
    round_fn = jax.jit(make_round(algo, Layout(*layout, chunk_steps=2)))
    state = algo.init(jax.random.key(seed), data)
    for t, sel in enumerate(schedule):
        state, _ = round_fn(state, data, jnp.asarray(sel), jax.random.key(100 * seed + t))
    return state


def _stacked_states(algo, stacked):
    return tree_stack([algo.init(jax.random.key(s), run_slice(stacked, r)) for r, s in enumerate(SEEDS)])


@pytest.mark.parametrize("name", NAMES)
def test_a_stacked_run_equals_its_solo_run(two_partitions, name):
    datas, stacked = two_partitions
    algo = build(name, stacked.num_classes)
    layout = ("vmap", "scan")
    d = data_axes(stacked)
    batched = jax.jit(jax.vmap(make_round(algo, Layout(*layout)), in_axes=(0, d, 0, 0)))
    state = _stacked_states(algo, stacked)
    for t in range(2):
        sel = jnp.asarray(np.stack([SCHEDULE[r][t] for r in range(2)]))
        keys = jnp.stack([jax.random.key(100 * s + t) for s in SEEDS])
        state, _ = batched(state, stacked, sel, keys)
    evaluate, ea = make_evaluate(algo, Layout(*layout)), algo.personalization is not None
    evals = jax.jit(jax.vmap(lambda s, data, k: evaluate(s, data, k, ea), in_axes=(0, d, 0)))(
        state, stacked, jnp.stack([jax.random.key(7)] * 2))
    tol = LAYOUT_TOL.get(name, 1e-5)
    for r, s in enumerate(SEEDS):
        alone = _solo(algo, datas[r], layout, s, SCHEDULE[r])
        close(jax.tree_util.tree_map(lambda x: x[r], state), alone, tol)
        want = jax.jit(make_evaluate(algo, Layout(*layout)), static_argnums=3)(alone, datas[r], jax.random.key(7), ea)
        assert set(want) == set(evals)
        for key in want:
            np.testing.assert_allclose(evals[key][r], want[key], atol=tol, err_msg=f"run {r} {key}")


@pytest.mark.parametrize("name, layout", [
    ("pfedkdh", ("sequential", "unrolled")),
    pytest.param("fedbabu", ("sequential", "unrolled"), marks=pytest.mark.slow),   # CI's 20 minutes
    # the one-call round of vmap + scan is the pure round checked above, compiled: slow
    pytest.param("pfedkdh", ("vmap", "scan"), marks=pytest.mark.slow),
    pytest.param("pfedkdh", ("vmap", "unrolled"), marks=pytest.mark.slow),
    pytest.param("fedbabu", ("vmap", "unrolled"), marks=pytest.mark.slow),
    pytest.param("fedbabu", ("vmap", "scan"), marks=pytest.mark.slow)])
def test_the_host_runner_runs_stacked_partitions(two_partitions, name, layout):
    """The runner's plans over stacked partitions (each repetition's steps counted in its own
    partition) = one runner per partition."""
    datas, stacked = two_partitions
    algo = build(name, stacked.num_classes)
    lay = Layout(*layout, chunk_steps=2)
    runner = RoundRunner(algo, stacked, lay, reps=2)
    state = _stacked_states(algo, stacked)
    for t in range(2):
        sel = np.stack([SCHEDULE[r][t] for r in range(2)])
        state, _ = runner.round(state, stacked, sel, jnp.stack([jax.random.key(100 * s + t) for s in SEEDS]))
    got = runner.evaluate(state, stacked, jnp.stack([jax.random.key(7)] * 2), personalize=True)
    for r, s in enumerate(SEEDS):
        solo = RoundRunner(algo, datas[r], lay)
        alone = algo.init(jax.random.key(s), datas[r])
        for t in range(2):
            alone, _ = solo.round(alone, datas[r], SCHEDULE[r][t], jax.random.key(100 * s + t))
        close(jax.tree_util.tree_map(lambda x: x[r], state), alone, 1e-5)
        want = solo.evaluate(alone, datas[r], jax.random.key(7), personalize=True)
        for key in want:
            np.testing.assert_allclose(got[key][r], want[key], atol=1e-5, err_msg=f"run {r} {key}")
    with pytest.raises(ValueError, match="need reps=2"):
        RoundRunner(algo, stacked, lay, reps=None)


def test_the_packed_round_runs_stacked_partitions(two_partitions):
    datas, stacked = two_partitions
    algo = build("pfedkdh", stacked.num_classes)
    packed = jax.jit(make_packed_round(algo, Layout("vmap", "scan", lanes=3)))
    state = _stacked_states(algo, stacked)
    for t in range(2):
        sel = jnp.asarray(np.stack([SCHEDULE[r][t] for r in range(2)]))
        state, _ = packed(state, stacked, sel, jnp.stack([jax.random.key(100 * s + t) for s in SEEDS]))
    for r, s in enumerate(SEEDS):
        close(jax.tree_util.tree_map(lambda x: x[r], state), _solo(algo, datas[r], ("vmap", "scan"), s, SCHEDULE[r]), 1e-5)


def _rows(out):
    with open(os.path.join(out, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _numbers(rows):
    """Every repetition's numeric metrics of every round (timings excluded)."""
    skip = ("seconds", "train_seconds", "eval_seconds")
    return [[{k: v for k, v in rep.items() if isinstance(v, float) and k not in skip} for rep in row["reps"]]
            for row in rows]


# vmapped stacked runs are also compared by tests/test_sweep.py (FedPer, FedAvg)
@pytest.mark.parametrize("mode", [pytest.param("vmap", marks=pytest.mark.slow), "sequential"])
def test_run_stacked_writes_every_run_as_its_solo_run(tmp_path, mode):
    """Two α values × 2 seeds of pFedKDH on the digits demo set as one stacked run: every run
    directory holds its solo run's numbers; killed after round 2 of one run's checkpoints (the other
    at round 3), the stack resumes from their common round 2 to the same numbers."""
    base = dict(dataset="digits", rounds=3, num_clients=4, aux_size=100, local_epochs=1, checkpoint_every=1,
                reps=2, reps_mode=mode, method="pfedkdh", lam=0.5, ea_steps=2, ea_every=3, chunk_steps=4)
    cfgs = [make_config("default", **base, alpha=a, data_seed=ds, out=str(tmp_path / f"stacked-{a}"))
            for a, ds in ((0.5, 0), (1.0, 1))]
    summaries = run_stacked(cfgs, progress=False, log=lambda m: None)
    assert [s["stacked_runs"] for s in summaries] == [[c.out for c in cfgs]] * 2
    for c in cfgs:
        solo = run(dataclasses.replace(c, out=c.out + "-solo", checkpoint_every=0), progress=False, log=lambda m: None)
        got, want = _numbers(_rows(c.out)), _numbers(_rows(solo["out"]))
        assert len(got) == 3 and [len(g) for g in got] == [2, 2, 2]
        for g, w in zip(got, want):
            for gr, wr in zip(g, w):
                assert set(gr) == set(wr)
                for key in wr:
                    # the losses to float32 rounding; the running mean of the uploads, vmapped over the
                    # runs, sums in another rounding than a solo run's, which can flip a test prediction
                    # (seen: one EA prediction, 0.0031 of a macro accuracy)
                    tol = 0.02 if "accuracy" in key else 1e-5
                    assert abs(gr[key] - wr[key]) <= tol, (c.out, key, gr[key], wr[key])
    first = _numbers(_rows(cfgs[0].out))

    # interrupted: the first run's round-3 checkpoint lost, both summaries lost
    shutil.rmtree(os.path.join(cfgs[0].out, "checkpoints", "round_000003"))
    for c in cfgs:
        os.remove(os.path.join(c.out, "summary.json"))
    log = []
    run_stacked(cfgs, progress=False, log=log.append, resume=True)
    assert sum("after round 2" in line for line in log) == 2
    assert _numbers(_rows(cfgs[0].out)) == first


@pytest.mark.slow   # CI's 20 minutes (solo runs' kill-and-resume: test_run_management)
def test_a_stacked_point_resumes_alone(tmp_path):
    """One repetition per α, vmapped: each directory's checkpoint is a solo run's (no repetition axis),
    so ``resume`` of one directory alone continues it; the stack resumes from them too."""
    base = dict(dataset="digits", rounds=2, num_clients=4, aux_size=100, local_epochs=1, checkpoint_every=1,
                reps_mode="vmap", method="fedper")
    cfgs = [make_config("default", **base, alpha=a, out=str(tmp_path / f"p{a}")) for a in (0.5, 1.0)]
    run_stacked(cfgs, progress=False, log=lambda m: None)
    want = _rows(cfgs[0].out)
    os.remove(os.path.join(cfgs[0].out, "summary.json"))
    log = []
    resume(cfgs[0].out, progress=False, log=log.append)
    assert any("after round 2" in line for line in log) and not any("corrupt" in line for line in log)
    assert [r["personalized_macro_accuracy"] for r in _rows(cfgs[0].out)] == [r["personalized_macro_accuracy"] for r in want]
    log = []
    run_stacked(cfgs, progress=False, log=log.append, resume=True)
    assert sum("after round 2" in line for line in log) == 2 and not any("corrupt" in line for line in log)


def test_run_stacked_refuses_runs_that_do_not_stack(tmp_path):
    base = dict(dataset="digits", rounds=2, num_clients=4, aux_size=100, local_epochs=1)
    a = make_config("default", **base, method="fedper", alpha=0.5, out=str(tmp_path / "a"))
    with pytest.raises(ConfigError, match="differ only in alpha, data_seed, out, lr; .* also differs in local_epochs"):
        run_stacked([a, dataclasses.replace(a, local_epochs=2, out=str(tmp_path / "b"))], log=lambda m: None)
    with pytest.raises(ConfigError, match="one --out each"):
        run_stacked([a, dataclasses.replace(a, alpha=1.0)], log=lambda m: None)
    f = make_config("default", **{**base, "rounds": 3}, method="fedfed", method_args=(("feature_rounds", "1"),),
                    alpha=0.5, out=str(tmp_path / "f"))
    with pytest.raises(ConfigError, match="fedfed's runs do not stack"):
        run_stacked([f, dataclasses.replace(f, alpha=1.0, out=str(tmp_path / "g"))], log=lambda m: None)
