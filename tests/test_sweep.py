"""``pfedkdh sweep``: a grid of datasets × α × methods × seeds on the digits demo set, its tables, and
an interrupted sweep that resumes to the same tables."""

import csv
import json
import os
import re
import shutil

import pytest

from pfedkdh_jax.run.cli import main as cli_main
from pfedkdh_jax.run.config import ConfigError
from pfedkdh_jax.run.sweep import make_sweep, points, run_sweep

SMALL = dict(rounds=2, num_clients=4, aux_size=100, local_epochs=1, checkpoint_every=1)


class Interrupted(Exception):
    pass


def grid():
    return make_sweep(["digits"], [0.5, 1.0], ["fedper", "fedavg"], seeds=2, options=SMALL)


def csv_rows(out):
    with open(os.path.join(out, "table.csv")) as f:
        return list(csv.DictReader(f))


def test_sweep_tables_rerun_and_interrupted_resume(tmp_path):
    a = str(tmp_path / "a")
    log = []
    result = run_sweep(grid(), a, log=log.append)
    rows = csv_rows(a)
    # 2 methods × 2 cells; FedAvg's row is its global model's, FedPer's the personalized metric
    assert len(rows) == 4 and {r["seeds"] for r in rows} == {"2"}
    assert {(r["method"], r["metric"]) for r in rows} == {("fedper", "personalized_macro_accuracy"),
                                                          ("fedavg", "global_macro_accuracy")}
    assert all(float(r["std"]) > 0 for r in rows)      # two seeds that differ
    table = open(os.path.join(a, "table.md")).read()
    assert "digits α=0.5" in table and "digits α=1" in table and table.count("**") == 4  # one bold per column
    assert "| fedavg (global) |" in table and "| fedper |" in table
    costs = open(os.path.join(a, "costs.md")).read()
    cost_rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
                 for line in costs.splitlines()[2:]}
    assert len(cost_rows) == 4
    for name, (spr, ratio, _, traffic) in cost_rows.items():
        assert float(spr) > 0
        if name.endswith("-fedper"):
            assert ratio == "1.00" and traffic == "2.308 / 2.308"   # FedPer ÷ itself; its body travels
        else:
            assert traffic == "2.328 / 2.328"                      # FedAvg: the whole model
    assert len(result["figures"]) == 2 and all(os.path.exists(p) for p in result["figures"])
    for name, cfg in points(grid(), a):                  # one run directory per point, with 2 repetitions
        summary = json.load(open(os.path.join(cfg.out, "summary.json")))
        assert summary["status"] == "completed" and len(summary["repetitions"]) == 2

    # the same command again: nothing reruns
    again = []
    run_sweep(grid(), a, log=again.append)
    assert sum("done already" in line for line in again) == 4

    # another grid in the same directory is refused
    with pytest.raises(ConfigError, match="another sweep"):
        run_sweep(make_sweep(["digits"], [0.5], ["fedper"], seeds=2, options=SMALL), a, log=lambda m: None)

    # interrupted: killed when the third point starts; the second point lost its summary (killed after
    # its checkpoints), and the third left a directory without any checkpoint
    b = str(tmp_path / "b")

    def stop_at_third(msg):
        if msg.startswith("[3/4]"):
            raise Interrupted
    with pytest.raises(Interrupted):
        run_sweep(grid(), b, log=stop_at_third)
    second, third = points(grid(), b)[1][1].out, points(grid(), b)[2][1].out
    os.remove(os.path.join(second, "summary.json"))
    os.makedirs(third)
    shutil.copy(os.path.join(points(grid(), b)[0][1].out, "config.json"), third)
    resumed = []
    run_sweep(grid(), b, log=resumed.append)
    assert any(line.startswith("[2/4]") and "resuming" in line for line in resumed)
    assert any(line.startswith("[3/4]") and "restarting" in line for line in resumed)
    assert csv_rows(b) == rows                            # the tables of the uninterrupted sweep


