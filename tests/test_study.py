"""experiments/study.py's bookkeeping (issue 24): which points are finished, what `status` reports,
and that `sync` copies only finished points. No JAX, no training."""

from __future__ import annotations

import importlib.util
import json
import os

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _study_module():
    spec = importlib.util.spec_from_file_location("study", os.path.join(REPO, "experiments", "study.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


st = _study_module()


def _point(root, name, status, rounds):
    d = os.path.join(root, "points", name)
    os.makedirs(os.path.join(d, "checkpoints", f"round_{rounds - rounds % 5:06d}"))
    with open(os.path.join(d, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps({"round": r, "seed": 0}) + "\n" for r in range(1, rounds + 1))
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"out": d, "data_dir": "/somewhere/tfds"}, f)
    if status:
        with open(os.path.join(d, "summary.json"), "w") as f:
            json.dump({"status": status}, f)


def test_status_reports_the_running_round_and_the_progress(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PFEDKDH_STUDY_DIR", str(tmp_path))
    results = tmp_path / "results"
    (results / "table2").mkdir(parents=True)
    (results / "table2" / "study.json").write_text(json.dumps({"points": 4}))
    monkeypatch.setattr(st, "RESULTS", str(results))
    root = st.study_dir("table2")
    _point(root, "mnist-a0.1-fedavg", "completed", 50)
    _point(root, "mnist-a0.1-fedper", None, 23)          # killed at round 23, checkpointed at 20
    st.status("table2")
    out = capsys.readouterr().out.splitlines()
    assert "completed" in out[0] and "not saved" in out[0]
    assert "running: round 23 (round_000020)" in out[1]
    assert out[-1] == "1 of 4 points completed here, 0 saved to experiments/results (run `sync` to save the rest)"

    assert st.sync("table2") == ["mnist-a0.1-fedavg"]     # the running point stays behind
    saved = results / "table2" / "points" / "mnist-a0.1-fedavg"
    assert sorted(os.listdir(saved)) == ["config.json", "metrics.jsonl", "summary.json"]
    assert not os.path.isabs(json.loads((saved / "config.json").read_text())["data_dir"])
    st.status("table2")
    assert capsys.readouterr().out.splitlines()[-1] == "1 of 4 points completed here, 1 saved to experiments/results"

    # a fresh machine: no study directory, the points saved by another (before: "0 saved", and no lines)
    monkeypatch.setenv("PFEDKDH_STUDY_DIR", str(tmp_path / "elsewhere"))
    st.status("table2")
    out = capsys.readouterr().out.splitlines()
    assert out[0].split() == ["mnist-a0.1-fedavg", "not", "here", "(saved", "from", "another", "run)", "saved"]
    assert out[-1] == "0 of 4 points completed here, 1 saved to experiments/results"
