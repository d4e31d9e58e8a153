"""Registry of federated methods selectable with ``--method`` (kept free of JAX imports).

Each entry names the module holding the method and its factory
``from_config(cfg: RunConfig, num_classes: int, args: dict) -> algorithm``, plus the method's own
hyperparameters settable with ``--method-arg key=value``: their types and defaults (documented in the
method's module docstring, from its paper), and optionally their allowed values or minimum, checked
with the rest of the configuration before anything is loaded.
"""

from __future__ import annotations

import dataclasses
from typing import Any


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    module: str                                   # e.g. "pfedkdh_jax.pfedkdh"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> default (its type is the type)
    summary: str = ""
    choices: dict[str, tuple] = dataclasses.field(default_factory=dict)  # name -> allowed values
    minimum: dict[str, Any] = dataclasses.field(default_factory=dict)    # name -> smallest allowed value


METHODS: dict[str, MethodSpec] = {
    "pfedkdh": MethodSpec("pfedkdh_jax.pfedkdh", {}, "pFedKDH (λ, T, μ, EA steps have their own flags)"),
    # Baselines (method.md §5); defaults and their sources are in each module's docstring.
    "fedavg": MethodSpec("pfedkdh_jax.baselines.fedavg", {}, "FedAvg (McMahan et al. 2017), global model"),
    "fedprox": MethodSpec("pfedkdh_jax.baselines.fedprox", {"mu": 1.0},
                          "FedProx (Li et al. 2020), global model; μ via --method-arg mu=, not --mu",
                          minimum={"mu": 0.0}),
    "fedper": MethodSpec("pfedkdh_jax.baselines.fedper", {}, "FedPer (Arivazhagan et al. 2019)"),
    "fedrep": MethodSpec("pfedkdh_jax.baselines.fedrep", {"head_epochs": 10},
                         "FedRep (Collins et al. 2021): head epochs, then --local-epochs body epochs",
                         minimum={"head_epochs": 0}),
    "fedbabu": MethodSpec("pfedkdh_jax.baselines.fedbabu", {"finetune_epochs": 5, "finetune_part": "full"},
                          "FedBABU (Oh et al. 2022): frozen head; evaluated after fine-tuning",
                          choices={"finetune_part": ("full", "head")}, minimum={"finetune_epochs": 0}),
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
        if key in spec.choices and value not in spec.choices[key]:
            raise ValueError(f"--method-arg {key} must be one of {', '.join(map(str, spec.choices[key]))}; "
                             f"got {text!r}")
        if key in spec.minimum and value < spec.minimum[key]:
            raise ValueError(f"--method-arg {key} must be >= {spec.minimum[key]}; got {text!r}")
        out[key] = value
    return out


def build(cfg, num_classes: int):
    """The algorithm object for ``cfg.method``."""
    import importlib
    spec = METHODS[cfg.method]
    module = importlib.import_module(spec.module)
    return module.from_config(cfg, num_classes, parse_method_args(cfg.method, cfg.method_args))
