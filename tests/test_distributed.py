"""A sweep split over two processes of a ``jax.distributed`` job (localhost coordinator, CPU): each
process runs its share of the points, process 0 writes the tables, and they equal one process's."""

import csv
import os
import socket
import subprocess
import sys

import pytest

from pfedkdh_jax.run.cli import main as cli_main
from pfedkdh_jax.run.sweep import make_sweep, run_sweep, share

OPTIONS = dict(rounds=2, num_clients=4, aux_size=100, local_epochs=1, checkpoint_every=1, client_devices=1)
FLAGS = ["sweep", "--datasets", "digits", "--alphas", "0.5,1.0", "--methods", "fedper", "--seeds", "2",
         "--stack", "--rounds", "2", "--clients", "4", "--aux-size", "100", "--local-epochs", "1",
         "--checkpoint-every", "1", "--client-devices", "1", "--no-progress",
         "--conv-form", "lax"]   # the in-process sweep below takes the suite's form (conftest.py)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def _table(out):
    with open(os.path.join(out, "table.csv")) as f:
        return {(r["method"], r["cell"]): r for r in csv.DictReader(f)}


def test_share_deals_points_round_robin_and_splits_stacks():
    groups = [["a1", "a2", "a3"], ["b"], ["c1", "c2"]]
    assert share(groups, 0, 1) == groups
    assert share(groups, 0, 2) == [["a1", "a3"], ["c1"]]
    assert share(groups, 1, 2) == [["a2"], ["b"], ["c2"]]
    assert share(groups, 2, 3) == [["a3"], ["c2"]]
    dealt = sorted(p for i in range(4) for g in share(groups, i, 4) for p in g)
    assert dealt == sorted(p for g in groups for p in g)   # every point once


def test_two_processes_give_one_process_tables(tmp_path):
    port, out = _free_port(), str(tmp_path / "two")
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    procs = [subprocess.Popen([sys.executable, "-m", "pfedkdh_jax", *FLAGS, "--out", out,
                               "--coordinator", f"localhost:{port}", "--num-processes", "2",
                               "--process-id", str(i)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True) for i in range(2)]
    logs = [p.communicate(timeout=900)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0], logs
    # each process ran one point (the α stack split in two), and checkpointed it on its own
    assert "[process 0/2] [1/2] digits-a0.5-fedper: running" in logs[0], logs[0]
    assert "[process 1/2] [2/2] digits-a1.0-fedper: running" in logs[1], logs[1]
    assert "process 0 writes the tables" in logs[1] and "| fedper |" in logs[0]
    for point in os.listdir(os.path.join(out, "points")):
        assert os.listdir(os.path.join(out, "points", point, "checkpoints")), point

    one = str(tmp_path / "one")
    run_sweep(make_sweep(["digits"], [0.5, 1.0], ["fedper"], seeds=2, options=OPTIONS, stack=True), one,
              log=lambda *a, **k: None)
    got, want = _table(out), _table(one)
    assert got.keys() == want.keys() and len(got) == 2
    for key in want:
        for field in ("mean", "std"):
            assert float(got[key][field]) == pytest.approx(float(want[key][field]), abs=1e-5), (key, field)
        assert got[key]["status"] == "completed" and got[key]["rounds"] == "2"


@pytest.mark.parametrize("extra, message", [
    (["--coordinator", "localhost:1"], "needs all three"),
    (["--coordinator", "nohost", "--num-processes", "2", "--process-id", "0"], "HOST:PORT"),
    (["--coordinator", "localhost:1", "--num-processes", "2", "--process-id", "2"], "--process-id must be in"),
])
def test_distributed_flags_are_checked(tmp_path, extra, message, capsys):
    assert cli_main([*FLAGS, "--out", str(tmp_path / "s"), *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and err.count("\n") == 1
