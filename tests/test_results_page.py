"""The results page (issue 24): BENCHMARKS.md's headline section and figures are what
experiments/results_page.py makes of experiments/results/, and its readings (σ gap, missing cells,
ranking, the distillation finding) hold on a tiny synthetic results directory. No JAX."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import statistics

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(REPO, "experiments", "results")


def _page_module():
    spec = importlib.util.spec_from_file_location("results_page", os.path.join(REPO, "experiments", "results_page.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


rp = _page_module()


def test_committed_page_is_the_generated_one():
    assert rp.main(["--check", "--no-figures"]) == 0, "run `python experiments/results_page.py`"


def test_committed_figures_are_the_generated_ones():
    matplotlib = pytest.importorskip("matplotlib")
    from PIL import Image

    with Image.open(os.path.join(RESULTS, "figures", "table2.png")) as im:
        made_with = im.text.get("Source")
    if made_with != f"matplotlib {matplotlib.__version__}":
        pytest.skip(f"figures made with {made_with}; PNG bytes depend on the matplotlib version")
    assert rp.main(["--check"]) == 0, "run `python experiments/results_page.py`"


def _point(root, study, name, method, dataset, alpha, summary, lam=0.0, status="completed", data_seed=0):
    d = os.path.join(root, study, "points", name)
    os.makedirs(d)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"method": method, "dataset": dataset, "alpha": alpha, "lam": lam, "data_seed": data_seed}, f)
    with open(os.path.join(d, "summary.json"), "w") as f:
        json.dump(dict(summary, status=status, seconds_per_round=10.0,
                       bytes_per_client_round={"download": 2308104, "upload": 2308104}), f)
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        for t in (25, 50):
            f.write(json.dumps({"round": t, **{k: v * t / 50 for k, v in summary.items()}}) + "\n")


@pytest.fixture
def results(tmp_path):
    """The committed transcribed files and study.json, with a few synthetic points instead of the study's."""
    root = str(tmp_path / "results")
    shutil.copytree(RESULTS, root, ignore=shutil.ignore_patterns("points", "figures"))
    acc = "personalized_macro_accuracy"
    _point(root, "table2", "mnist-a0.1-fedper", "fedper", "mnist", 0.1, {acc: 0.9904})
    _point(root, "table2", "mnist-a0.1-fedavg", "fedavg", "mnist", 0.1,
           {"global_macro_accuracy": 0.9583, acc: 0.5})          # scored by its global model
    _point(root, "table2", "mnist-a0.1-pfedkdh-lam0.0", "pfedkdh", "mnist", 0.1, {acc: 0.99, acc + "_ea": 0.9908})
    _point(root, "table2", "mnist-a0.1-pfedkdh-lam0.5", "pfedkdh", "mnist", 0.1,
           {acc: 0.9832, acc + "_ea": 0.9886}, lam=0.5)
    _point(root, "table2", "mnist-a0.5-fedper", "fedper", "mnist", 0.5, {acc: 0.5}, status="running")  # not finished
    _point(root, "cifar10", "cifar10-a0.05-fedper", "fedper", "cifar10", 0.05, {acc: 0.92})
    return root


def test_gap_in_sigma():
    assert rp.gap_sigma(99.04, 98.61, 0.13) == "+3.3σ"
    assert rp.gap_sigma(98.32, 99.12, 0.09) == "-8.9σ"
    assert rp.gap_sigma(97.0, 97.0, 0.0) == "–"          # no spread given: no gap


