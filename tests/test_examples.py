"""The library examples (experiments/examples/) run, each at a tiny size on the digits set."""

import importlib.util
import pathlib
import sys

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "experiments" / "examples"


def load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module          # (dataclasses look their module up while the file runs)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name, argv", [
    ("resnet_adamw", ["--dataset", "digits", "--rounds", "1", "--clients", "4", "--local-epochs", "1", "--methods", "pfedkdh",
                      "--aux-size", "100", "--alpha", "0.5"]),
    ("own_loop", ["--rounds", "2", "--clients", "4", "--model", "mlp"]),
    ("lr_seed_grid", ["--rounds", "2", "--lrs", "0.0,0.05", "--seeds", "1", "--clients", "4", "--model", "mlp"]),
    ("natural_partition", ["--rounds", "3", "--writers", "4"]),
    ("own_method", ["--rounds", "2", "--clients", "4", "--model", "mlp"]),
    ("own_data", ["--rounds", "1", "--clients", "4"]),
])
def test_example_runs(name, argv, tmp_path, registry):   # own_method and own_data register on import
    out = load(name).main(argv + (["--out", str(tmp_path)] if name == "own_data" else []))
    if name == "resnet_adamw":
        assert set(out) == {"pfedkdh"} and all(0 <= r["personalized_macro_accuracy"] <= 1 for r in out.values())
        assert "ea" in out["pfedkdh"]
    elif name == "own_loop":
        assert len(out["train_loss"]) == 2 and 0 <= out["personalized_macro_accuracy_ea"] <= 1
    elif name == "lr_seed_grid":
        assert set(out) == {"lr=0.0 seed=0", "lr=0.05 seed=0"}
        assert out["lr=0.05 seed=0"] > out["lr=0.0 seed=0"]     # a learning rate of 0 learns nothing
    elif name == "own_data":
        assert set(out) == {"fedper", "fedavg"} and all(0 <= v <= 1 for v in out.values())
        assert (tmp_path / "fedper" / "summary.json").exists()
    elif name == "own_method":    # server lr 1 without momentum: FedPer's round, to float rounding
        assert out["same_as_fedper"] < 1e-6 and 0 <= out["fedperm"] <= 1 and 0 <= out["fedper"] <= 1
    else:
        assert out["clients"] == 4 and out["personalized_macro_accuracy"] > 0.5
