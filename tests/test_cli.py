"""The command line: a smoke run on the embedded set, and bad input failing with one clear line."""

import json
import os
import subprocess
import sys

import pytest

from pfedkdh_jax.run import cli
from pfedkdh_jax.run.config import ConfigError, make_config, method_arg_pairs

SUMMARY_KEYS = ["personalized_macro_accuracy", "personalized_micro_accuracy", "global_macro_accuracy",
                "global_micro_accuracy", "personalized_macro_accuracy_ea", "personalized_micro_accuracy_ea"]


def test_smoke_run_writes_the_run_directory(tmp_path, capsys, measured_conv_form):
    out = tmp_path / "run"
    rc = cli.main(["run", "--preset", "smoke", "--out", str(out), "--no-progress", "--chunk-steps", "4"])
    assert rc == 0
    assert "demo set" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    for key in SUMMARY_KEYS:
        assert 0.0 <= summary[key] <= 1.0, key
        assert 0.0 <= summary[f"best_{key}"] <= 1.0
    assert summary["rounds_completed"] == 2 and summary["status"] == "completed"
    assert len(summary["per_client_personalized_accuracy"]) == 10
    assert summary["partition"]["num_clients"] == 10
    assert summary["seconds_per_round"] > 0 and summary["compile_seconds"] >= 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["round"] for r in rows] == [1, 2]
    assert all("train_loss" in r and "seconds" in r for r in rows)
    config = json.loads((out / "config.json").read_text())
    assert config["dataset"] == "digits" and config["rounds"] == 2
    assert config["engine"]["conv_form"] == "winograd"   # the CPU's default form, run end to end
    assert (out / "curves.png").stat().st_size > 1000


@pytest.mark.parametrize("args, option", [
    (["--dataset", "imagenet"], "--dataset"),
    (["--method", "fedfoo"], "--method"),
    (["--method", "FedAvgg"], "got 'FedAvgg'; did you mean 'fedavg'?"),
    (["--dataset", "Fashion_MNST"], "got 'Fashion_MNST'; did you mean 'fashion_mnist'?"),
    (["--alpha", "0"], "--alpha"),
    (["--clients", "1"], "--clients"),
    (["--participation", "1.5"], "--participation"),
    (["--participation", "0"], "--participation"),
    (["--participation", "0.3", "--clients-per-round", "4"],
     "give --participation (0.3) or --clients-per-round (4), not both"),
    (["--batch-size", "0"], "--batch-size"),
    (["--lam", "2"], "--lam"),
    (["--kd-target", "everything"], "--kd-target"),
    (["--kd-gate", "always"], "--kd-gate"),
    (["--ea-lr", "0"], "--ea-lr"),
    (["--ea-epochs", "-1"], "--ea-epochs"),
    (["--aux-size", "1797"], "--aux-size"),
    (["--clients", "200", "--min-client-samples", "10"], "--clients * --min-client-samples must be <= 1497 (the "
                                                         "samples left after --aux-size 300;"),   # the flags' names
    (["--clients", "40", "--min-client-samples", "2", "--alpha", "0.01", "--fill", "redraw"],
     "lower --min-client-samples, raise --alpha, use fewer clients or --fill top_up"),
    (["--dataset", "cifar10", "--data-dir", "."], "download_and_prepare"),
    (["--client-devices", "0"], "--client-devices"),
    (["--preset", "smoke", "--client-devices", "3"], "--client-devices"),   # this process has 1 device
])
def test_bad_input_is_one_clear_line(args, option, capsys, tmp_path):
    rc = cli.main(["run", "--no-progress", "--out", str(tmp_path / "unused"), *args])   # (a lock may be taken)
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pfedkdh: error:") and option in err
    assert not (tmp_path / "unused").exists()   # no empty run directory left behind


@pytest.mark.parametrize("flag", ["--lr", "--alpha", "--mu", "--lam"])
@pytest.mark.parametrize("value", ["inf", "nan", "-inf"])
def test_non_finite_numbers_are_rejected(flag, value, capsys, tmp_path):
    rc = cli.main(["run", "--no-progress", "--out", str(tmp_path / "unused"), f"{flag}={value}"])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pfedkdh: error:") and flag in err and "finite" in err


