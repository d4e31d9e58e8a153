"""Monte Carlo repetitions as an array axis, and sharding over (fake) devices."""

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from pfedkdh_jax.engine.layout import Layout
from pfedkdh_jax.run.experiment import streams
from pfedkdh_jax.engine.local import tree_stack
from pfedkdh_jax.model import CNN
from pfedkdh_jax.algorithms.pfedkdh import PFedKDH, PFedKDHConfig
from pfedkdh_jax.engine.runner import RoundRunner, sample_schedule

HP = PFedKDHConfig(lr=0.05, batch_size=8, local_epochs=1, teacher_epochs=1, ea_steps=2)


def run_reps(data, seeds, form, rounds=2):
    """States after ``rounds`` rounds of the given seeds, batched on a repetition axis."""
    algo = PFedKDH(CNN(data.num_classes, 0.1), HP)
    runner = RoundRunner(algo, data, Layout(*form, chunk_steps=4), reps=len(seeds))
    keys = [streams(s) for s in seeds]
    state = tree_stack([algo.init(k["init"], data) for k in keys])
    sched = np.stack([sample_schedule(k["sampling"], rounds, 4, 2) for k in keys])
    for t in range(rounds):
        rk = jax.numpy.stack([jax.random.fold_in(k["train"], t) for k in keys])
        state, _ = runner.round(state, data, sched[:, t], rk)
    ev = runner.evaluate(state, data, jax.numpy.stack([k["eval"] for k in keys]), personalize=True)
    traces = dict(runner.traces)
    rk = jax.numpy.stack([jax.random.fold_in(k["train"], rounds) for k in keys])
    runner.evaluate(runner.round(state, data, sched[:, 0], rk)[0], data,
                    jax.numpy.stack([k["eval"] for k in keys]), personalize=True)
    assert dict(runner.traces) == traces, "recompiled after the first round"
    return state, ev, runner


# the vmap + scan form of this check runs with --runslow (test_protocol checks repetitions of every
# method in the pure round, and test_packing stacked repetitions in the fused form)
@pytest.mark.parametrize("form", [("sequential", "unrolled"),
                                  pytest.param(("vmap", "scan"), marks=pytest.mark.slow)])
def test_repetition_in_a_batch_equals_the_seed_alone(tiny, form):
    _, _, data = tiny
    batch, ev, runner = run_reps(data, [3, 4], form)
    for r, seed in enumerate([3, 4]):
        alone, ev1, _ = run_reps(data, [seed], form)
        for a, b in zip(jax.tree_util.tree_leaves(batch), jax.tree_util.tree_leaves(alone)):
            np.testing.assert_allclose(np.asarray(a)[r], np.asarray(b)[0], atol=1e-5, rtol=1e-5)
        np.testing.assert_allclose(ev["personalized_macro_accuracy_ea"][r], ev1["personalized_macro_accuracy_ea"][0],
                                   atol=1e-5)


def test_cli_reps_vmap_equals_sequential_and_reports_mean_std(tmp_path, capsys):
    from pfedkdh_jax.run import cli
    common = ["run", "--preset", "smoke", "--reps", "2", "--no-progress", "--chunk-steps", "4", "--clients", "6"]
    assert cli.main([*common, "--reps-mode", "vmap", "--out", str(tmp_path / "v")]) == 0
    printed = capsys.readouterr().out   # the closing figures: each mean with its std (means only before)
    assert '"personalized_macro_accuracy_std"' in printed and '"seconds_per_round_std"' not in printed
    assert cli.main([*common, "--reps-mode", "sequential", "--out", str(tmp_path / "s")]) == 0
    v = json.loads((tmp_path / "v" / "summary.json").read_text())
    s = json.loads((tmp_path / "s" / "summary.json").read_text())
    assert [r["seed"] for r in v["repetitions"]] == [0, 1]
    # the same runs up to float32 rounding (the vmapped convolutions sum in another order): the train
    # losses agree closely; an accuracy may differ by a borderline test sample (one client's one sample
    # moves a macro accuracy by 1 / (clients · its test size) <= 1 / (6 · 40)), never by more
    np.testing.assert_allclose([r["final_train_loss"] for r in v["repetitions"]],
                               [r["final_train_loss"] for r in s["repetitions"]], rtol=1e-4)
    for key in ["personalized_macro_accuracy", "global_macro_accuracy", "personalized_macro_accuracy_ea"]:
        per = [r[key] for r in v["repetitions"]]
        assert v[key] == pytest.approx(np.mean(per)) and v[f"{key}_std"] == pytest.approx(np.std(per))
        np.testing.assert_allclose(per, [r[key] for r in s["repetitions"]], atol=1 / (6 * 40) + 1e-6)
    assert v["personalized_macro_accuracy_std"] > 0   # different seeds, different runs
    row = json.loads((tmp_path / "v" / "metrics.jsonl").read_text().splitlines()[-1])
    assert len(row["reps"]) == 2 and "personalized_macro_accuracy_std" in row


