"""The federated methods, one module each, and their registry (``--method NAME``).

=========  ==========================================================================================
pfedkdh    :mod:`.pfedkdh`: the paper's method (shared backbone, persistent heads, distillation from a
           refit teacher, EA)
fedavg     :mod:`.fedavg`: full model averaged; global-model evaluation
fedprox    :mod:`.fedprox`: FedAvg + μ/2‖w − w_g‖² locally
fedper     :mod:`.fedper`: base averaged, heads personal, trained together
fedrep     :mod:`.fedrep`: head epochs then body epochs, body averaged
fedbabu    :mod:`.fedbabu`: head frozen at φ⁰, body averaged; fine-tuned to evaluate
ditto      :mod:`.ditto`: FedAvg global model + personal models pulled towards it
pfedme     :mod:`.pfedme`: Moreau-envelope personal models, β-mixed server step
fedproto   :mod:`.fedproto`: class prototypes exchanged instead of weights
fedala     :mod:`.fedala`: adaptive local aggregation of the head
pfedsim    :mod:`.pfedsim`: FedAvg warm-up, then similarity-weighted mixing of the stored bodies
fedfed     :mod:`.fedfed`: feature distillation (a VAE's noisy sensitive features pooled), then FedAvg
=========  ==========================================================================================

The protocol every module implements is :mod:`.base`; their shared helpers are :mod:`.common`. This
file is the registry: for each method, its module (which defines ``from_config(cfg, num_classes,
args)``), its own options settable with ``--method-arg key=value`` (types and defaults; their sources
are in the module's docstring) with their checks, and the run options (``RunConfig`` fields beyond the
shared budget) it reads. It imports no JAX, so the CLI validates options before anything is compiled.
"""

from __future__ import annotations

import dataclasses
import importlib
from typing import Any, Callable

# pFedKDH's teacher-to-client transfer forms (their meaning: pfedkdh_jax.algorithms.pfedkdh)
KD_TARGETS = ("plain", "support", "prior")
KD_GATES = ("none", "confidence", "correct", "better", "adaptive")


@dataclasses.dataclass(frozen=True)
class MethodSpec:
    module: str                                   # e.g. "pfedkdh_jax.algorithms.fedavg"
    args: dict[str, Any] = dataclasses.field(default_factory=dict)  # name -> default (its type is the type)
    summary: str = ""
    checks: dict[str, tuple[Callable[[Any], bool], str]] = dataclasses.field(default_factory=dict)
    run_options: tuple[str, ...] = ()             # RunConfig fields it reads beyond the shared budget
    # (args, run config) -> a one-line error or None: checks that relate its options to the run's
    run_check: Callable[[dict, Any], str | None] | None = None
    # the metric its row of a results table reports: personalized (the paper's), or the global
    # model's for the methods whose result is one shared model
    table_metric: str = "personalized_macro_accuracy"
    # whether its runs on other partitions of one pool stack into one program (run_stacked): its
    # state's and round's shapes do not depend on the partition beyond the padded tables
    stackable: bool = True
    # RunConfig fields (plain numbers, read only in arithmetic, of the same name in the method's
    # config) that stacked runs may differ in: each run's algorithm is rebuilt from its own values
    # inside the one program (Algorithm.with_hparams)
    traced: tuple[str, ...] = ("lr",)
    # its own options' values under ``--preset smoke`` (its phases and inner loops scaled to a 2-round
    # run); an explicit --method-arg wins
    smoke: dict[str, Any] = dataclasses.field(default_factory=dict)


def _positive(v) -> bool:
    return v > 0


def _non_negative(v) -> bool:
    return v >= 0


def _module(name: str) -> str:
    return f"pfedkdh_jax.algorithms.{name}"


# RunConfig fields only pFedKDH reads (the others are every method's budget or the run's own).
PFEDKDH_OPTIONS = ("lam", "temperature", "mu", "teacher_epochs", "teacher_warm_start",
                   "teacher_refit_at_start", "warmup_epochs", "ea_steps", "ea_epochs", "ea_lr",
                   "kd_target", "kd_gate", "persistent_heads")

