"""Every registered algorithm through the public pure functions ``make_round`` / ``make_evaluate``.

For each method: two rounds with each layout (vmap / sequential × scan / unrolled), jitted by the test
itself, give the same states and evaluations; nothing retraces after the first round (of each phase);
two repetitions vmapped over a leading axis equal the per-repetition solo runs; and the host runner
(the CLI's loop over the compiled pieces) computes what the pure round computes. A method of two
phases (FedFed) runs its first round in phase A and its second in phase B, entering it in between.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from pfedkdh_jax import algorithms
from pfedkdh_jax.engine.protocol import Algorithm
from pfedkdh_jax.engine.evaluate import make_evaluate
from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.engine.round import make_round
from pfedkdh_jax.engine.runner import RoundRunner
from pfedkdh_jax.run.config import make_config

LAYOUTS = [("vmap", "scan"), ("vmap", "unrolled"), ("sequential", "scan"), ("sequential", "unrolled")]
SELECTED = [np.array([2, 0]), np.array([1, 3])]
# Small local work per method (the tiny federation: 4 clients, 4 classes)
ARGS = {"fedrep": {"head_epochs": "1"}, "fedbabu": {"finetune_epochs": "1"}, "pfedme": {"inner_steps": "2"},
        "fedala": {"start_epochs": "2"}, "pfedsim": {"warmup": "1"}, "fedfed": {"feature_rounds": "1", "vae_width": "8"}}
EXTRA = {"pfedkdh": dict(lam=0.5, ea_steps=2, teacher_epochs=1)}
# Layouts differ by float32 op-order round-off (~1e-5 after two rounds). FedFed's VAE trains with
# AdamW, which turns round-off in near-zero gradients (conv biases ahead of batch norm) into steps of
# size lr, and its shared pool is stored in the data's float16, where that round-off moves a feature
# by an ulp (~1e-3): layouts agree to ~1e-3 there.
LAYOUT_TOL = {"fedfed": 3e-3}


def build(name, num_classes):
    cfg = make_config("smoke", method=name, lr=0.05, batch_size=16, local_epochs=1, rounds=2,
                      method_args=tuple(ARGS.get(name, {}).items()), **EXTRA.get(name, {}))
    algo = algorithms.build(cfg, num_classes)
    assert isinstance(algo, Algorithm) and algo.name == name
    return algo


def close(a, b, tol):
    assert jax.tree_util.tree_structure(a) == jax.tree_util.tree_structure(b)
    for x, y in zip(jax.tree_util.tree_leaves(a), jax.tree_util.tree_leaves(b)):
        if jnp.issubdtype(x.dtype, jnp.floating):
            np.testing.assert_allclose(x, y, rtol=tol, atol=tol)
        else:
            np.testing.assert_array_equal(x, y)


def phase_steps(algo, layout, traces):
    """For round t: (enter or None, the jitted round of t's phase)."""
    out, t = [], 0
    for phase in algo.phases:
        round_fn = make_round(phase.algorithm, Layout(*layout, chunk_steps=2))

        def counted(*args, fn=round_fn, i=len(out)):
            traces[i] = traces.get(i, 0) + 1
            return fn(*args)
        step = jax.jit(counted)
        enter = jax.jit(phase.enter) if phase.enter is not None else None
        for _ in range(phase.rounds or 1):
            out.append((enter if _ == 0 and t > 0 else None, step))
            t += 1
    return out


def two_rounds(algo, data, layout, seed=0, selected=SELECTED, vmapped=None):
    """Two jitted rounds of the pure round functions (a phase change between them for FedFed);
    (state, metrics, traces per phase)."""
    traces = {}
    steps = phase_steps(algo, layout, traces)
    state = algo.init(jax.random.key(seed), data)
    for t, sel in enumerate(selected):
        enter, step = steps[min(t, len(steps) - 1)]
        if enter is not None:
            state = enter(state, data, jax.random.key(7 + seed))
        state, metrics = step(state, data, jnp.asarray(sel), jax.random.key(100 * seed + t))
    return state, metrics, traces


# FedFed's phase A (a VAE and three passes a batch) takes minutes per test to compile on a 2-core CPU;
# FedAvg, FedProx and FedPer take the plain trainer's path that FedRep, FedBABU and Ditto take too
# (every method with --runslow; all passed in the full runs)
LAYOUT_SLOW = ("fedfed", "fedavg", "fedprox", "fedper")
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in LAYOUT_SLOW else n for n in algorithms.METHODS]
# Repetitions by default for two methods of different state layouts (CI's 20 minutes); every method with --runslow
# (all passed in the full runs since the repetition axis landed for every method).
REPS_QUICK = ("pfedkdh", "fedproto")
REPS_NAMES = [n if n in REPS_QUICK else pytest.param(n, marks=pytest.mark.slow) for n in algorithms.METHODS]