@pytest.mark.slow   # CI's 20 minutes; run_stacked itself is tested in test_stacked_partitions
def test_a_stacked_sweep_writes_the_tables_of_the_sweep_point_by_point(tmp_path):
    a = str(tmp_path / "a")
    run_sweep(grid(), a, log=lambda m: None)
    rows = csv_rows(a)
    # stacked: each method's two α values as one program (4 repetitions vmapped), the same tables
    c = str(tmp_path / "c")
    stacked_log = []
    run_sweep(make_sweep(["digits"], [0.5, 1.0], ["fedper", "fedavg"], seeds=2, options={**SMALL, "reps_mode": "vmap"},
                         stack=True), c, log=stacked_log.append)
    assert [line for line in stacked_log if line.startswith("stacked: ")] == [
        "stacked: digits-a0.5-fedper, digits-a1.0-fedper", "stacked: digits-a0.5-fedavg, digits-a1.0-fedavg"]
    stacked_rows = csv_rows(c)
    assert [(r["row"], r["cell"]) for r in stacked_rows] == [(r["row"], r["cell"]) for r in rows]
    for got, want in zip(stacked_rows, rows):
        assert abs(float(got["mean"]) - float(want["mean"])) <= 1e-5 and abs(float(got["std"]) - float(want["std"])) <= 1e-5


def test_sweep_grid_applies_to_the_methods_that_read_it():
    sweep = make_sweep(["digits"], [0.5], ["pfedkdh", "fedper"], grid={"lam": [0.0, 0.5], "lr": [0.01, 0.02]},
                       options=SMALL)
    names = [n for n, _ in points(sweep)]
    # pFedKDH: 2 λ × 2 lr; FedPer reads lr only (λ is pFedKDH's)
    assert len([n for n in names if "pfedkdh" in n]) == 4 and len([n for n in names if "fedper" in n]) == 2
    assert {round(c.lam, 2) for n, c in points(sweep) if "pfedkdh" in n} == {0.0, 0.5}


def test_a_grid_over_a_methods_own_option():
    """``--grid fedprox:mu=...`` varies FedProx's own option on FedProx's points only (its values as
    --method-arg text), names the points and rows by it, and refuses what it cannot mean."""
    from pfedkdh_jax.run.sweep import _label
    sweep = make_sweep(["digits"], [0.5], ["fedper", "fedprox"], grid={"FedProx:mu": ["0.01", "0.1"]},
                       options=SMALL)
    pts = dict(points(sweep))
    assert sorted(pts) == ["digits-a0.5-fedper", "digits-a0.5-fedprox-mu0.01", "digits-a0.5-fedprox-mu0.1"]
    assert pts["digits-a0.5-fedprox-mu0.1"].method_args == (("mu", "0.1"),)
    assert pts["digits-a0.5-fedper"].method_args == ()
    assert [_label(c, sweep) for _, c in points(sweep)] == ["fedper", "fedprox mu=0.01", "fedprox mu=0.1"]
    # typed as the option is: 1e-1 and 0.1 are one value (a config file's numbers, the command line's text)
    with pytest.raises(ConfigError, match="lists a value twice"):
        make_sweep(["digits"], [0.5], ["fedprox"], grid={"fedprox:mu": ["1e-1", 0.1]}, options=SMALL)
    assert make_sweep(["digits"], [0.5], ["fedprox"], grid={"fedprox:mu": ["0.1"]}, options=SMALL).grid == \
        make_sweep(["digits"], [0.5], ["fedprox"], grid={"fedprox:mu": [0.1]}, options=SMALL).grid
    # one method's options under two spellings are merged, not one dropped
    merged = make_sweep(["digits"], [0.5], ["ditto"], method_args={"ditto": [("lam", "0.5")],
                                                                    "Ditto": [("personal_rows", "2")]}, options=SMALL)
    assert dict(merged.method_args) == {"ditto": (("lam", "0.5"), ("personal_rows", "2"))}
    for grid, margs, message in [({"fedrep:head_epochs": ["1"]}, None, "fedrep is not one of the sweep's --methods"),
                                 ({":mu": ["1"]}, None, "name the method and its option, METHOD:KEY=V1,V2"),
                                 ({"fedprox:mu": ["1"], "FedProx:mu": ["2"]}, None, "given twice (as fedprox:mu)"),
                                 ({"fedprox:lam": ["1"]}, None, "fedprox has no option 'lam' of its own (its own: mu)"),
                                 ({"fedprox:mu": ["0.1"]}, {"fedprox": [("mu", "1")]}, "give one of them"),
                                 ({"fedprox:mu": ["-1"]}, None, "--method-arg mu must be >= 0 for fedprox")]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            make_sweep(["digits"], [0.5], ["fedper", "fedprox"], grid=grid, method_args=margs, options=SMALL)