def test_cells_gaps_and_missing(results):
    res = rp.load(results)
    assert res["table2"]["points"] == 4                   # the running point is not counted
    assert rp.cell_text(res, "fedper", "mnist/0.1") == "99.04 (98.61 ± 0.13, +3.3σ)"
    assert rp.cell_text(res, "fedavg", "mnist/0.1") == "95.83 (94.43 ± 2.01, +0.7σ)"   # its global model
    assert rp.cell_text(res, "pfedkdh-lam0.5-ea", "mnist/0.1") == "98.86 (99.23 ± 0.03, -12.3σ)"
    assert rp.cell_text(res, "fedper", "mnist/0.5") == "– (98.08 ± 0.30)"           # running: missing
    assert rp.cell_text(res, "pfedsim", "mnist/0.5") == "–"                         # no paper figure
    assert rp.cell_text(res, "fedper", "cifar10/0.05") == "92.00"                   # the study's, not the earlier
    assert rp.cell_text(res, "fedavg", "cifar10/0.05") == "44.51*"                  # an earlier run
    assert rp.cell_text(res, "ditto", "mnist/0.1") == "99.09* (96.02 ± 1.45, +2.1σ)"  # another column's earlier run
    gaps = {(row, col) for rows, cols in rp.missing(res) for row in rows for col in cols}
    filled = {("fedper", "mnist/0.1"), ("fedavg", "mnist/0.1"), ("fedper", "cifar10/0.05")} | {
        (f"pfedkdh-lam{lam}{ea}", "mnist/0.1") for lam in ("0.0", "0.5") for ea in ("", "-ea")}
    earlier = {(r["row"], e["column"]) for e in res["earlier"] for r in e["runs"]}
    assert {e["file"] for e in res["earlier"]} == {"cifar10_earlier.json", "mnist_a0.1_earlier.json"}
    assert gaps == {(r, c) for r, _, _ in rp.ROWS for c in rp.COLUMNS} - filled - earlier
    page = rp.section(res)
    assert f"**Missing ({len(gaps)} of {len(rp.ROWS) * len(rp.COLUMNS)} cells):**" in page
    assert ("FedProx (global), Ditto, FedALA, FedProto, FedRep, pFedMe, pFedSim: MNIST α = 0.05, "
            "MNIST α = 0.5, F-MNIST α = 0.05, F-MNIST α = 0.1, F-MNIST α = 0.5, CIFAR-10 α = 0.05") in page
    os.remove(os.path.join(results, "mnist_a0.1_earlier.json"))   # without that column's earlier runs
    page = rp.section(rp.load(results))
    assert "FedProx (global), Ditto" in page and ": every cell" in page and "mnist_a0.1_earlier" not in page


def test_why_missing_counts_the_studies_unfinished_points(results):
    res = rp.load(results)
    todo = rp.unfinished(res)
    assert len(todo["table2"]) == 78 - 4 and len(todo["cifar10"]) == 8     # the synthetic points are finished
    assert ("fedper", "mnist/0.1") not in todo["table2"] and ("pfedkdh-lam0.5", "mnist/0.1") not in todo["table2"]
    assert ("fedper", "mnist/0.5") in todo["table2"]                         # running: not finished
    # FedFed: 15 rounds of phase A (127.1 s), 35 of phase B (27.7 s); CIFAR-10 rounds × the side-by-side's ratio
    assert rp.point_hours(res, "fedfed", "mnist/0.1") == pytest.approx((15 * 127.1 + 35 * 27.7) / 3600)
    windows = res["cpu_vs_torch"]["windows"]
    factor = statistics.median(w["cifar10"]["jax"] / w["mnist"]["jax"] for w in windows)
    assert rp.point_hours(res, "pfedkdh-lam0.5", "cifar10/0.05") == pytest.approx(50 * 10.5 * factor / 3600)
    why = rp.why_missing(res)
    assert "The studies' 82 unfinished points (Table 2: 74 of 78; CIFAR-10: 8 of 8)" in why
    assert why in rp.section(res)


