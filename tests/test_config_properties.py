"""Property-based checks of the configuration: invalid values fail with one line, valid ones run."""

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pfedkdh_jax.data import DATASETS
from pfedkdh_jax.run import cli
from pfedkdh_jax.run.config import canonical_name

# flag -> strategy of values that must be refused, and the text the error must name
INVALID = {
    "--alpha": (st.floats(max_value=0, allow_nan=False, allow_infinity=False), "--alpha"),
    "--clients": (st.integers(max_value=1), "--clients"),
    "--participation": (st.one_of(st.floats(max_value=0, allow_nan=False, allow_infinity=False),
                                  st.floats(min_value=1.0001, max_value=1e6)), "--participation"),
    "--rounds": (st.integers(max_value=0), "--rounds"),
    "--local-epochs": (st.integers(max_value=0), "--local-epochs"),
    "--batch-size": (st.integers(max_value=0), "--batch-size"),
    "--lr": (st.floats(max_value=0, allow_nan=False, allow_infinity=False), "--lr"),
    "--lam": (st.one_of(st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False),
                        st.floats(min_value=1.0001, max_value=1e6)), "--lam"),
    "--temperature": (st.floats(max_value=0, allow_nan=False, allow_infinity=False), "--temperature"),
    "--mu": (st.floats(max_value=-1e-9, allow_nan=False, allow_infinity=False), "--mu"),
    "--dropout": (st.one_of(st.floats(max_value=-1e-6, allow_nan=False, allow_infinity=False),
                            st.floats(min_value=1, max_value=1e6)), "--dropout"),
    "--reps": (st.integers(max_value=0), "--reps"),
    "--data-seed": (st.integers(max_value=-1), "--data-seed"),   # numpy's partition seed (a traceback before)
    "--ea-steps": (st.integers(max_value=-1), "--ea-steps"),
    "--train-fraction": (st.one_of(st.floats(max_value=0, allow_nan=False, allow_infinity=False),
                                   st.floats(min_value=1, max_value=1e6)), "--train-fraction"),
    "--aux-size": (st.one_of(st.integers(max_value=0), st.integers(min_value=1797, max_value=10 ** 6)),
                   "--aux-size"),
    "--dataset": (st.text(min_size=1, max_size=12).filter(   # not a dataset's name in any case or alias
        lambda s: canonical_name(s, DATASETS) not in DATASETS and not s.startswith("-")),
        "--dataset"),
    "--method": (st.sampled_from(["fedsgd", "scaffold", "PFEDKDHH", "fed avg"]), "--method"),
    "--client-parallel": (st.sampled_from(["pmap", "vmapped", "seq"]), "--client-parallel"),
    "--chunk-steps": (st.integers(max_value=0), "--chunk-steps"),
    "--clients-per-round": (st.one_of(st.integers(max_value=-1), st.integers(min_value=1000, max_value=10 ** 6)),
                            "--clients-per-round"),
    "--synthetic-samples": (st.integers(max_value=1), "--synthetic-samples"),
    "--slot-granule": (st.one_of(st.integers(max_value=-1), st.sampled_from(["8.5", "eight", "Auto"])),
                       "--slot-granule"),
    "--fused-steps": (st.one_of(st.integers(max_value=-1), st.sampled_from(["2.5", "two", "AUTO"])), "--fused-steps"),
}


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_invalid_option_gives_one_line_naming_it(data, capsys):
    flag = data.draw(st.sampled_from(sorted(INVALID)))
    strategy, name = INVALID[flag]
    value = data.draw(strategy)
    rc = cli.main(["run", "--no-progress", "--out", "unused", "--rounds", "1", f"{flag}={value}"])
    captured = capsys.readouterr()
    assert rc == 2, (flag, value)
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("pfedkdh: error:") and name in lines[0], (flag, value, lines)


@settings(max_examples=3, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(clients=st.integers(2, 6), participation=st.sampled_from([0.34, 0.5, 1.0]),
       batch=st.sampled_from([8, 32]), alpha=st.sampled_from([0.3, 1.0, 10.0]), ea=st.integers(0, 2),
       seed=st.integers(0, 10 ** 6), data_seed=st.integers(0, 3))
def test_valid_small_configs_complete(tmp_path_factory, clients, participation, batch, alpha, ea, seed, data_seed):
    out = tmp_path_factory.mktemp("valid") / "run"
    rc = cli.main(["run", "--no-progress", "--out", str(out), "--rounds", "1", "--local-epochs", "1",
                   "--clients", str(clients), "--participation", str(participation), "--batch-size", str(batch),
                   "--alpha", str(alpha), "--ea-steps", str(ea), "--seed", str(seed), "--data-seed",
                   str(data_seed), "--chunk-steps", "1", "--checkpoint-every", "0"])
    assert rc == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "completed" and 0 <= summary["personalized_macro_accuracy"] <= 1