@pytest.mark.parametrize("name", NAMES)
def test_every_layout_computes_the_same_round_and_evaluation(tiny, name, request):
    _, _, data = tiny
    algo = build(name, data.num_classes)
    results = []
    # by default the two layouts the backends default to (the accelerators' one-program round, the
    # CPU's host-driven one); the two mixed ones with --runslow (CI's 20 minutes)
    layouts = LAYOUTS if request.config.getoption("--runslow") else [LAYOUTS[0], LAYOUTS[3]]
    for layout in layouts:
        state, metrics, traces = two_rounds(algo, data, layout)
        assert set(traces.values()) == {1}, (layout, traces)  # nothing retraced within a phase
        last = algo.phases[-1].algorithm
        evaluate = jax.jit(make_evaluate(last, Layout(*layout, chunk_steps=2)), static_argnums=3)
        ev = evaluate(state, data, jax.random.key(7), last.personalization is not None)
        results.append((layout, state, metrics, ev))
    _, state0, metrics0, ev0 = results[0]
    tol = LAYOUT_TOL.get(name, 1e-4)
    for layout, state, metrics, ev in results[1:]:
        close(state, state0, tol)                              # round-off only (see LAYOUT_TOL)
        np.testing.assert_allclose(metrics["train_loss"], metrics0["train_loss"], rtol=tol / 3, err_msg=str(layout))
        assert set(ev) == set(ev0)
        for key in ev0:
            np.testing.assert_allclose(ev[key], ev0[key], atol=tol / 10, err_msg=f"{layout} {key}")
    assert 0.0 <= float(ev0["personalized_macro_accuracy"]) <= 1.0


@pytest.mark.parametrize("name", REPS_NAMES)
def test_repetitions_vmapped_equal_their_solo_runs(tiny, name):
    _, _, data = tiny
    algo = build(name, data.num_classes)
    layout = ("sequential", "unrolled")
    seeds = [3, 4]
    # each repetition its own init, clients and keys
    schedule = {3: SELECTED, 4: [np.array([0, 1]), np.array([3, 2])]}
    phases = algo.phases
    state = tree_stack([algo.init(jax.random.key(s), data) for s in seeds])
    for t in range(2):
        phase = phases[min(t, len(phases) - 1)]
        if t > 0 and len(phases) > 1:
            keys = jnp.stack([jax.random.key(7 + s) for s in seeds])
            state = jax.vmap(phase.enter, in_axes=(0, None, 0))(state, data, keys)
        batched = jax.jit(jax.vmap(make_round(phase.algorithm, Layout(*layout, chunk_steps=2)), in_axes=(0, None, 0, 0)))
        sel = jnp.asarray(np.stack([schedule[s][t] for s in seeds]))
        keys = jnp.stack([jax.random.key(100 * s + t) for s in seeds])
        state, _ = batched(state, data, sel, keys)
    for r, s in enumerate(seeds):
        alone, _, _ = two_rounds(algo, data, layout, seed=s, selected=schedule[s])
        close(jax.tree_util.tree_map(lambda x: x[r], state), alone, LAYOUT_TOL.get(name, 1e-5))


@pytest.mark.parametrize("name", ["pfedkdh", "fedbabu", "fedproto", "pfedsim"])
def test_the_host_runner_computes_the_pure_round(tiny, name):
    """The CLI's runner (compiled pieces, chunks of 2 steps and single steps) = the pure round."""
    _, _, data = tiny
    algo = build(name, data.num_classes)
    pure, _, _ = two_rounds(algo, data, ("sequential", "unrolled"))
    runner = RoundRunner(algo, data, Layout("sequential", "unrolled", chunk_steps=2))
    state = algo.init(jax.random.key(0), data)
    for t, sel in enumerate(SELECTED):
        state, _ = runner.round(state, data, sel, jax.random.key(t))
    # float32 op-order round-off only (one program vs chained calls, other XLA:CPU options), which
    # the 16 steps of λ = 0.5 at lr 0.05 grow to ~1e-4 here: the runner's own layouts differ as much
    close(state, pure, 3e-4)
    ea = algo.personalization is not None   # asked of FedProto or pFedSim, it is a ValueError
    got = runner.evaluate(state, data, jax.random.key(7), personalize=ea)
    want = jax.jit(make_evaluate(algo, Layout("sequential", "unrolled")), static_argnums=3)(
        pure, data, jax.random.key(7), ea)
    for key in want:
        np.testing.assert_allclose(got[key], want[key], atol=1e-5, err_msg=key)