# XLA's convolution (conftest.py: the suite's form where a test is not about it): at 8 repetitions the
# Winograd form's float32 rounding, summed in another order once sharded, flipped two test predictions
# where this test allows one
SCRIPT = r"""
import json, sys
import jax
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import run
cfg = make_config("smoke", out=sys.argv[1], reps=int(sys.argv[2]), reps_mode=sys.argv[5], num_clients=4,
                  rounds=2, local_epochs=1, ea_steps=2, client_parallel=sys.argv[3], step_loop=sys.argv[4],
                  chunk_steps=4, checkpoint_every=0, conv_form="lax")
s = run(cfg, progress=False, log=lambda *_: None)
print(json.dumps({"devices": jax.device_count(), "summary": s}))
"""


def _per_client_moves(a: dict, b: dict) -> list:
    """The per-client accuracies (personalized, global, EA; of every repetition) that differ between
    two summaries, as absolute differences."""
    runs = lambda s: s.get("repetitions") or [s]  # noqa: E731
    keys = ("per_client_personalized_accuracy", "per_client_global_accuracy", "per_client_personalized_accuracy_ea")
    return [abs(x - y) for ra, rb in zip(runs(a), runs(b), strict=True) for k in keys if k in ra
            for x, y in zip(ra[k], rb[k], strict=True) if x != y]