def test_a_sweep_continues_whatever_the_order_of_its_lists_and_grows_by_a_method_with_its_grid():
    """The same grid in another order is the same sweep (its stored order kept: the points' names and
    the table's rows); a method added with a grid over its own option grows the sweep."""
    from pfedkdh_jax.run.sweep import _added, _in_stored_order
    stored = make_sweep(["digits"], [0.5, 1.0], ["fedper", "fedprox"],
                        grid={"fedprox:mu": [0.01, 0.1], "lr": [0.01, 0.02]}, options=SMALL)
    again = make_sweep(["digits"], [1.0, 0.5], ["fedprox", "fedper"],
                       grid={"lr": [0.02, 0.01], "fedprox:mu": [0.1, 0.01]}, options=SMALL)
    assert again != stored and _in_stored_order(again, stored.to_json()) == stored
    grown = make_sweep(["digits"], [0.5, 1.0], ["fedper", "fedprox", "ditto"],
                       grid={"fedprox:mu": [0.01, 0.1], "lr": [0.01, 0.02], "ditto:lam": [0.1, 1.0]}, options=SMALL)
    assert _added(stored.to_json(), _in_stored_order(grown, stored.to_json()).to_json()) == "+ methods ditto"
    other = make_sweep(["digits"], [0.5, 1.0], ["fedper", "fedprox"],
                       grid={"fedprox:mu": [0.01, 0.5], "lr": [0.01, 0.02]}, options=SMALL)
    assert _added(stored.to_json(), other.to_json()) == ""      # another grid of an old method: no growth


def test_names_are_read_regardless_of_case():
    """FedAvg is fedavg and fmnist fashion_mnist, in a run's options and a sweep's lists alike; two
    spellings of one method are one method listed twice."""
    from pfedkdh_jax.run.config import make_config
    cfg = make_config("smoke", method="FedAvg", dataset="fmnist")
    assert (cfg.method, cfg.dataset) == ("fedavg", "fashion_mnist")
    sweep = make_sweep(["Digits"], [0.5], ["FedPer", "FEDREP"], method_args={"FedRep": [("head_epochs", "2")]},
                       options=SMALL)
    assert (sweep.datasets, sweep.methods) == (("digits",), ("fedper", "fedrep"))
    assert dict(sweep.method_args) == {"fedrep": (("head_epochs", "2"),)}
    with pytest.raises(ConfigError, match="lists a value twice: fedper, fedper"):
        make_sweep(["digits"], [0.5], ["FedPer", "fedper"], options=SMALL)


