"""Balanced local work (engine/packing.py): the packing itself, and packed rounds equal to unpacked ones.

The packed round runs a round's (run, client) jobs in a few lanes, one job after another per lane;
every job must take exactly the steps it takes in the vmapped round, so states and metrics agree
with ``jax.vmap(make_round(...))`` over the runs, for every method and any number of lanes.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax import algorithms
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.packing import lane_slots, make_packed_round, pack_jobs
from pfedkdh_jax.engine.round import make_round
from pfedkdh_jax.engine.runner import RoundRunner

from test_protocol import LAYOUT_TOL, build, close

SCHEDULE = {3: [np.array([2, 0]), np.array([1, 3])], 4: [np.array([0, 1]), np.array([3, 2])]}


def test_pack_jobs_by_hand():
    # longest first to the least loaded lane (ties: lowest lane): 5→0@0, 3→1@0, 3→1@3, 2→0@5, 1→1@6
    lane, start, loads = pack_jobs(jnp.array([3, 5, 1, 3, 2]), 2)
    np.testing.assert_array_equal(lane, [1, 0, 1, 1, 0])
    np.testing.assert_array_equal(start, [0, 0, 6, 3, 5])
    np.testing.assert_array_equal(loads, [7, 7])


@pytest.mark.parametrize("lanes", [1, 3, 7, 15])   # 15 lanes for 11 jobs: some lanes idle throughout
def test_every_job_holds_a_lane_for_exactly_its_steps(lanes):
    rng = np.random.default_rng(lanes)
    steps = jnp.asarray(rng.integers(0, 40, 11), jnp.int32)
    lane, start, loads = pack_jobs(steps, lanes)
    assert int(loads.sum()) == int(steps.sum())
    # the greedy bound: no lane exceeds the mean load by more than one job
    assert int(loads.max()) <= int(steps.sum()) / lanes + int(steps.max())
    held = np.stack([lane_slots(lane, start, steps, lanes, jnp.int32(t)) for t in range(int(loads.max()))])
    counts = np.bincount(held.ravel(), minlength=len(steps) + 1)
    np.testing.assert_array_equal(counts[:-1], steps)          # each job: its steps, no more, no less
    for j in range(len(steps)):                                # ... in one lane, consecutively
        where = np.argwhere(held == j)
        if len(where):
            assert set(where[:, 1]) == {int(lane[j])}
            np.testing.assert_array_equal(where[:, 0], np.arange(int(start[j]), int(start[j]) + int(steps[j])))


def stacked_rounds(algo, data, round_of):
    """Two rounds of runs 3 and 4 stacked, ``round_of(phase_algorithm)`` jitted over [R]."""
    seeds = list(SCHEDULE)
    state = tree_stack([algo.init(jax.random.key(s), data) for s in seeds])
    phases = algo.phases
    for t in range(2):
        phase = phases[min(t, len(phases) - 1)]
        if t > 0 and len(phases) > 1:
            keys = jnp.stack([jax.random.key(7 + s) for s in seeds])
            state = jax.vmap(phase.enter, in_axes=(0, None, 0))(state, data, keys)
        sel = jnp.asarray(np.stack([SCHEDULE[s][t] for s in seeds]))
        keys = jnp.stack([jax.random.key(100 * s + t) for s in seeds])
        state, metrics = jax.jit(round_of(phase.algorithm))(state, data, sel, keys)
    return state, metrics


# Each method compiles a vmapped and a packed round (~20–60 s on a 2-core CPU): the default command
# covers pFedKDH and a method whose client finish computes its upload (FedProto's prototypes);
# every method runs with --runslow (all passed when packing landed).
QUICK = ("pfedkdh", "fedproto")
NAMES = [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in algorithms.METHODS]


@pytest.mark.parametrize("name", NAMES)
def test_a_packed_round_equals_the_vmapped_round(tiny, name):
    _, _, data = tiny
    algo = build(name, data.num_classes)
    layout = Layout("vmap", "scan")
    ref, ref_metrics = stacked_rounds(algo, data, lambda a: jax.vmap(make_round(a, layout), in_axes=(0, None, 0, 0)))
    packed, metrics = stacked_rounds(algo, data, lambda a: make_packed_round(a, Layout("vmap", "scan", lanes=3)))
    tol = LAYOUT_TOL.get(name, 1e-5)
    close(packed, ref, tol)
    np.testing.assert_allclose(metrics["train_loss"], ref_metrics["train_loss"], rtol=tol)
    useful, computed = metrics["packing_useful_steps"], metrics["packing_computed_steps"]
    assert 0 < int(useful[0]) <= int(computed[0])


@pytest.mark.slow
def test_one_lane_and_more_lanes_than_jobs_give_the_same_round(tiny):
    _, _, data = tiny
    algo = build("pfedkdh", data.num_classes)
    one, m1 = stacked_rounds(algo, data, lambda a: make_packed_round(a, Layout("vmap", "scan", lanes=1)))
    many, m9 = stacked_rounds(algo, data, lambda a: make_packed_round(a, Layout("vmap", "scan", lanes=9)))
    close(one, many, 1e-5)
    # one lane computes only useful steps; nine lanes for four jobs: nine times the longest job
    sizes = np.asarray(data.train_sizes)
    last = [SCHEDULE[s][1] for s in SCHEDULE]
    steps = [int(algo.trainer.num_steps(int(n))) for sel in last for n in sizes[sel]]
    assert int(m1["packing_useful_steps"][0]) == int(m1["packing_computed_steps"][0]) == sum(steps)
    assert int(m9["packing_computed_steps"][0]) == 9 * max(steps)


def test_lanes_need_the_fused_layout():
    with pytest.raises(ValueError, match="vmap.*scan"):
        Layout("sequential", "unrolled", lanes=2).resolved()
    with pytest.raises(ValueError, match=">= 1"):
        Layout("vmap", "scan", lanes=0).resolved()


def test_the_runner_packs_one_run_without_retracing(tiny):
    """The CLI's runner with lanes (one run, no repetition axis) = the unpacked one-call round."""
    _, _, data = tiny
    algo = build("pfedkdh", data.num_classes)
    plain = RoundRunner(algo, data, Layout("vmap", "scan"))
    packed = RoundRunner(algo, data, Layout("vmap", "scan", lanes=2))
    a = b = algo.init(jax.random.key(0), data)
    for t, sel in enumerate(SCHEDULE[3]):
        a, _ = plain.round(a, data, sel, jax.random.key(t))
        b, m = packed.round(b, data, sel, jax.random.key(t))
    close(b, a, 1e-5)
    assert packed.traces["round"] == 1
    assert 0 < int(m["packing_useful_steps"]) <= int(m["packing_computed_steps"])


def test_lanes_on_the_cpu_default_layout_is_one_line():
    from pfedkdh_jax.run.config import ConfigError, make_config
    from pfedkdh_jax.run.experiment import engine_layout

    with pytest.raises(ConfigError, match="--lanes 2 needs --client-parallel vmap --step-loop scan"):
        engine_layout(make_config("smoke", lanes=2, client_parallel="sequential"))
    assert engine_layout(make_config("smoke", lanes=2, client_parallel="vmap", step_loop="scan")).lanes == 2