def test_study_json_names_the_studies_points():
    """study.json's rows × columns are the points its study runs (experiments/study.py's STUDIES)."""
    spec = importlib.util.spec_from_file_location("study", os.path.join(REPO, "experiments", "study.py"))
    study = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(study)
    for name, s in study.STUDIES.items():
        meta = rp._json(os.path.join(RESULTS, name, "study.json"))
        lams = [g.split("=")[1].split(",") for g in s["grid"] if g.startswith("lam=")]
        rows = [r for m in s["methods"].split(",")
                for r in ([f"pfedkdh-lam{float(v)}" for v in lams[0]] if m == "pfedkdh" and lams else [m])]
        cols = [f"{d}/{a}" for d in s["datasets"].split(",") for a in s["alphas"].split(",")]
        # a data_seed grid: the study's own points are those seeds; data seed 0 is table2's point
        seeds = [int(v) for g in s["grid"] if g.startswith("data_seed=") for v in g.split("=")[1].split(",")]
        assert meta["rows"] == rows and meta["columns"] == cols
        assert meta["points"] == len(rows) * len(cols) * max(1, len(seeds))
        assert meta.get("data_seeds", [0]) == ([0] + seeds if seeds else [0])
        if seeds:   # a spread study reports one row's difference to another's
            assert len(meta["pair"]) == 2 and set(meta["pair"]) <= set(rows)


def test_readings(results):
    res = rp.load(results)
    # MNIST α = 0.1: the synthetic points only (not the earlier runs of the other rows)
    res["cells"] = {k: v for k, v in res["cells"].items() if not (v.get("earlier") and k[1] == "mnist/0.1")}
    # the paper's order on MNIST α = 0.1: pFedKDH-EA > pFedKDH-Fair > FedPer > FedAvg; ours puts FedPer first
    assert rp.ranking_reading(res) == (
        "MNIST α = 0.1 differs (here FedPer > pFedKDH-EA λ = 0.5 > pFedKDH-Fair λ = 0.5 (distillation on) > FedAvg; "
        "the paper's pFedKDH-EA > pFedKDH-Fair > FedPer > FedAvg)")
    # ours FedPer, EA, Fair, FedAvg against the paper's EA, Fair, FedPer, FedAvg: 4 pairs agree, 2 do not
    assert rp.ranking_summary(res) == (
        "the order differs from the paper's on 1 of 1 columns (Kendall's τ, ours against the paper's: MNIST α = 0.1 "
        "+0.33); the paper's first row is first here on 0 of 1; first here: FedPer on 1; the default pFedKDH "
        "(λ = 0), left out of the ranking, would be first on MNIST α = 0.1")   # its EA above FedPer's
    assert rp.distillation_reading(res) == "λ = 0 above λ = 0.5: Fair on 2 of 2 filled cells; EA on 2 of 2 filled cells"
    # 99.00 − 99.04 here; the paper's 99.12 − 98.61
    assert rp.over_fedper_reading(res) == " pFedKDH-Fair (λ = 0) − FedPer: MNIST α = 0.1 -0.04 (paper +0.51)."
    res["cells"][("pfedkdh-lam0.5", "mnist/0.1")]["value"] = 99.5
    assert "Fair on 1 of 2 filled cells (not on MNIST α = 0.1)" in rp.distillation_reading(res)


def test_kendall_tau():
    assert rp.kendall_tau(["a", "b", "c"], ["a", "b", "c"]) == 1.0
    assert rp.kendall_tau(["c", "b", "a"], ["a", "b", "c"]) == -1.0
    assert rp.kendall_tau(["b", "a", "c"], ["a", "b", "c"]) == 1 / 3