def _run_on_devices(n, out, reps, layout, reps_mode="vmap"):
    env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}
    p = subprocess.run([sys.executable, "-c", SCRIPT, str(out), str(reps), *layout, reps_mode],
                       capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("devices, reps, layout", [
    # with --runslow (CI's 20 minutes): the repetition axis over devices is not a CPU default (the
    # clients spread over devices are: the next test), nor is the fused round's client axis
    pytest.param(2, 2, ("sequential", "unrolled"), marks=pytest.mark.slow),
    pytest.param(2, 1, ("vmap", "scan"), marks=pytest.mark.slow),
    pytest.param(8, 8, ("sequential", "unrolled"), marks=pytest.mark.slow)])
def test_sharded_over_fake_devices_matches_one_device(tmp_path, devices, reps, layout):
    """reps=2 on 2 devices and reps=8 on 8 devices shard the repetition axis (CPU layout); reps=1 on
    2 devices shards the 2 clients of the fused round (vmap + scan).

    With the repetition axis sharded, every device runs one repetition, so the one-device reference
    runs the repetitions one after another: the same per-repetition computation. (Repetitions
    vmapped on one device use grouped convolutions, whose float32 rounding differs from a plain
    convolution's; here that flipped one test prediction.)"""
    one = _run_on_devices(1, tmp_path / "one", reps, layout, "sequential" if reps > 1 else "vmap")
    many = _run_on_devices(devices, tmp_path / "many", reps, layout)
    assert (one["devices"], many["devices"]) == (1, devices)
    # the losses agree to float32 rounding; a rounding difference can flip a test prediction (seen:
    # one of client 2's 116 in one repetition, the running mean of the uploads summed in another
    # order when vmapped over the repetitions), so at most one client's score in one repetition moves,
    # by one prediction (a client holds more than 50 test samples here)
    assert many["summary"]["final_train_loss"] == pytest.approx(one["summary"]["final_train_loss"], rel=2e-5)
    moved = _per_client_moves(one["summary"], many["summary"])
    assert len(moved) <= 1 and all(d <= 1 / 50 for d in moved), moved
    # every compiled piece is traced once per shape, on any number of devices
    assert many["summary"]["traces"] == one["summary"]["traces"]
    assert all(v <= 2 for v in many["summary"]["traces"].values())  # features: test and train shapes


def test_sequential_clients_spread_over_two_devices_equal_one_device(tmp_path):
    """A lone run's sequential clients spread over 2 fake devices (Layout.client_devices, the CLI's
    CPU default): the same compiled code on each device, so the same numbers, and every piece traced
    as often as on one device. Bit for bit on some CPUs; on others the two devices' thread pools
    split a convolution differently, so the loss agrees to float32 rounding (seen: 2e-6 relative)
    and the accuracies to less than one test prediction."""
    one = _run_on_devices(1, tmp_path / "one", 1, ("sequential", "unrolled"))
    two = _run_on_devices(2, tmp_path / "two", 1, ("sequential", "unrolled"))
    assert (one["devices"], two["devices"]) == (1, 2)
    assert (one["summary"]["engine"]["client_devices"], two["summary"]["engine"]["client_devices"]) == (1, 2)
    assert two["summary"]["final_train_loss"] == pytest.approx(one["summary"]["final_train_loss"], rel=2e-5)
    for key in ["personalized_macro_accuracy", "global_macro_accuracy", "personalized_macro_accuracy_ea"]:
        assert two["summary"][key] == pytest.approx(one["summary"][key], abs=1e-3), key
    assert two["summary"]["traces"] == one["summary"]["traces"]


def test_spread_assigns_longest_first_to_the_least_loaded_device():
    from pfedkdh_jax.engine.runner import _Spread
    spread = _Spread(jax.devices()[:1] * 2)   # the assignment only counts devices
    where, order = spread.assign([3, 10, 4, 4, 1])
    assert order == [1, 2, 3, 0, 4]           # longest first, ties in client order
    assert where == [1, 0, 1, 1, 0]           # 10 | 4 + 4 + ... : loads 11 and 11
    loads = [sum(s for s, w in zip([3, 10, 4, 4, 1], where) if w == i) for i in (0, 1)]
    assert loads == [11, 11]


STACKED_SCRIPT = """
import json, sys
import jax
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import run_stacked
cfgs = [make_config("smoke", out=f"{sys.argv[1]}-{a}", alpha=a, data_seed=ds, reps_mode=sys.argv[2], num_clients=4,
                    rounds=2, local_epochs=1, ea_steps=2, chunk_steps=4, checkpoint_every=0)
        for a, ds in ((0.5, 0), (1.0, 1))]
s = run_stacked(cfgs, progress=False, log=lambda *_: None)
print(json.dumps({"devices": jax.device_count(), "summaries": s}))
"""


@pytest.mark.slow
def test_stacked_partitions_sharded_over_two_devices_match_one_device(tmp_path):
    """Two α values stacked (one repetition each) on 2 fake devices: each device runs its own
    partition's repetition; the same numbers as the two run one after another on one device."""
    def go(n, mode):
        env = {**os.environ, "XLA_FLAGS": f"--xla_force_host_platform_device_count={n}", "JAX_PLATFORMS": "cpu"}
        p = subprocess.run([sys.executable, "-c", STACKED_SCRIPT, str(tmp_path / f"d{n}"), mode],
                           capture_output=True, text=True, env=env, timeout=900)
        assert p.returncode == 0, p.stderr[-2000:]
        return json.loads(p.stdout.strip().splitlines()[-1])
    one, many = go(1, "sequential"), go(2, "vmap")
    assert (one["devices"], many["devices"]) == (1, 2)
    for a, b in zip(one["summaries"], many["summaries"]):
        # float32 rounding: the running mean of the uploads, vmapped over the two runs, rounds otherwise than
        # a solo run's (seen: 2.3e-5 relative after 2 rounds), as vmapped repetitions do (rtol 1e-4 above)
        assert b["final_train_loss"] == pytest.approx(a["final_train_loss"], rel=1e-4)
        moved = _per_client_moves(a, b)   # rounding may flip one prediction (as above)
        assert len(moved) <= 1 and all(d <= 1 / 50 for d in moved), moved
