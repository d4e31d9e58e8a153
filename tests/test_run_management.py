"""Checkpoint/resume (with real kills), refusals, divergence, config files and reports."""

import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from pfedkdh_jax.run import cli
from pfedkdh_jax.run.checkpoint import CheckpointError
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import resume

# runs are killed in a subprocess and resumed in this one: both take the package's own conv form
pytestmark = pytest.mark.usefixtures("measured_conv_form_module")

ROUNDS = 5
ARGS = ["--preset", "default", "--rounds", str(ROUNDS), "--clients", "6", "--chunk-steps", "4",
        "--ea-every", "2", "--checkpoint-every", "1", "--no-progress"]
# where a test is not about resuming, XLA's convolution (the suite's form, conftest.py; faster to compile)
XLA_CONV = ["--conv-form", "lax"]
ACCURACY_KEYS = ["personalized_macro_accuracy", "personalized_micro_accuracy", "global_macro_accuracy",
                 "personalized_macro_accuracy_ea", "train_loss", "teacher_loss"]


def rows(run_dir):
    return [json.loads(line) for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines()]


def numbers(run_dir):
    """Every accuracy/loss of every round plus the final summary values (timings excluded)."""
    per_round = [{k: r[k] for k in ACCURACY_KEYS if k in r} for r in rows(run_dir)]
    summary = json.loads((Path(run_dir) / "summary.json").read_text())
    return per_round, {k: summary[k] for k in ACCURACY_KEYS if k in summary}


LATE_COMPILE = 3   # the reference run's round that compiles something new, as a step width first met there would


@pytest.fixture(scope="module")
def reference(tmp_path_factory, measured_conv_form_module):
    import jax
    import jax.numpy as jnp

    from pfedkdh_jax.engine.runner import RoundRunner
    real = RoundRunner.round

    def round_(self, state, data, selected, key):
        if int(np.asarray(state.round)) == LATE_COMPILE - 1:   # a new function: it compiles (numbers unchanged)
            jax.jit(lambda x: x + 1)(jnp.zeros(3)).block_until_ready()
        return real(self, state, data, selected, key)
    out = tmp_path_factory.mktemp("ref") / "run"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(RoundRunner, "round", round_)
        assert cli.main(["run", *ARGS, "--out", str(out)]) == 0
    return out


def test_the_rows_mark_the_rounds_that_compiled(reference):
    """Every row whose training (evaluation) compiled says so, with JAX's compile seconds: round 1, and the
    reference's round 3, which compiles a new function as a later round meeting a new step width would
    (before, only round 1, a resumed session's first round and a phase's first were marked); evaluations
    compile at the first (round 1) and the first EA (round 2, --ea-every 2); the summary's compile seconds
    are their sum."""
    got = rows(reference)
    assert [r["round"] for r in got if r.get("compiles")] == [1, LATE_COMPILE]
    assert [r["round"] for r in got if r.get("eval_compiles")] == [1, 2]
    timed = [r["round"] for r in got if "compile_seconds" in r]
    assert timed == [1, 2, LATE_COMPILE] and all(r["compile_seconds"] > 0 for r in got if "compile_seconds" in r)
    summary = json.loads((Path(reference) / "summary.json").read_text())
    assert summary["compile_seconds"] == pytest.approx(sum(r.get("compile_seconds", 0.0) for r in got))
    # the median of the rounds that compiled nothing
    assert summary["seconds_per_round"] == pytest.approx(
        statistics.median(r["train_seconds"] for r in got if not r.get("compiles")))


def start(out, env_extra=None):
    env = {**os.environ, **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "pfedkdh_jax.run.cli", "run", *ARGS, "--out", str(out)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)


def wait_for(pred, proc, timeout=240):
    t0 = time.time()
    while not pred():
        assert proc.poll() is None, "the run ended before it could be killed"
        assert time.time() - t0 < timeout, "timed out waiting for the run"
        time.sleep(0.05)


