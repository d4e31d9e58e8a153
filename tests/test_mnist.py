"""A short pFedKDH run on real MNIST (from $TFDS_DATA_DIR or ../shared/data/tfds)."""

import pytest

from conftest import tfds_data_dir
from pfedkdh_jax.run.config import make_config
from pfedkdh_jax.run.experiment import run

DATA_DIR = tfds_data_dir()


@pytest.mark.skipif(DATA_DIR is None, reason="no tfds data dir with MNIST (set TFDS_DATA_DIR)")
def test_short_real_mnist_run_learns(tmp_path):
    # Paper protocol (20 clients, α = 0.1, ρ = 0.5, batch 64, lr 0.015) shortened to 3 rounds of 1 epoch.
    cfg = make_config("paper", dataset="mnist", data_dir=DATA_DIR, rounds=3, local_epochs=1, ea_every=3, eval_every=3,
                      out=str(tmp_path / "run"))
    summary = run(cfg, progress=False, log=lambda *_: None)
    assert summary["partition"]["num_clients"] == 20
    assert summary["partition"]["aux_size"] == 5000
    # A label-skewed federation at chance would score ~10%; three short rounds reach ~85-90%.
    assert summary["personalized_macro_accuracy"] >= 0.75
    assert summary["personalized_macro_accuracy_ea"] >= 0.75
    assert summary["traces"] and all(v == 1 for v in summary["traces"].values())