METHODS: dict[str, MethodSpec] = {
    "pfedkdh": MethodSpec(_module("pfedkdh"), {}, "pFedKDH (its options are run flags: --lam, --kd-target, ...)",
                          run_options=PFEDKDH_OPTIONS, traced=("lr", "lam", "temperature", "mu")),
    # Baselines (method.md §5); defaults and their sources are in each module's docstring.
    "fedavg": MethodSpec(_module("fedavg"), {}, "FedAvg (McMahan et al. 2017), global model",
                         table_metric="global_macro_accuracy"),
    "fedprox": MethodSpec(_module("fedprox"), {"mu": 1.0},
                          "FedProx (Li et al. 2020), global model; μ via --method-arg mu=, not --mu",
                          {"mu": (_non_negative, ">= 0")}, table_metric="global_macro_accuracy"),
    "fedper": MethodSpec(_module("fedper"), {}, "FedPer (Arivazhagan et al. 2019)"),
    "fedrep": MethodSpec(_module("fedrep"), {"head_epochs": 10},
                         "FedRep (Collins et al. 2021): head epochs, then --local-epochs body epochs",
                         {"head_epochs": (_non_negative, ">= 0")}, smoke={"head_epochs": 2}),
    "fedbabu": MethodSpec(_module("fedbabu"), {"finetune_epochs": 5, "finetune_part": "full"},
                          "FedBABU (Oh et al. 2022): frozen head; evaluated after fine-tuning",
                          {"finetune_part": (lambda v: v in ("full", "head"), "full or head"),
                           "finetune_epochs": (_non_negative, ">= 0")}, smoke={"finetune_epochs": 1}),
    "ditto": MethodSpec(
        _module("ditto"), {"lam": 1.0},
        "Ditto (Li et al., ICML 2021): FedAvg global model + personal models with λ/2‖v − w‖²",
        {"lam": (_non_negative, ">= 0")}),
    "pfedme": MethodSpec(
        _module("pfedme"), {"lam": 15.0, "inner_steps": 5, "personal_lr": 0.01, "beta": 1.0},
        "pFedMe (Dinh et al., NeurIPS 2020): Moreau-envelope personalized models",
        {"lam": (_positive, "> 0"), "inner_steps": (_positive, ">= 1"), "personal_lr": (_positive, "> 0"),
         "beta": (_positive, "> 0 (β = 0 would freeze the global model)")}),
    "fedproto": MethodSpec(
        _module("fedproto"), {"lam": 1.0, "proto_weighting": "count"},
        "FedProto (Tan et al., AAAI 2022): class prototypes instead of weights",
        {"lam": (_non_negative, ">= 0"),
         "proto_weighting": (lambda v: v in ("count", "uniform"), "count or uniform")}),
    "fedala": MethodSpec(
        _module("fedala"), {"eta": 1.0, "rand_percent": 80, "start_epochs": 20},
        "FedALA (Zhang et al., AAAI 2023): adaptive local aggregation of the head",
        {"eta": (_positive, "> 0"), "rand_percent": (lambda v: 0 < v <= 100, "in (0, 100]"),
         "start_epochs": (_positive, ">= 1")}),
    "pfedsim": MethodSpec(
        _module("pfedsim"), {"warmup": 0.5},
        "pFedSim (Tan et al. 2023): FedAvg warm-up, then similarity-weighted bodies, personal classifiers",
        {"warmup": (_non_negative, ">= 0 (a fraction of the rounds if < 1, else a round count)")}),
    "fedfed": MethodSpec(
        _module("fedfed"), {"feature_rounds": 15, "vae_width": 32},
        "FedFed (Yang et al., NeurIPS 2023): feature distillation rounds, then FedAvg with a shared pool",
        {"feature_rounds": (_positive, ">= 1 (and below --rounds)"),
         "vae_width": (lambda v: v >= 2 and v % 2 == 0, "an even number >= 2 (32: the specification's VAE)")},
        run_check=lambda a, cfg: (None if a["feature_rounds"] < cfg.rounds else
                                  f"--method-arg feature_rounds must be below --rounds {cfg.rounds} for fedfed "
                                  f"(phase A's rounds count in the run's); got {a['feature_rounds']}"),
        table_metric="global_macro_accuracy", stackable=False, traced=(),   # the pool's size is the partition's
        smoke={"feature_rounds": 1}),
}


def parse_method_args(method: str, pairs, cfg=None) -> dict[str, Any]:
    """``[(key, text), ...]`` -> typed dict over the method's defaults (checked against the run
    config ``cfg`` too when given). Raises ValueError (one line)."""
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
    problem = spec.run_check(out, cfg) if spec.run_check is not None and cfg is not None else None
    if problem:
        raise ValueError(problem)
    return out


def build(cfg, num_classes: int):
    """The algorithm object for ``cfg.method`` (imports its module, and JAX, only now)."""
    module = importlib.import_module(METHODS[cfg.method].module)
    return module.from_config(cfg, num_classes, parse_method_args(cfg.method, cfg.method_args, cfg))