def n_rows(out):
    p = Path(out) / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_kill_mid_round_then_resume_is_bit_identical(tmp_path, reference):
    out = tmp_path / "run"
    proc = start(out)
    wait_for(lambda: n_rows(out) >= 2, proc)   # round 2 done and checkpointed soon; round 3 under way
    time.sleep(0.3)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert n_rows(out) < ROUNDS
    summary = resume(str(out), progress=False, log=lambda *_: None)
    assert summary["status"] == "completed"
    assert numbers(out) == numbers(reference)
    # the whole run's time counts the killed session's rounds too (by their rows), this session's apart
    assert summary["total_seconds"] > summary["session_seconds"] > 0
    assert summary["total_seconds"] >= sum(r["seconds"] for r in rows(out)[:2]) + summary["session_seconds"]
    # round 1 and the resumed session's first round compiled: their rows say so (the median leaves them out)
    marked = [r["round"] for r in rows(out) if r.get("compiles")]
    assert marked[0] == 1 and len(marked) == 2 and 2 <= marked[1] <= ROUNDS, marked
    # a complete run resumes to nothing: its summary is left as it is
    before, said = (out / "summary.json").read_text(), []
    assert resume(str(out), progress=False, log=said.append)["status"] == "completed"
    assert (out / "summary.json").read_text() == before
    assert said == [f"{out}: already complete ({ROUNDS} rounds); nothing to resume"]
    # killed in its last writes (after summary.json, before curves.png; its lock left behind): resume draws
    # the figure and removes the dead process's lock (before: "already complete", and neither)
    (out / "curves.png").unlink()
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (out / "run.lock").write_text(f"{socket.gethostname()} {dead.pid}")
    resume(str(out), progress=False, log=said.append)
    assert (out / "curves.png").stat().st_size > 1000 and not (out / "run.lock").exists()
    assert (out / "summary.json").read_text() == before


def test_kill_mid_save_then_resume_is_bit_identical(tmp_path, reference):
    out = tmp_path / "run"
    proc = start(out, {"PFEDKDH_TEST_SAVE_PAUSE": "30"})
    ckpt = out / "checkpoints"
    # the first save pauses 30 s between writing its files and renaming them into place
    wait_for(lambda: ckpt.is_dir() and any((p / "meta.json").exists() for p in ckpt.glob(".tmp-*")), proc)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not list(ckpt.glob("round_*"))      # no half checkpoint under a real name
    messages = []
    resume(str(out), progress=False, log=messages.append)
    assert any("no usable checkpoint" in m for m in messages)
    assert not list(ckpt.glob(".tmp-*"))
    assert numbers(out) == numbers(reference)