def test_spread_over_partitions(results):
    """Table 2's point is data seed 0; the spread study's points add seeds 1 and 2 on its cells only."""
    acc, col = "personalized_macro_accuracy", "fashion_mnist/0.05"
    _point(results, "table2", "fashion_mnist-a0.05-fedper", "fedper", "fashion_mnist", 0.05, {acc: 0.96})
    _point(results, "table2", "fashion_mnist-a0.05-pfedkdh-lam0.0", "pfedkdh", "fashion_mnist", 0.05,
           {acc: 0.97, acc + "_ea": 0.975})
    for seed, (kdh, per) in ((1, (0.95, 0.955)), (2, (0.96, 0.95))):
        _point(results, "spread", f"fashion_mnist-a0.05-pfedkdh-lam0.0-data_seed{seed}", "pfedkdh", "fashion_mnist",
               0.05, {acc: kdh, acc + "_ea": kdh}, data_seed=seed)
        _point(results, "spread", f"fashion_mnist-a0.05-fedper-data_seed{seed}", "fedper", "fashion_mnist", 0.05,
               {acc: per}, data_seed=seed)
    _point(results, "spread", "fashion_mnist-a0.5-fedper-data_seed1", "fedper", "fashion_mnist", 0.5, {acc: 0.9},
           data_seed=1, status="running")
    # a second spread study: its own section, its own pair of rows
    _point(results, "table2", "mnist-a0.05-fedfed", "fedfed", "mnist", 0.05, {"global_macro_accuracy": 0.94})
    _point(results, "spread_fedfed", "mnist-a0.05-fedfed-data_seed1", "fedfed", "mnist", 0.05,
           {"global_macro_accuracy": 0.96}, data_seed=1)
    _point(results, "spread_fedfed", "mnist-a0.05-fedavg-data_seed1", "fedavg", "mnist", 0.05,
           {"global_macro_accuracy": 0.93}, data_seed=1)
    res = rp.load(results)
    spread = res["spreads"]["spread"]
    assert spread["points"] == 4 and res["spreads"]["spread_fedfed"]["points"] == 2
    assert spread["values"][("pfedkdh-lam0.0", col)] == pytest.approx({0: 97.0, 1: 95.0, 2: 96.0})
    assert ("fedper", "fashion_mnist/0.5") not in spread["values"]
    text = "\n".join(rp.section_spread(res))
    assert "| FedFed (global) | MNIST α = 0.05 | 94.00 / 96.00 / – | – |" in text
    # FedFed − FedAvg on data seed 1 only (seed 0's FedAvg point is not in this fixture); the paper's 98.19 − 93.23
    assert "FedFed (global) − FedAvg (global) on the same partition: MNIST α = 0.05 +3.00 (the paper's +4.96)." in text
    # mean 96.00 ± 1.00 against the paper's 97.31 ± 0.11: (96 − 97.31) / 0.11 = −11.9σ
    assert ("| pFedKDH-Fair λ = 0 (default) | F-MNIST α = 0.05 | 97.00 / 95.00 / 96.00 | 96.00 ± 1.00 | 97.31 ± 0.11 "
            "| -11.9σ |") in text
    assert "| FedPer | F-MNIST α = 0.5 | – / – / – | – |" in text
    assert "F-MNIST α = 0.05 +1.00, -0.50, +1.00 (the paper's +0.21)" in text
    # Figure 2's band: the mean ± std over the three partitions' curves (rounds 25 and 50: 0.5 and 1 of each value)
    rounds, mean, std = rp.spread_band(res, "pfedkdh-lam0.0", col)
    assert rounds == [25, 50] and mean == pytest.approx([48.0, 96.0]) and std == pytest.approx([0.5, 1.0])
    assert rp.spread_band(res, "fedfed", "mnist/0.05") is None             # two partitions only: no band
    assert "pFedKDH-Fair λ = 0 (default) on F-MNIST α = 0.05" in rp.section(res)


def test_in_brief_opens_the_page_with_the_readings_below(results):
    res = rp.load(results)
    res["cells"] = {k: v for k, v in res["cells"].items() if not (v.get("earlier") and k[1] == "mnist/0.1")}
    brief = rp.in_brief(res)
    # 6 rows on MNIST α = 0.1 (FedPer, FedAvg, pFedKDH Fair/EA at both λ); CIFAR-10: the FedPer point and the
    # earlier runs' FedAvg, FedBABU and four pFedKDH rows
    assert brief.startswith("**In brief.** Table 2: 6 of 90 cells filled, one seed and one partition each; "
                            "CIFAR-10 α = 0.05: 7 of 15. The paper's first row is first here on 0 of 1 columns. ")
    # 99.00 − 99.04; the paper's 99.12 − 98.61
    assert "distillation off (λ = 0, the default) − FedPer: -0.04 to -0.04 points (the paper's pFedKDH − FedPer: " \
           "+0.51 to +0.51)" in brief
    assert rp.distillation_reading(res) in brief and "NVIDIA H200, 0.313 s a round" in brief


