"""Registry of federated methods selectable with ``--method`` (kept free of JAX imports).

Each entry names the module holding the method and its factory
``from_config(cfg: RunConfig, num_classes: int, args: dict) -> algorithm``, plus the method's own
hyperparameters settable with ``--method-arg key=value``: their types and defaults (documented in the
method's module docstring, from its paper), and optional checks ``name -> (predicate, allowed)`` run by
the config validation, before any data is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    module: str                                   # e.g. "pfedkdh_jax.pfedkdh"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> default (its type is the type)
    summary: str = ""
    checks: dict[str, tuple[Callable[[Any], bool], str]] = dataclasses.field(default_factory=dict)


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


METHODS: dict[str, MethodSpec] = {
    "pfedkdh": MethodSpec("pfedkdh_jax.pfedkdh", {}, "pFedKDH (λ, T, μ, EA steps have their own flags)"),
    # Baselines (method.md §5); defaults and their sources are in each module's docstring.
    "fedavg": MethodSpec("pfedkdh_jax.baselines.fedavg", {}, "FedAvg (McMahan et al. 2017), global model"),
    "fedprox": MethodSpec("pfedkdh_jax.baselines.fedprox", {"mu": 1.0},
                          "FedProx (Li et al. 2020), global model; μ via --method-arg mu=, not --mu",
                          {"mu": (_non_negative, ">= 0")}),
    "fedper": MethodSpec("pfedkdh_jax.baselines.fedper", {}, "FedPer (Arivazhagan et al. 2019)"),
    "fedrep": MethodSpec("pfedkdh_jax.baselines.fedrep", {"head_epochs": 10},
                         "FedRep (Collins et al. 2021): head epochs, then --local-epochs body epochs",
                         {"head_epochs": (_non_negative, ">= 0")}),
    "fedbabu": MethodSpec("pfedkdh_jax.baselines.fedbabu", {"finetune_epochs": 5, "finetune_part": "full"},
                          "FedBABU (Oh et al. 2022): frozen head; evaluated after fine-tuning",
                          {"finetune_part": (lambda v: v in ("full", "head"), "full or head"),
                           "finetune_epochs": (_non_negative, ">= 0")}),
    "ditto": MethodSpec(
        "pfedkdh_jax.baselines.ditto", {"lam": 1.0},
        "Ditto (Li et al., ICML 2021): FedAvg global model + personal models with λ/2‖v − w‖²",
        {"lam": (lambda v: v >= 0, ">= 0")}),
    "pfedme": MethodSpec(
        "pfedkdh_jax.baselines.pfedme",
        {"lam": 15.0, "inner_steps": 5, "personal_lr": 0.01, "beta": 1.0},
        "pFedMe (Dinh et al., NeurIPS 2020): Moreau-envelope personalized models",
        {"lam": (_positive, "> 0"), "inner_steps": (_positive, ">= 1"), "personal_lr": (_positive, "> 0"),
         "beta": (_positive, "> 0 (β = 0 would freeze the global model)")}),
    "fedproto": MethodSpec(
        "pfedkdh_jax.baselines.fedproto", {"lam": 1.0, "proto_weighting": "count"},
        "FedProto (Tan et al., AAAI 2022): class prototypes instead of weights",
        {"lam": (lambda v: v >= 0, ">= 0"),
         "proto_weighting": (lambda v: v in ("count", "uniform"), "count or uniform")}),
    "fedala": MethodSpec(
        "pfedkdh_jax.baselines.fedala", {"eta": 1.0, "rand_percent": 80, "start_epochs": 20},
        "FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the head",
        {"eta": (_positive, "> 0"), "rand_percent": (lambda v: 0 < v <= 100, "in (0, 100]"),
         "start_epochs": (_positive, ">= 1")}),
}


def parse_method_args(method: str, pairs) -> dict[str, Any]:
    """``[(key, text), ...]`` -> typed dict over the method's defaults. Raises ValueError (one line)."""
    spec = METHODS[method]
    out = dict(spec.args)
    for key, text in pairs:
        if key not in spec.args:
            allowed = ", ".join(sorted(spec.args)) or "none"
            raise ValueError(f"--method-arg {key!r} is not an option of {method} (allowed: {allowed})")
        default = spec.args[key]
        try:
            if isinstance(default, bool):
                if text.lower() not in ("1", "0", "true", "false", "yes", "no"):
                    raise ValueError
                value = text.lower() in ("1", "true", "yes")
            else:
                value = type(default)(text)
        except ValueError:
            raise ValueError(f"--method-arg {key}={text!r}: expected {type(default).__name__}") from None
        out[key] = value
    for key, (ok, allowed) in spec.checks.items():
        if not ok(out[key]):
            raise ValueError(f"--method-arg {key} must be {allowed} for {method}; got {out[key]!r}")
    return out


def build(cfg, num_classes: int):
    """The algorithm object for ``cfg.method``."""
    import importlib
    spec = METHODS[cfg.method]
    module = importlib.import_module(spec.module)
    return module.from_config(cfg, num_classes, parse_method_args(cfg.method, cfg.method_args))