def test_corrupt_checkpoint_falls_back_to_previous(tmp_path, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()   # killed after its last checkpoint (a complete run resumes to nothing)
    ckpts = sorted((out / "checkpoints").glob("round_*"))
    assert [p.name for p in ckpts] == ["round_000004", "round_000005"]
    for f in (ckpts[-1] / "state").rglob("*"):
        if f.is_file():
            f.write_bytes(f.read_bytes()[: len(f.read_bytes()) // 3])
    messages = []
    resume(str(out), progress=False, log=messages.append)
    assert any("round_000005" in m and "previous" in m for m in messages)
    assert any("after round 4" in m for m in messages)
    assert numbers(out) == numbers(reference)


def test_checkpoint_of_another_config_is_refused(tmp_path, reference):
    out = tmp_path / "run"
    shutil.copytree(reference, out)
    (out / "summary.json").unlink()   # killed after its last checkpoint (a complete run resumes to nothing)
    cfg = json.loads((out / "config.json").read_text())
    cfg["lam"] = 0.9
    (out / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="different config"):
        resume(str(out), progress=False, log=lambda *_: None)
    # a fresh run into a directory holding checkpoints is refused too
    assert cli.main(["run", *ARGS, "--out", str(out)]) == 2


def test_divergence_names_round_and_clients_and_keeps_results(tmp_path, capsys):
    out = tmp_path / "run"
    rc = cli.main(["run", "--preset", "smoke", "--lr", "10", "--out", str(out), "--no-progress", *XLA_CONV])
    assert rc == 3
    err = capsys.readouterr().err
    assert "round 1" in err and "client(s)" in err
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "diverged at round 1"
    assert len(rows(out)) == 1
    # neither a second run there nor a resume offers to continue it (before: "continue it with pfedkdh resume",
    # which replayed the options into the same divergence)
    assert cli.main(["run", "--preset", "smoke", "--lr", "10", "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {out} already holds a pfedkdh run that diverged at round 1 (1 rounds kept)" in err
    assert "pfedkdh resume" not in err and err.count("\n") == 1
    assert cli.main(["resume", str(out), "--no-progress"]) == 2
    assert "the run diverged at round 1; resuming it replays its stored options to the same end" in capsys.readouterr().err
    # a sweep meeting such a point leaves it as it is (before: resumed it into the same divergence)
    from pfedkdh_jax.run.sweep import _status
    assert _status(str(out)) == "ended"
    summary["status"] = "stopped at round 1"   # out of a method's rows: likewise
    (out / "summary.json").write_text(json.dumps(summary))
    assert _status(str(out)) == "ended"
    assert cli.main(["resume", str(out), "--no-progress"]) == 2
    assert "the run stopped at round 1; resuming it replays" in capsys.readouterr().err


def test_same_config_and_seeds_reproduce_the_summary(tmp_path, reference):
    out = tmp_path / "again"
    assert cli.main(["run", *ARGS, "--out", str(out)]) == 0
    assert numbers(out) == numbers(reference)
    env = json.loads((out / "config.json").read_text())["environment"]
    assert {"jax", "flax", "optax", "backend", "device_kind", "git_commit"} <= set(env)


def test_a_fresh_run_never_writes_over_a_run_or_a_sweep(tmp_path, reference, capsys):
    """Refused before anything loads: the directory of a finished run, and a sweep's; a sweep into a
    run's directory (finished, or one whose run.lock says it is running) likewise."""
    before = (reference / "summary.json").read_text()
    assert cli.main(["run", "--preset", "smoke", "--rounds", "1", "--out", str(reference), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"--out {reference} already holds a completed pfedkdh run ({ROUNDS} rounds): choose another" in err
    assert "resume" not in err and err.count("\n") == 1   # a finished run has nothing to continue
    assert (reference / "summary.json").read_text() == before
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "sweep.json").write_text("{}")
    assert cli.main(["run", "--preset", "smoke", "--rounds", "1", "--out", str(sweep), "--no-progress"]) == 2
    assert "holds a sweep (sweep.json)" in capsys.readouterr().err
    assert sorted(p.name for p in sweep.iterdir()) == ["sweep.json"]
    files = sorted(p.name for p in reference.iterdir())
    assert cli.main(["sweep", "--preset", "smoke", "--rounds", "1", "--out", str(reference), "--no-progress"]) == 2
    assert f"--out {reference} holds a run (config.json): give the sweep a directory of its own" in capsys.readouterr().err
    assert sorted(p.name for p in reference.iterdir()) == files
    starting = tmp_path / "starting"
    starting.mkdir()
    import socket
    (starting / "run.lock").write_text(f"{socket.gethostname()} {os.getpid()}")   # a live process, starting
    assert cli.main(["sweep", "--preset", "smoke", "--out", str(starting), "--no-progress"]) == 2
    assert "holds a run (run.lock)" in capsys.readouterr().err
    assert cli.main(["resume", str(starting), "--no-progress"]) == 2
    assert "no config.json yet: the run there is starting now" in capsys.readouterr().err
    (starting / "run.lock").write_text(f"{socket.gethostname()} 4194305")   # above Linux's pid_max: gone
    assert cli.main(["resume", str(starting), "--no-progress"]) == 2
    assert "no config.json: the run there stopped before it started; run its command again" in capsys.readouterr().err
    # a run stopped early removes the folders it made for --out, not the ones that were there
    assert cli.main(["run", "--aux-size", "1797", "--no-progress", "--out", str(tmp_path / "n" / "a" / "b")]) == 2
    assert not (tmp_path / "n").exists()


def test_config_files(tmp_path):
    js = tmp_path / "c.json"
    js.write_text(json.dumps({"rounds": 3, "lam": 0.25}))
    py = tmp_path / "c.py"
    py.write_text("def get_config(smoke=False):\n    return {'rounds': 2 if smoke else 4, 'mu': 0.5}\n")
    assert cli.load_config_file(str(js)) == {"rounds": 3, "lam": 0.25}
    assert cli.load_config_file(str(py)) == {"rounds": 4, "mu": 0.5}
    assert cli.load_config_file(str(py), smoke=True) == {"rounds": 2, "mu": 0.5}   # --preset smoke
    plain = tmp_path / "plain.py"
    plain.write_text("def get_config():\n    return {'rounds': 5}\n")
    assert cli.load_config_file(str(plain), smoke=True) == {"rounds": 5}
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"alpha": -1}))
    assert cli.main(["run", "--config", str(bad), "--no-progress"]) == 2
    cfg = make_config("default", **{**cli.load_config_file(str(js)), "rounds": 9})
    assert (cfg.rounds, cfg.lam) == (9, 0.25)


def test_report_table_and_figures(tmp_path, reference, capsys):
    assert cli.main(["report", str(reference), "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "| pfedkdh | digits |" in out
    assert (tmp_path / "comparison.png").stat().st_size > 1000
    assert (tmp_path / f"clients-{Path(reference).name}.png").stat().st_size > 1000   # into --out, not the run
    assert cli.main(["report", str(tmp_path / "nothing")]) == 2
    # two sweeps' points of one name are told apart, and a method's own options shown
    from pfedkdh_jax.run.report import table
    runs = [{"dir": f"/w/{s}/points/digits-a0.1-fedprox", "rows": [], "summary": {"status": "completed"},
             "config": {"method": "fedprox", "method_args": [["mu", mu]], "dataset": "digits", "alpha": 0.1}}
            for s, mu in (("s1", "0.1"), ("s2", "0.01"))]
    text = table(runs)
    assert "| s1/points/digits-a0.1-fedprox | fedprox mu=0.1 |" in text
    assert "| s2/points/digits-a0.1-fedprox | fedprox mu=0.01 |" in text
    # pFedKDH's own options are run options: those away from their defaults named too (λ = 0.5, the paper's form)
    kdh = [{"dir": f"/w/{n}", "rows": [], "summary": {"status": "completed"},
            "config": {"method": "pfedkdh", "lam": lam, "temperature": 4.0, "dataset": "digits", "alpha": 0.1}}
           for n, lam in (("a", 0.0), ("b", 0.5))]
    text = table(kdh)
    assert "| a | pfedkdh | digits |" in text and "| b | pfedkdh lam=0.5 | digits |" in text
    # a run that did not complete says so; one of one round marks its time, which includes compiling
    runs[0]["summary"] = {"status": "diverged at round 1", "seconds_per_round": 22.1,
                          "seconds_per_round_includes_compile": True}
    runs[1]["summary"] = {}
    text = table(runs)
    assert "| s1/points/digits-a0.1-fedprox (diverged at round 1) | fedprox mu=0.1 |" in text and "22.10 † |" in text
    assert "| s2/points/digits-a0.1-fedprox (interrupted: no summary) |" in text
    assert text.endswith("† a run whose every round compiled (one round, say): its seconds per round include compiling")
    # a run of repetitions keeps each one's per-client accuracies under "repetitions": their mean ± std is drawn
    # (no clients.png before, without a word)
    from pfedkdh_jax.run.report import _per_client, clients_figure
    reps = {"repetitions": [{"per_client_personalized_accuracy": [0.5, 0.7, None]},
                            {"per_client_personalized_accuracy": [0.7, 0.9, None]}],
            "partition": {"label_histogram": [[1, 2], [3, 0], [0, 4]]}}
    mean, std = _per_client(reps)
    assert mean[:2] == pytest.approx([0.6, 0.8]) and std[:2] == pytest.approx([0.1, 0.1]) and mean[2] is std[2] is None
    path = tmp_path / "clients-reps.png"
    assert clients_figure({"summary": reps, "config": {"method": "fedrep"}}, str(path)) and path.stat().st_size > 1000


def test_checkpoint_files_hold_the_state_and_refuse_another_shape(tmp_path):
    """A checkpoint's leaves come back as saved, placed like the target; one whose leaves do not fit
    the run's state is skipped for the previous one; a checkpoint written by orbax (the earlier
    format: a state/ folder of its own) is still read."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    import orbax.checkpoint as ocp

    from pfedkdh_jax.run.checkpoint import Checkpoints

    fp = {"config": "c", "partition": "p", "dataset": "d", "method": "m"}
    state = {"w": jnp.arange(6.0).reshape(2, 3), "n": jnp.int32(7), "h": jnp.ones(4, jnp.float16)}
    messages = []
    ck = Checkpoints(str(tmp_path / "run"), fp, keep=3, log=messages.append)
    ck.save(1, state, [{"round": 1}])
    rnd, got, history = ck.restore_latest(state)
    assert rnd == 1 and history == [{"round": 1}]
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(state)):
        assert isinstance(a, jax.Array) and a.dtype == b.dtype and np.array_equal(a, b)
    # round 2 saved from a state of another shape: refused, round 1 restored instead
    ck.save(2, {**state, "w": jnp.zeros((3, 3))}, [])
    assert ck.restore_latest(state)[0] == 1
    assert any("round_000002" in m and "float32[3, 3]" in m for m in messages), messages
    # round 3 in orbax's layout
    ck.save(3, state, [{"round": 3}])
    folder = tmp_path / "run" / "checkpoints" / "round_000003" / "state"
    shutil.rmtree(folder)
    saver = ocp.StandardCheckpointer()
    saver.save(str(folder), jax.device_get({**state, "w": state["w"] + 1}))
    saver.wait_until_finished()
    rnd, got, _ = ck.restore_latest(state)
    assert rnd == 3 and np.array_equal(got["w"], state["w"] + 1)


def test_eval_seconds_median_counts_only_the_rounds_that_evaluated():
    """With --eval-every 3 most rows carry no evaluation (eval_seconds ≈ 0): the summary's median is
    over the evaluating rows, the first of them (which compiles) left out when there are others."""
    import types

    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.run import records

    cfg = make_config("default", rounds=6, eval_every=3)
    runner = types.SimpleNamespace(layout=Layout(), traces={})
    history = []
    for t in range(1, 7):
        row = {"round": t, "train_loss": 0.5, "train_seconds": 2.0, "eval_seconds": 1e-4, "seconds": 2.0}
        if t % 3 == 0:
            row.update(eval_seconds={3: 9.0, 6: 1.5}[t], personalized_macro_accuracy=0.5)
        history.append(row)
    summary = records.summary(cfg, history, {}, runner, status="completed")
    assert summary["evaluations"] == 2
    assert summary["eval_seconds_median"] == 1.5
    alone = records.summary(cfg, history[:3], {}, runner, status="completed")
    assert (alone["evaluations"], alone["eval_seconds_median"]) == (1, 9.0)


def test_compile_seconds_from_rows_measured_and_from_before_the_measurement():
    """Rows written before rows carried JAX's compile seconds: round 1 compiled, its compile time is
    round 1 less the later rounds' median, so a one-round run has none to report (null, not 0) and says
    its seconds_per_round includes compilation. The rows a resumed session compiled in are marked and
    left out of the medians too, and their compile time counts (estimated so, or measured when the
    resuming code measures it)."""
    import types

    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.run import records

    cfg = make_config("default", rounds=3)
    runner = types.SimpleNamespace(layout=Layout(), traces={})
    history = [{"round": t, "train_loss": 0.5, "train_seconds": s, "eval_seconds": 0.1, "seconds": s}
               for t, s in [(1, 7.0), (2, 2.0), (3, 2.0)]]
    three = records.summary(cfg, history, {}, runner, status="completed")
    assert (three["seconds_per_round"], three["compile_seconds"]) == (2.0, 5.0)
    assert three["seconds_per_round_includes_compile"] is False
    one = records.summary(cfg, history[:1], {}, runner, status="completed")
    assert (one["seconds_per_round"], one["compile_seconds"]) == (7.0, None)
    assert one["seconds_per_round_includes_compile"] is True
    # resumed at round 3: that session's first round and its first evaluation compiled again, and the
    # rows say so; the medians leave them out (before: 3.0 s a round and 2.0 s an evaluation)
    resumed = [{**r, "eval_seconds": 1.0, "personalized_macro_accuracy": 0.5} for r in history] + [
        {"round": t, "train_loss": 0.5, "train_seconds": s, "eval_seconds": e, "seconds": s,
         "personalized_macro_accuracy": 0.5, **marks}
        for t, s, e, marks in [(4, 6.0, 9.0, {"compiles": True, "eval_compiles": True}), (5, 3.0, 2.0, {}),
                               (6, 3.0, 2.0, {})]]
    again = records.summary(cfg, resumed, {}, runner, status="completed")
    # round 1's 7.0 and round 4's 6.0 less the median 2.5 (before: round 1's only, 4.5)
    assert (again["seconds_per_round"], again["compile_seconds"], again["eval_seconds_median"]) == (2.5, 8.0, 1.5)
    assert again["seconds_per_round_includes_compile"] is False
    # resumed by today's code: its compiling row carries its measured seconds, added to the older estimate
    resumed[3]["compile_seconds"] = 3.25
    assert records.summary(cfg, resumed, {}, runner, status="completed")["compile_seconds"] == 4.5 + 3.25
    # every row measured: the sum, a one-round run included
    measured = [{**r, "compile_seconds": 5.0} if r["round"] == 1 else r for r in history]
    assert records.summary(cfg, measured, {}, runner, status="completed")["compile_seconds"] == 5.0
    assert records.summary(cfg, measured[:1], {}, runner, status="completed")["compile_seconds"] == 5.0


def test_a_run_directory_in_use_is_refused_and_a_stale_lock_taken_over(tmp_path, capsys):
    import socket
    out = tmp_path / "run"
    out.mkdir()
    (out / "run.lock").write_text(f"{socket.gethostname()} {os.getpid()}")   # a live process holds it
    rc = cli.main(["run", "--preset", "smoke", "--rounds", "1", "--out", str(out), "--no-progress", *XLA_CONV])
    err = capsys.readouterr().err
    assert rc == 2 and "is in use by process" in err and err.count("\n") == 1
    assert not (out / "metrics.jsonl").exists()
    (out / "run.lock").write_text(f"{socket.gethostname()} 999999999")       # its process is gone
    assert cli.main(["run", "--preset", "smoke", "--rounds", "1", "--out", str(out), "--no-progress", *XLA_CONV]) == 0
    assert not (out / "run.lock").exists() and (out / "summary.json").exists()
    assert '"seconds_per_round_includes_compile": true' in capsys.readouterr().out   # one round: compiling