def test_final_round_swings(results):
    res = rp.load(results)
    res["curves"] = {("fedbabu", "mnist/0.05"): {25: 98.0, 30: 99.0, 40: 99.4, 45: 99.2, 50: 94.3},
                     ("fedper", "mnist/0.05"): {30: 99.0, 40: 99.4, 45: 99.2, 50: 97.5},     # 1.7 points: kept
                     ("fedavg", "mnist/0.05"): {25: 80.0, 45: 81.0, 50: 90.0}}              # one evaluation before
    assert rp.swings(res) == [("fedbabu", "mnist/0.05", 94.3, 99.2, 3)]
    assert "FedBABU MNIST α = 0.05 (94.30 against 99.20, the median of only 3 evaluations)" in rp.swing_reading(res)


def test_section_replaces_only_the_marked_part(results, tmp_path):
    page = tmp_path / "page.md"
    page.write_text("# Benchmarks\n\n<!-- results:begin -->\nSTALE-TEXT\n<!-- results:end -->\n\n# Log\nkept\n")
    assert rp.main(["--results", results, "--page", str(page), "--no-figures"]) == 0
    text = page.read_text()
    assert text.startswith("# Benchmarks\n\n" + rp.BEGIN) and text.endswith(rp.END + "\n\n# Log\nkept\n")
    assert "STALE-TEXT" not in text
    assert rp.main(["--results", results, "--page", str(page), "--no-figures", "--check"]) == 0


def test_a_spread_of_many_rows_gives_their_order_over_the_partitions(results):
    """With three or more rows on every partition, a spread study's section orders them by their mean and
    gives Kendall's τ against the paper's order, and that of data seed 0 alone (Table 2's point)."""
    acc = "personalized_macro_accuracy"
    for seed in (1, 2):
        _point(results, "spread_mnist", f"mnist-a0.1-pfedkdh-lam0.0-data_seed{seed}", "pfedkdh", "mnist", 0.1,
               {acc: 0.995, acc + "_ea": 0.995}, data_seed=seed)
        _point(results, "spread_mnist", f"mnist-a0.1-fedper-data_seed{seed}", "fedper", "mnist", 0.1, {acc: 0.99},
               data_seed=seed)
        _point(results, "spread_mnist", f"mnist-a0.1-fedavg-data_seed{seed}", "fedavg", "mnist", 0.1,
               {"global_macro_accuracy": 0.95}, data_seed=seed)
    res = rp.load(results)
    text = "\n".join(rp.spread_section(res, res["spreads"]["spread_mnist"]))
    # data seed 0: FedPer 99.04 > pFedKDH 99.00 > FedAvg 95.83 (τ 1/3 against the paper's 99.12 > 98.61 > 94.43);
    # the means: pFedKDH 99.33 > FedPer 99.01 > FedAvg 95.28
    assert ("MNIST α = 0.1, the 3 rows with the paper's figure and every partition, by the mean over the partitions: "
            "pFedKDH-Fair λ = 0 (default) > FedPer > FedAvg (global) (Kendall's τ against the paper's order +1.00; "
            "on data seed 0 alone +0.33)") in text
    assert "## Over 3 partitions: 12 methods (pFedKDH-Fair λ = 0 (default), FedPer, ...) on MNIST α = 0.1" in text
    # two rows on every partition are no order
    assert "by the mean over the partitions" not in "\n".join(rp.spread_section(res, res["spreads"]["spread"]))


def test_a_missing_page_or_a_foreign_results_directory_is_one_line(tmp_path, capsys):
    """A --page that does not exist, or --results that is not experiments/results' layout, is one line
    (before: AttributeError on None.decode, FileNotFoundError on paper_table2.json)."""
    for argv, said in ((["--check", "--page", str(tmp_path / "nope.md")], "no such file"),
                       (["--check", "--results", str(tmp_path)], "not a results directory of this project's layout")):
        with pytest.raises(SystemExit) as e:
            rp.main(argv)
        assert e.value.code == 2 and said in capsys.readouterr().err
