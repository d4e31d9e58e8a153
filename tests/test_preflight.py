"""Memory pre-flight: runs that cannot fit stop with one line before anything is compiled."""

import time

import jax
import pytest

from pfedkdh_jax.run import preflight
from pfedkdh_jax.run.cli import main as cli_main

GiB = 2 ** 30


@pytest.fixture
def eight_gib(monkeypatch):
    monkeypatch.setattr(preflight, "available_bytes", lambda: 8 * GiB)


@pytest.mark.parametrize("flags, advice", [
    (["--batch-size", "100000"], "a smaller --batch-size (100000)"),
    (["--reps", "100000"], "fewer --reps"),
    (["--batch-size", "20000", "--client-parallel", "vmap"], "--client-parallel sequential"),
    # Ditto keeps a personal model per client: 300 clients of the digits set at 64 MiB available
    (["--method", "ditto", "--clients", "300", "--min-client-samples", "2", "--method-arg", "personal_rows=0"],
     "fewer --clients: ditto keeps"),
    # ... or, by default, one for each client a run trains (1 round of 150 clients here)
    (["--method", "ditto", "--clients", "300", "--min-client-samples", "2"],
     "fewer --rounds or clients per round: ditto keeps 2.2 MiB for every client a run trains, up to rounds × "
     "clients per round = 150"),
    # every one of 300 clients a round, vmapped: the round's 300 uploaded models, not any state, are what is
    # large (sequential clients would hold one running sum of the backbones per device instead)
    (["--clients", "300", "--participation", "1", "--min-client-samples", "2", "--client-parallel", "vmap",
      "--batch-size", "2"], "fewer --clients-per-round"),
])
def test_runs_that_cannot_fit_stop_with_one_line(flags, advice, eight_gib, tmp_path, capsys, monkeypatch):
    if "--clients" in flags:
        monkeypatch.setattr(preflight, "available_bytes", lambda: 64 * 2 ** 20)
    t0 = time.perf_counter()
    code = cli_main(["run", "--rounds", "1", "--no-progress", "--out", str(tmp_path / "r"), *flags])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "of memory" in err[0] and advice in err[0], err
    assert time.perf_counter() - t0 < 60          # no initialisation of 100000 states, no round compiled
    assert not (tmp_path / "r" / "metrics.jsonl").exists()


def test_the_step_estimate_is_xla_s_and_scales_with_the_batch():
    small, large = (preflight.step_temp_bytes(10, (28, 28, 1), b) for b in (64, 6400))
    # the CNN's activations: conv1 alone keeps 24·24·32 float32 per sample
    assert small >= 64 * 24 * 24 * 32 * 4
    assert 50 * small < large < 200 * small


def test_an_ordinary_run_passes(monkeypatch):
    from pfedkdh_jax import algorithms
    from pfedkdh_jax.data.device import build_federated_data
    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data

    cfg = make_config("default")
    pool, part, _ = prepare_data(cfg)
    data = build_federated_data(pool, part)
    est = preflight.check(cfg, algorithms.build(cfg, pool.num_classes), data, Layout().resolved(), False,
                          available=8 * GiB)
    assert est is not None and 0 < est["total"] < GiB


def test_stacked_partitions_count_one_run_s_update_per_client_and_repetition():
    """With partitions of several α stacked (a sweep's ``--stack``), a client's update is one run's:
    the estimate takes it from a run's slice, C × R of them when the runs are vmapped together."""
    import dataclasses

    from pfedkdh_jax import algorithms
    from pfedkdh_jax.data import make_partition
    from pfedkdh_jax.data.device import build_federated_data, stack_partitions
    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data

    cfg = make_config("default")
    pool, part, _ = prepare_data(cfg)
    datas = [build_federated_data(pool, make_partition(pool.labels, num_clients=cfg.num_clients, alpha=a,
                                                       aux_size=cfg.aux_size, seed=0)) for a in (0.1, 0.5)]
    algo = algorithms.build(cfg, pool.num_classes)
    one = preflight.estimate(cfg, algo, datas[0], Layout().resolved(), False)
    both = preflight.estimate(dataclasses.replace(cfg, reps=2), algo, stack_partitions(datas), Layout().resolved(), True)
    assert both["per_update"] == one["per_update"] > 0
    assert both["updates"] == 2 * one["updates"] > 2 * cfg.clients_per_round * one["per_update"]


def test_a_method_that_averages_its_uploads_as_they_come_holds_its_rests_and_one_sum_per_device():
    """With sequential clients, FedPer's round keeps each client's head and loss and one running sum
    of the backbone per device (plus the client in flight); vmapped clients, and a method that stores
    the uploads (FedALA), keep every client's whole update."""
    import dataclasses

    from pfedkdh_jax import algorithms
    from pfedkdh_jax.data.device import build_federated_data
    from pfedkdh_jax.engine.layout import Layout
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data

    cfg = make_config("default", method="fedper", num_clients=40, per_round=30)
    pool, part, _ = prepare_data(cfg)
    data = build_federated_data(pool, part)
    algo = algorithms.build(cfg, pool.num_classes)
    state = jax.eval_shape(lambda k: algo.init(k, data), jax.random.key(0))
    backbone, head = (preflight._tree_bytes(state.backbone), preflight._tree_bytes(state.heads) // 40)
    loss = 4
    seq = preflight.estimate(cfg, algo, data, Layout("sequential", "unrolled", client_devices=2), False)
    assert seq["per_update"] == head + loss
    assert seq["updates"] == 30 * (head + loss) + 3 * backbone
    vm = preflight.estimate(cfg, algo, data, Layout("vmap", "scan", client_devices=1), False)
    assert vm["updates"] == 30 * (backbone + head + loss)
    ala = dataclasses.replace(cfg, method="fedala")
    est = preflight.estimate(ala, algorithms.build(ala, pool.num_classes), data,
                             Layout("sequential", "unrolled", client_devices=2), False)
    assert est["updates"] == 30 * est["per_update"] > 30 * (backbone + head)