def test_unwritable_out_is_one_clear_line(tmp_path, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    rc = cli.main(["run", "--no-progress", "--preset", "smoke", "--out", str(blocker / "run")])
    assert rc == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("pfedkdh: error: --out") and "not a directory" in err and err.count("\n") == 0


@pytest.mark.parametrize("flags", [["--kd-target", "support"], ["--average-heads"], ["--mu", "0.5"],
                                   ["--warmup-epochs", "1"], ["--ea-steps", "0"]])
def test_pfedkdh_only_flags_are_rejected_with_other_methods(flags, capsys):
    """A method-specific run option that the chosen method does not read is an error, not ignored."""
    rc = cli.main(["run", "--no-progress", "--out", "unused", "--method", "fedavg", *flags])
    assert rc == 2
    err = capsys.readouterr().err
    assert f"{flags[0]} is an option of pfedkdh; --method fedavg does not use it" in err


def test_a_pfedkdh_flag_named_like_a_methods_own_option_points_to_it(capsys):
    assert cli.main(["run", "--no-progress", "--method", "fedprox", "--mu", "0.5"]) == 2
    assert capsys.readouterr().err.strip().endswith("--method fedprox does not use it (its own mu: "
                                                    "--method-arg fedprox:mu=0.5, in a run or a sweep)")
    # which a run takes as the sweep writes it (the method's name as prefix, any case), or bare
    for key in ("FedProx:mu", "mu"):
        assert make_config("smoke", method="fedprox", method_args=((key, "0.5"),)).method_args == (("mu", "0.5"),)
    with pytest.raises(ConfigError, match="'fedavg:mu' is not an option of fedprox .*; this run's method is fedprox"):
        make_config("smoke", method="fedprox", method_args=(("fedavg:mu", "0.5"),))
    with pytest.raises(ConfigError, match=r"'zz' is not an option of pfedkdh \(it takes no --method-arg; its options "
                                          r"are the run's flags"):
        make_config("smoke", method="pfedkdh", method_args=(("zz", "1"),))
    # one option twice on the command line (the prefixed form too): named, not the last taken without a word
    assert cli.main(["run", "--no-progress", "--method", "fedprox", "--method-arg", "mu=0.1",
                     "--method-arg", "fedprox:mu=0.2"]) == 2
    assert capsys.readouterr().err.strip() == "pfedkdh: error: --method-arg mu is given 2 times (0.1, 0.2): give it once"
    assert cli.main(["sweep", "--datasets", "digits", "--methods", "fedprox", "--method-arg", "fedprox:mu=0.1",
                     "--method-arg", "fedprox:mu=0.2"]) == 2
    assert "--method-arg mu is given 2 times (0.1, 0.2): give it once" in capsys.readouterr().err
    # an unknown option given twice is named as unknown first; a repeat through make_config or a file is named too
    assert cli.main(["run", "--no-progress", "--method", "fedprox", "--method-arg", "zz=1",
                     "--method-arg", "zz=2"]) == 2
    assert "'zz' is not an option of fedprox" in capsys.readouterr().err
    with pytest.raises(ConfigError, match=r"--method-arg mu is given 2 times \(0.1, 0.2\): give it once"):
        make_config("smoke", method="fedprox", method_args=(("mu", "0.1"), ("FedProx:mu", "0.2")))
    # a file's method options as {key: value} or pairs; a sweep file's per method (sweep.json's list form too)
    assert method_arg_pairs({"mu": 0.5}) == method_arg_pairs([["mu", "0.5"]]) == (("mu", "0.5"),)
    assert cli._sweep_method_args({"fedprox": {"mu": 0.1}}) == cli._sweep_method_args([["fedprox", [["mu", "0.1"]]]]) \
        == {"fedprox": [("mu", "0.1")]}
    # a flag over a --config file's value of the same option: the flag's, the file's others kept
    assert cli._flags_over_file([("mu", "0.1"), ("x", "1")], [("fedprox:mu", "0.01")]) == (("x", "1"),
                                                                                            ("fedprox:mu", "0.01"))


def test_a_sweep_file_with_method_options_is_read(tmp_path, capsys):
    """A sweep --config file's method_args ({method: {key: value}}) reach the sweep (an AttributeError
    before, whatever the rest), a flag's value replacing the file's however the method is spelled (FedProx:
    was a second mu); here the sweep stops at the next check, an unknown dataset."""
    spec = tmp_path / "sweep.json"
    spec.write_text(json.dumps({"methods": ["fedprox"], "method_args": {"fedprox": {"mu": 0.1}}}))
    assert cli.main(["sweep", "--config", str(spec), "--datasets", "nosuchset", "--method-arg", "FedProx:mu=0.01",
                     "--out", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err
    assert "--dataset must be one of" in err and "given 2 times" not in err


def test_the_count_of_clients_from_flags_file_and_rounding(tmp_path, monkeypatch, capsys, registry):
    """A --participation flag wins over a --config file's per_round (which, as a count, would have won
    over it without a word), as it does over a dataset preset's and a sweep's; one source giving both is
    refused; ρ × K rounds as Python's round (halves to even: a resumed run keeps its count)."""
    from pfedkdh_jax.run import experiment
    seen = []
    monkeypatch.setattr(experiment, "run", lambda cfg, **_: seen.append(cfg) or {"out": cfg.out})
    count = tmp_path / "count.json"
    count.write_text(json.dumps({"per_round": 3}))
    share = tmp_path / "share.json"
    share.write_text(json.dumps({"participation": 0.3}))
    both = tmp_path / "both.json"
    both.write_text(json.dumps({"participation": 0.3, "per_round": 3}))
    run = ["run", "--preset", "smoke", "--no-progress", "--out", str(tmp_path / "r")]   # digits: 10 clients
    assert cli.main([*run, "--config", str(count), "--participation", "0.5"]) == 0
    assert cli.main([*run, "--config", str(share), "--clients-per-round", "4"]) == 0
    assert cli.main([*run, "--config", str(count)]) == 0
    assert [c.clients_per_round for c in seen] == [5, 4, 3]
    preset = tmp_path / "preset.json"   # a file's preset gives way to a --preset flag, as its options do
    preset.write_text(json.dumps({"preset": "smoke"}))
    plain = ["run", "--no-progress", "--out", str(tmp_path / "r")]
    assert cli.main([*plain, "--config", str(preset)]) == 0
    assert cli.main([*plain, "--config", str(preset), "--preset", "default"]) == 0
    assert [c.rounds for c in seen[-2:]] == [2, 20]
    py = tmp_path / "smoke_file.py"   # a .py file naming the smoke preset is asked for its smoke values
    py.write_text("def get_config(smoke=False):\n    return {'preset': 'smoke', 'local_epochs': 1 if smoke else 5}\n")
    assert cli.main([*plain, "--config", str(py)]) == 0
    assert (seen[-1].rounds, seen[-1].local_epochs) == (2, 1)
    assert cli.main([*run, "--config", str(both)]) == 2
    assert "give participation (0.3) or per_round (3), not both" in capsys.readouterr().err
    assert make_config("smoke", num_clients=25, participation=0.5).clients_per_round == 12
    assert make_config("smoke", num_clients=30, participation=0.6).clients_per_round == 18
    assert make_config("smoke", num_clients=30, participation=0.01).clients_per_round == 1
    from pfedkdh_jax.data.sources import register_dataset
    from pfedkdh_jax.run import sweep
    from pfedkdh_jax.data import load_pool
    register_dataset("counted", lambda: load_pool("digits"), preset=dict(per_round=3))
    assert make_config("smoke", dataset="counted").clients_per_round == 3
    assert make_config("smoke", dataset="counted", participation=0.5).clients_per_round == 10   # 20 clients
    grid = sweep.make_sweep(datasets=["digits"], alphas=[0.5], methods=["fedavg"], preset="smoke",
                            grid={"per_round": [0, 3]}, options={"participation": 0.5})
    assert [c.clients_per_round for _, c in sweep.points(grid, str(tmp_path / "s"))] == [5, 3]


def test_ctrl_c_says_how_to_go_on(tmp_path, monkeypatch, capsys):
    """A KeyboardInterrupt in a run is one line naming the resume command (exit 130), not a traceback;
    before the run wrote its config there is nothing to resume, and the line says so."""
    from pfedkdh_jax.run import experiment

    def interrupted(cfg, **_):
        raise KeyboardInterrupt
    monkeypatch.setattr(experiment, "run", interrupted)
    out = tmp_path / "run"
    assert cli.main(["run", "--preset", "smoke", "--out", str(out), "--no-progress"]) == 130
    assert capsys.readouterr().err.strip() == (f"pfedkdh: interrupted; the run stopped before it started ({out} "
                                               "holds nothing to resume): run the same command again")
    out.mkdir()
    (out / "config.json").write_text("{}")   # a run that had started
    assert cli.main(["run", "--preset", "smoke", "--out", str(out), "--no-progress"]) == 130
    assert capsys.readouterr().err.strip() == (f"pfedkdh: interrupted; `pfedkdh resume {out}` continues the run "
                                               "from its last checkpoint")
    assert cli.main(["run", "--preset", "smoke", "--out", str(out), "--checkpoint-every", "0", "--no-progress"]) == 130
    assert "kept no checkpoints (--checkpoint-every 0)" in capsys.readouterr().err
    # SIGTERM (kill, timeout) stops as Ctrl-C does: one line, exit 143, the handler given back after
    import signal

    def killed(cfg, **_):
        os.kill(os.getpid(), signal.SIGTERM)
    monkeypatch.setattr(experiment, "run", killed)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["run", "--preset", "smoke", "--out", str(out), "--no-progress"]) == 143
    assert capsys.readouterr().err.strip().startswith(f"pfedkdh: terminated; `pfedkdh resume {out}` continues")
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_flag_is_taken_by_its_whole_name_only(capsys):
    """``--round 1`` ran as ``--rounds 1`` before (argparse's prefixes)."""
    with pytest.raises(SystemExit) as e:
        cli.main(["run", "--round", "1", "--no-progress"])
    assert e.value.code == 2
    assert "unrecognized arguments: --round 1; did you mean --rounds?" in capsys.readouterr().err


def test_bad_input_fails_before_importing_jax():
    code = ("import sys; from pfedkdh_jax.run import cli; rc = cli.main(['run', '--alpha', '-1']); "
            "print('jax' in sys.modules); sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 2
    assert p.stdout.strip() == "False"
    assert p.stderr.count("\n") == 1 and "--alpha must be > 0" in p.stderr


def test_cli_asks_for_one_cpu_device_per_core_up_to_two_unless_the_user_set_a_count():
    code = ("import os, sys; from pfedkdh_jax.engine.cpu_devices import request_cpu_devices as r; "
            "os.environ.pop('XLA_FLAGS', None); a = r(); f = os.environ['XLA_FLAGS']; "
            "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=5'; "
            "print(a, f, r(), r(3), os.environ['XLA_FLAGS'], 'jax' in sys.modules)")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    cores = min(2, len(os.sched_getaffinity(0)))
    assert p.stdout.split() == [str(cores), f"--xla_force_host_platform_device_count={cores}", "None", "None",
                                "--xla_force_host_platform_device_count=5", "False"], p.stderr
    # in this process JAX's backends are up: asking changes nothing
    import jax
    jax.devices()
    from pfedkdh_jax.engine.cpu_devices import request_cpu_devices
    flags = os.environ.get("XLA_FLAGS")
    os.environ["XLA_FLAGS"] = ""
    try:
        assert request_cpu_devices(4) is None and os.environ["XLA_FLAGS"] == ""
    finally:
        os.environ["XLA_FLAGS"] = flags



def test_more_client_devices_than_cores_is_noted(monkeypatch):
    """--client-devices beyond the cores makes that many XLA:CPU devices (asked for): the run's log says
    they share the cores (nothing was said before)."""
    from pfedkdh_jax.engine import cpu_devices
    monkeypatch.setattr(cpu_devices, "usable_cores", lambda: 2)
    assert cpu_devices.oversubscribed(2) is None
    assert cpu_devices.oversubscribed(5) == ("sequential clients spread over 5 XLA:CPU devices that share the 2 "
                                             "core(s) this process may use (one device per core: the choice "
                                             "measured on 2 cores; --client-devices 2)")


def test_presets():
    paper = make_config("paper", dataset="cifar100")
    assert (paper.rounds, paper.local_epochs, paper.num_clients, paper.clients_per_round) == (70, 5, 20, 10)
    assert make_config("paper", dataset="mnist", rounds=7).rounds == 7
    with pytest.raises(ConfigError, match="--preset"):
        make_config("fast")
    # Python's names: the field behind a flag of another name, or the nearest field
    with pytest.raises(ConfigError, match=r"unknown option\(s\): clients; did you mean 'num_clients'\?"):
        make_config(clients=100)
    with pytest.raises(ConfigError, match=r"unknown option\(s\): roundz; did you mean 'rounds'\?"):
        make_config(roundz=3)


def test_lanes_run_from_the_cli_where_the_cpu_has_two_devices(tmp_path):
    """--lanes packs a round's work on one device: on the CLI's two CPU devices it runs without a device
    mesh (it used to stop with a traceback), with a repetition axis too."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=2")
    for extra in ([], ["--reps", "2"]):
        p = subprocess.run([sys.executable, "-m", "pfedkdh_jax", "run", "--dataset", "digits", "--rounds", "1",
                            "--clients", "40", "--participation", "0.1",   # 4 a round: a mesh would split them
                            "--lanes", "2", "--client-parallel", "vmap", "--step-loop", "scan", "--no-progress",
                            *(["--ea-steps", "0"] if not extra else []),   # EA in the pass with repetitions only
                            "--checkpoint-every", "0", "--out", str(tmp_path / f"run{len(extra)}"), *extra],
                           capture_output=True, text=True, timeout=600, env=env)
        assert p.returncode == 0, p.stderr[-1500:]
        summary = json.loads((tmp_path / f"run{len(extra)}" / "summary.json").read_text())
        assert summary["status"] == "completed"


@pytest.mark.parametrize("argv, message", [
    (["run", "--rouds", "2"], "pfedkdh run: error: unrecognized arguments: --rouds 2; did you mean --rounds?"),
    (["sweep", "--seeds", "0,1,2"], "pfedkdh sweep: error: argument --seeds: invalid int value: '0,1,2'"),
    (["run", "--preset", "papr"], "pfedkdh run: error: argument --preset: invalid choice: 'papr'"),
    # a run's repetitions are a sweep's seeds per point: each command names the other's flag
    (["sweep", "--reps", "2"], "pfedkdh sweep: error: unrecognized arguments: --reps 2; did you mean --seeds?"),
    (["run", "--seeds", "2"], "pfedkdh run: error: unrecognized arguments: --seeds 2; did you mean --reps?"),
])
def test_a_mistyped_flag_is_one_line_from_its_command(argv, message, capsys):
    with pytest.raises(SystemExit) as stop:
        cli.main(argv)
    err = capsys.readouterr().err
    assert stop.value.code == 2 and err.startswith(message) and err.count("\n") == 1
    assert f"(`pfedkdh {argv[0]} --help` lists the options)" in err


def test_help_states_each_default_once_and_every_methods_own_options(capsys):
    with pytest.raises(SystemExit):
        cli.main(["run", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    import re
    assert "(default: None)" not in text and not re.search(r"\(default[ :][^)]*\) \(default", text)
    assert "with --optimizer momentum (default 0.9) --" in text
    assert "fedprox: mu;" in text and "fedrep: head_epochs;" in text
    assert ("shortened (fedrep: head_epochs=2, fedbabu: finetune_epochs=1, pfedme: inner_steps=2, "
            "fedfed: feature_rounds=1)") in text


def test_resume_takes_a_data_dir_where_the_stored_one_does_not_resolve(tmp_path, monkeypatch, capsys):
    """A run's stored --data-dir may be relative (README's ../shared/data/tfds) and read from elsewhere, or
    point at another machine: `resume RUN --data-dir DIR` (and --cache-dir) replaces it (before: not an
    option, and the stored path won over $TFDS_DATA_DIR); a data dir that does not exist says so, not that
    the dataset needs preparing."""
    from pfedkdh_jax.data.sources import DataError, load_pool
    from pfedkdh_jax.run import experiment
    seen = {}
    monkeypatch.setattr(experiment, "resume", lambda run_dir, progress=True, **kw: seen.update(kw, run_dir=run_dir) or {"out": run_dir})
    assert cli.main(["resume", str(tmp_path), "--data-dir", "/data/tfds", "--cache-dir", "/data/cache"]) == 0
    assert seen == {"data_dir": "/data/tfds", "cache_dir": "/data/cache", "run_dir": str(tmp_path)}
    seen.clear()
    assert cli.main(["resume", str(tmp_path)]) == 0 and seen == {"run_dir": str(tmp_path)}   # the stored ones
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match=r"data dir 'tfdslink' does not exist \(read from .*, a relative path\): give "
                                        r"the directory .* `pfedkdh resume RUN --data-dir DIR`"):
        load_pool("mnist", data_dir="tfdslink", cache_dir=str(tmp_path / "cache"))