@pytest.mark.parametrize("argv, message", [
    (["--methods", "fedper,nope"], "--method must be one of"),
    (["--alphas", "0.5,x"], "--alphas must be comma-separated numbers"),
    (["--grid", "lam"], "--grid must be OPTION=V1,V2"),
    (["--grid", "nonsense=1,2"], "not a run option"),
    (["--seeds", "0"], "--seeds must be >= 1"),
    (["--methods", "fedper,fedper"], "lists a value twice"),
    (["--method-arg", "fedrep:head_epochs=2"], "not one of the sweep's --methods"),
    (["--alphas", ""], "--alphas needs at least one value; got ''"),
    (["--alphas", "0.1,,0.5"], "--alphas: an empty value in '0.1,,0.5'"),
    (["--grid", "lr=0.1,"], "--grid lr: an empty value"),
    (["--methods", "fedavg", "--grid", "lam=0,0.5"], "--grid lam: none of the sweep's methods reads it (an option "
                                                      "of pfedkdh)"),
    (["--methods", "fedprox", "--grid", "mu=0,1"], "(fedprox's own mu: --grid fedprox:mu=V1,V2)"),
    (["--methods", "fedprox", "--grid", "lr=0.1", "--grid", "lr=0.2"], "--grid lr is given twice: give its values "
                                                                        "once, comma-separated"),
    (["--methods", "fedprox", "--method-arg", "fedprox:mu=0.1,0.2"], "--method-arg fedprox:mu=0.1,0.2: one value a "
                                                                     "sweep; for several, --grid fedprox:mu=0.1,0.2"),
    (["--methods", "pfedkdh", "--grid", "pfedkdh:lam=0,1"], "pfedkdh has no option 'lam' of its own (its options are "
                                                              "run options: --grid lam=V1,V2)"),
    (["--methods", "pfedkdh,fedavg", "--lam", "0.5"], "--lam is an option of pfedkdh; --method fedavg does not use it "
                                                     "(a sweep's --grid lam=V gives it to the methods that use it only)"),
])
def test_sweep_bad_options_are_one_line_errors(argv, message, capsys):
    assert cli_main(["sweep", "--datasets", "digits", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and "\n" not in err


def test_a_sweep_checks_every_dataset_before_its_first_point(tmp_path, capsys):
    out = tmp_path / "sweep"
    assert cli_main(["sweep", "--datasets", "digits,cifar100", "--data-dir", str(tmp_path), "--rounds", "1",
                     "--out", str(out), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("pfedkdh: error: dataset 'cifar100' version") and "is not prepared" in err
    assert f"data_dir='{tmp_path}'" in err   # the instructions' Python code is left as Python
    assert not out.exists()   # nothing ran, nothing was written


def test_scores_on_a_validation_split_say_so(tmp_path, capsys):
    """--validation-fraction scores a split of client train data: the log, summary.json, table.md,
    table.csv and the report name it, so validation figures are not read as test figures."""
    from pfedkdh_jax.run.report import table
    from pfedkdh_jax.run.report import load_run
    out = tmp_path / "sweep"
    assert cli_main(["sweep", "--datasets", "digits", "--methods", "fedper", "--rounds", "1", "--clients", "4",
                     "--aux-size", "100", "--local-epochs", "1", "--validation-fraction", "0.2", "--out", str(out),
                     "--no-progress"]) == 0
    said = capsys.readouterr().out
    assert "scored on a validation split of each client's train data" in said and "total validation" in said
    assert "Scored on a validation split (0.2 of each client's train data" in said
    assert "not on the clients' test splits" in (out / "table.md").read_text()
    assert {r["split"] for r in csv_rows(out)} == {"validation"}
    point = out / "points" / "digits-a0.1-fedper"
    assert json.loads((point / "summary.json").read_text())["scored_split"] == "validation"
    assert "digits-a0.1-fedper (validation split)" in table([load_run(str(point))])


def test_another_grid_in_a_sweep_directory_names_what_differs(tmp_path, capsys):
    out = tmp_path / "sweep"
    out.mkdir()
    stored = make_sweep(["digits"], [0.5], ["fedper"], options=SMALL)
    (out / "sweep.json").write_text(json.dumps(stored.to_json()))
    for sweep, differs in [(make_sweep(["digits"], [0.5], ["fedavg"], options=SMALL),
                            "its methods fedper, this one's fedavg"),
                           (make_sweep(["digits"], [0.5], ["fedper"], options={**SMALL, "rounds": 3}),
                            "its rounds 2, this one's 3")]:
        with pytest.raises(ConfigError, match=f"holds another sweep \\({differs}\\); a sweep directory holds one grid, "
                                              "which may only grow by datasets, α or methods"):
            run_sweep(sweep, str(out))
    assert sorted(p.name for p in out.iterdir()) == ["sweep.json"]
    # a flag at the value the preset gave is the same grid in other words: the same points, the same configs
    from pfedkdh_jax.run.sweep import _in_other_words
    same = {**SMALL, "batch_size": 64}
    assert _in_other_words(stored.to_json(), make_sweep(["digits"], [0.5], ["fedper"], options=same), str(out)) == ""
    assert _in_other_words(stored.to_json(), make_sweep(["digits"], [0.5], ["fedper", "fedavg"], options=same),
                           str(out)) == "+ methods fedavg"   # and grown by a method beside it
    assert _in_other_words(stored.to_json(), make_sweep(["digits"], [0.5], ["fedper"], options={**SMALL, "rounds": 3}),
                           str(out)) is None
    # a sweep directory is not a run directory: resume and report say where its runs are
    assert cli_main(["resume", str(out)]) == 2
    assert "it holds a sweep; its runs are its points/*" in capsys.readouterr().err


def test_a_sweep_grows_by_a_method_and_keeps_its_finished_points(tmp_path):
    out, log = str(tmp_path / "sweep"), []
    one = {**SMALL, "rounds": 1}
    run_sweep(make_sweep(["digits"], [0.5], ["fedper"], options=one), out, log=log.append)
    first = json.load(open(os.path.join(out, "points", "digits-a0.5-fedper", "summary.json")))
    log.clear()
    run_sweep(make_sweep(["digits"], [0.5], ["fedper", "fedavg"], options=one), out, log=log.append)
    assert "the sweep grows: + methods fedavg; its finished points are kept" in log
    assert any("digits-a0.5-fedper: done already" in line for line in log)
    assert json.load(open(os.path.join(out, "points", "digits-a0.5-fedper", "summary.json"))) == first
    assert {r["method"] for r in csv_rows(out)} == {"fedper", "fedavg"}
    assert json.load(open(os.path.join(out, "sweep.json")))["methods"] == ["fedper", "fedavg"]
    with pytest.raises(ConfigError, match="holds another sweep"):   # shrinking is no growth
        run_sweep(make_sweep(["digits"], [0.5], ["fedavg"], options=one), out)



def test_costs_mark_a_point_whose_rounds_all_compiled(monkeypatch):
    """costs.md marks with † a point whose seconds per round include compiling (a one-round point), gives its
    cell no ratio to FedPer's, and writes – for an evaluation time it does not have (before: 27.571 s a round
    unmarked beside a steady 0.37, its ratio read from it, and 0.000 s of evaluation)."""
    import types
    from pfedkdh_jax.run import sweep as sw

    def item(name, method, alpha, summary):
        return {"name": name, "cfg": types.SimpleNamespace(dataset="digits", alpha=alpha, method=method),
                "run": {"summary": summary}}
    items = [item("a1-fedper", "fedper", 0.1, {"seconds_per_round": 27.571, "seconds_per_round_includes_compile": True,
                                                "eval_seconds_median": 2.0}),
             item("a1-pfedkdh", "pfedkdh", 0.1, {"seconds_per_round": 28.893, "seconds_per_round_includes_compile": True}),
             item("a5-fedper", "fedper", 0.5, {"seconds_per_round": 0.4, "eval_seconds_median": 0.5}),
             item("a5-pfedkdh", "pfedkdh", 0.5, {"seconds_per_round": 0.6, "eval_seconds_median": 0.7})]
    monkeypatch.setattr(sw, "_load", lambda sweep, out: items)
    lines = sw.costs_markdown(None, "unused").splitlines()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:5]] for line in lines[2:6]}
    assert rows == {"a1-fedper": ["27.571 †", "–", "2.000"], "a1-pfedkdh": ["28.893 †", "–", "–"],
                    "a5-fedper": ["0.400", "1.00", "0.500"], "a5-pfedkdh": ["0.600", "1.50", "0.700"]}
    assert lines[-1].startswith("† a point whose every round compiled")
