"""Every method's configuration: the one place its hyperparameters are named, defaulted, explained
and checked.

A config is a frozen dataclass; each field is declared with :func:`option` (its default, one line of
help, and the check its value must pass). Building a config checks every field and fails with one
line in Python's terms (``FedProxConfig.mu must be >= 0; got -1.0``); the command line derives its
``--method-arg`` options, their types, defaults and checks from the same fields (and words the same
failure in its own terms, ``--method-arg mu must be >= 0 for fedprox``). Class-level declarations:

* ``TRACEABLE``: the fields :meth:`~pfedkdh_jax.engine.protocol.Algorithm.with_hparams` may replace by
  traced scalars: plain numbers the method reads only in arithmetic (a method of one's own may list
  its own fields). Stacked runs and sweeps vary them in one program, the run options (``lr``;
  pFedKDH's ``lam``, ``temperature``, ``mu``) and the ``--method-arg`` options listed here alike
  (FedProx's ``mu``, Ditto's and FedProto's ``lam``, pFedMe's ``lam``, ``personal_lr`` and ``beta``,
  FedALA's ``eta``: ``pfedkdh sweep --stack --grid fedprox:mu=0.01,0.1,1``);
* ``SMOKE``: the values ``--preset smoke`` gives the method's own phases and inner loops.

The optimizer fields take an optax ``GradientTransformation``, or a function of the learning rate
returning one (then the learning rate stays the config's, and stackable), or ``None`` for the
paper's plain SGD at that learning rate. This module imports no JAX.
"""

from __future__ import annotations

import dataclasses
import inspect
import math
import numbers
import types
import typing
from typing import Any, Callable, ClassVar

KD_TARGETS = ("plain", "support", "prior")
OPTIMIZERS = ("sgd", "momentum", "adam", "adamw")   # the command line's (--optimizer)
KD_GATES = ("none", "confidence", "correct", "better", "adaptive")


class OptionError(ValueError):
    """A configuration value out of its range; ``owner``, ``field``, ``allowed`` and ``value`` say
    which, so a caller can word it in its own terms (the CLI names its flag)."""

    def __init__(self, owner: str, field: str, allowed: str, value: Any):
        self.owner, self.field, self.allowed, self.value = owner, field, allowed, value
        super().__init__(f"{owner}.{field} must be {allowed}; got {value!r}")


def option(default: Any, help: str, check: Callable[[Any], bool] | None = None, allowed: str = "",
           cli: bool = True) -> Any:
    """A config field: its default, help line, check (``check(value)`` true when valid; ``allowed``
    says what is) and whether the command line sets it as a ``--method-arg`` (plain values only)."""
    return dataclasses.field(default=default, metadata={"help": help, "check": check, "allowed": allowed,
                                                        "cli": cli})


def _is_jax(value) -> bool:
    return type(value).__module__.split(".")[0] in ("jax", "jaxlib")


def _is_traced(value) -> bool:
    """A traced JAX value (a scalar of a stacked run): not checked on the host."""
    return _is_jax(value) and any(c.__name__.endswith("Tracer") for c in type(value).__mro__)


def _is_bool(value) -> bool:
    return type(value).__name__ in ("bool", "bool_")


# a field's annotation -> whether a value is of that kind, and how an error words it (a bool is not taken
# for a number; a str field's own check lists its values)
_KINDS = {"int": (lambda v: isinstance(v, numbers.Integral) and not _is_bool(v), "an int"),
          "float": (lambda v: isinstance(v, numbers.Real) and not _is_bool(v), "a number"),
          "bool": (_is_bool, "True or False")}


def annotation_names(annotation) -> list[str]:
    """The names a field's annotation allows, e.g. ``["float", "None"]``: from its text (a module with
    ``from __future__ import annotations``: ``"float | None"``, ``"Optional[float]"``) or from the types
    themselves (``float``, ``float | None``, ``typing.Optional[float]``)."""
    if isinstance(annotation, str):
        text = annotation.replace("typing.", "").strip()
        if text.startswith("Optional[") and text.endswith("]"):
            return [p.strip() for p in text[len("Optional["):-1].split("|")] + ["None"]
        if text.startswith("Union[") and text.endswith("]"):
            return [p.strip() for p in text[len("Union["):-1].split(",")]
        return [p.strip() for p in text.split("|")]
    args = typing.get_args(annotation)
    if args and typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return [n for a in args for n in annotation_names(a)]
    if annotation is type(None) or annotation is None:
        return ["None"]
    return [getattr(annotation, "__name__", str(annotation))]


def _kind_error(annotation, value) -> str | None:
    """What ``value`` should be under a field's ``annotation`` (``int``, ``float | None``, ``bool``, ...),
    or ``None`` when it is of that kind or the annotation names no kind checked here."""
    parts = annotation_names(annotation)
    kinds = [_KINDS[p] for p in parts if p in _KINDS]
    if not kinds or (value is None and "None" in parts) or any(ok(value) for ok, _ in kinds):
        return None
    return " or ".join([word for _, word in kinds] + (["None"] if "None" in parts else []))


def _optimizer(value) -> bool:
    if value is None or (hasattr(value, "init") and hasattr(value, "update")):
        return True
    return callable(value) and _takes_one_argument(value)


def _takes_one_argument(f) -> bool:
    """Whether ``f`` can be called with the learning rate alone (an optax ``update`` function, which needs
    its state too, cannot); a callable whose signature cannot be read is given the benefit of the doubt."""
    try:
        inspect.signature(f).bind(0.1)
    except TypeError:
        return False
    except ValueError:
        return True
    return True


def positive(v) -> bool:
    return v > 0


def non_negative(v) -> bool:
    return v >= 0


def at_least_one(v) -> bool:
    return v >= 1


def optional_positive(v) -> bool:
    return v is None or v > 0


OPTIMIZER_HELP = ("an optax GradientTransformation, a function lr -> GradientTransformation, or None "
                  "(optax.sgd(lr))")
_OPT = dict(check=_optimizer, allowed="an optax GradientTransformation, a function lr -> "
            "GradientTransformation, or None", cli=False)


@dataclasses.dataclass(frozen=True)
class LocalConfig:
    """The shared local-training budget (method.md Table 1); every method's config extends it."""

    lr: float = option(0.015, "client learning rate", positive, "> 0")
    batch_size: int = option(64, "client batch size", at_least_one, ">= 1")
    local_epochs: int = option(2, "local epochs E", at_least_one, ">= 1")
    optimizer: Any = option(None, "the client optimizer: " + OPTIMIZER_HELP, **_OPT)

    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr",)
    SMOKE: ClassVar[dict[str, Any]] = {}
    RATES: ClassVar[dict[str, str]] = {"lr": "optimizer"}   # a learning rate -> the optimizer field it feeds

    def __post_init__(self):
        name = type(self).__name__
        for f in dataclasses.fields(self):
            check, value = f.metadata.get("check"), getattr(self, f.name)
            if _is_traced(value):
                if getattr(value, "ndim", 0) != 0:   # one run's value; a grid of them is vmapped over
                    raise ValueError(f"{name}.{f.name} takes one value per run (a traced scalar); got a traced "
                                     f"{value.dtype}{list(value.shape)}: vmap over the grid's values")
                continue
            if _is_jax(value):   # a concrete JAX value is checked as the Python scalar it holds
                if getattr(value, "ndim", None) != 0:
                    raise OptionError(name, f.name, "a scalar", value)
                value = value.item()
            kind = _kind_error(f.type, value)
            if kind is not None:
                raise OptionError(name, f.name, kind, value)
            if check is not None and not check(value):
                raise OptionError(name, f.name, f.metadata["allowed"], value)
        for rate, opt in self.RATES.items():   # a traced rate must reach its optimizer
            optimizer = getattr(self, opt)
            if _is_traced(getattr(self, rate)) and optimizer is not None and not _is_factory(optimizer):
                raise ValueError(f"{name}.{rate} cannot take a traced value: {name}.{opt} is a GradientTransformation "
                                 "with its learning rate built in; pass a function lr -> GradientTransformation")

    @classmethod
    def own_options(cls) -> list[dataclasses.Field]:
        """The method's own fields (beyond the shared budget) a command line may set."""
        shared = {f.name for f in dataclasses.fields(LocalConfig)}
        return [f for f in dataclasses.fields(cls) if f.name not in shared and f.metadata.get("cli", True)]


@dataclasses.dataclass(frozen=True)
class FedAvgConfig(LocalConfig):
    """FedAvg: the shared budget only."""


@dataclasses.dataclass(frozen=True)
class FedProxConfig(LocalConfig):
    """FedProx: μ of the proximal term on the whole model (the FedProx paper's MNIST value)."""

    mu: float = option(1.0, "μ, proximal weight on the full model", non_negative, ">= 0")

    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr", "mu")


@dataclasses.dataclass(frozen=True)
class FedPerConfig(LocalConfig):
    """FedPer: the shared budget only."""


@dataclasses.dataclass(frozen=True)
class FedRepConfig(LocalConfig):
    """FedRep: head epochs before the E body epochs."""

    head_epochs: int = option(10, "head-only epochs before the E representation epochs", non_negative, ">= 0")

    SMOKE: ClassVar[dict[str, Any]] = {"head_epochs": 2}


FINETUNE_PARTS = ("full", "head")


@dataclasses.dataclass(frozen=True)
class FedBABUConfig(LocalConfig):
    """FedBABU: the fine-tuning each evaluation runs first."""

    finetune_epochs: int = option(5, "τ_f, epochs of fine-tuning before evaluation (0: none)", non_negative,
                                  ">= 0")
    finetune_part: str = option("full", "what fine-tuning trains: full (body and head) or head",
                                lambda v: v in FINETUNE_PARTS, "full or head")
    finetune_optimizer: Any = option(None, "the fine-tuning's optimizer (at lr): an optax GradientTransformation, "
                                     "a function lr -> GradientTransformation, or None (the same as optimizer)",
                                     **_OPT)

    SMOKE: ClassVar[dict[str, Any]] = {"finetune_epochs": 1}


def _personal_rows():
    """The option of a method that keeps a whole model per client (Ditto, pFedMe, FedALA): where."""
    return option(0, "rows kept for personal models: 0 = one per client; 0 < N < K keeps them only for the "
                  "clients trained so far, up to N (the others stay at the start); a run sets rounds × clients "
                  "per round when that is below K", non_negative, ">= 0")


@dataclasses.dataclass(frozen=True)
class DittoConfig(LocalConfig):
    """Ditto: λ of the personal objective's proximal term."""

    lam: float = option(1.0, "λ, weight of the proximal term of the personal objective", non_negative, ">= 0")
    personal_optimizer: Any = option(None, "the personal models' optimizer (at lr): an optax GradientTransformation, "
                                     "a function lr -> GradientTransformation, or None (the same as optimizer)",
                                     **_OPT)
    personal_rows: int = _personal_rows()

    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr", "lam")


@dataclasses.dataclass(frozen=True)
class PFedMeConfig(LocalConfig):
    """pFedMe: the Moreau envelope's λ, the inner problem's steps and step size, the server's β
    (``lr`` is η, the local model's learning rate)."""

    lam: float = option(15.0, "λ, Moreau-envelope regularisation", positive, "> 0")
    inner_steps: int = option(5, "K, gradient steps on the inner problem per minibatch", at_least_one, ">= 1")
    personal_lr: float = option(0.01, "ν, step size of the inner problem", positive, "> 0")
    beta: float = option(1.0, "β, server mixing (1 = weighted average)", positive,
                         "> 0 (β = 0 would freeze the global model)")
    personal_optimizer: Any = option(None, "the inner problem's optimizer (at personal_lr): " + OPTIMIZER_HELP,
                                     **_OPT)
    personal_rows: int = _personal_rows()

    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr", "lam", "personal_lr", "beta")
    RATES: ClassVar[dict[str, str]] = {"lr": "optimizer", "personal_lr": "personal_optimizer"}
    SMOKE: ClassVar[dict[str, Any]] = {"inner_steps": 2}   # a loop still, at 2/5 of the compile


PROTO_WEIGHTINGS = ("count", "uniform")


@dataclasses.dataclass(frozen=True)
class FedProtoConfig(LocalConfig):
    """FedProto: the prototype distance's weight and how client prototypes are averaged."""

    lam: float = option(1.0, "λ, weight of the prototype distance", non_negative, ">= 0")
    proto_weighting: str = option("count", "count (the paper) or uniform (the authors' code)",
                                  lambda v: v in PROTO_WEIGHTINGS, "count or uniform")

    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr", "lam")


@dataclasses.dataclass(frozen=True)
class FedALAConfig(LocalConfig):
    """FedALA: the adaptive local aggregation's learning rate, data share and first-run epochs."""

    eta: float = option(1.0, "η, ALA weight learning rate", positive, "> 0")
    rand_percent: int = option(80, "s, % of local train data used by ALA", lambda v: 0 < v <= 100, "in (0, 100]")
    start_epochs: int = option(20, "ALA epochs the first time a client runs it (then 1)", at_least_one, ">= 1")
    personal_rows: int = _personal_rows()

    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr", "eta")


@dataclasses.dataclass(frozen=True)
class PFedSimConfig(LocalConfig):
    """pFedSim: the FedAvg warm-up's length."""

    rounds: int = option(50, "R, the run's rounds (R_w is a share of it; a run sets it, a loop of one's own "
                         "must: its default is the paper's 50)", at_least_one, ">= 1", cli=False)
    warmup: float = option(0.5, "R_w: a fraction of the rounds if < 1, else a round count", non_negative,
                           ">= 0 (a fraction of the rounds if < 1, else a round count)")
    personal_rows: int = option(0, "rows kept for the stored models: 0 = one per client; 0 < N < K keeps them "
                                "only for the clients trained since the warm-up, up to N (the others hold the "
                                "warm-up's global model); a run sets (rounds − R_w) × clients per round when "
                                "that is below K", non_negative, ">= 0")

    @property
    def warmup_rounds(self) -> int:
        return int(math.floor(self.warmup * self.rounds)) if self.warmup < 1 else int(self.warmup)


@dataclasses.dataclass(frozen=True)
class FedFedConfig(LocalConfig):
    """FedFed: phase A's length and its VAE (method.md §5.2)."""

    feature_rounds: int = option(15, "R_A, phase A's rounds (counted in the run's rounds)", at_least_one,
                                 ">= 1 (and below --rounds)")
    vae_batch_size: int = option(32, "phase A's batch", at_least_one, ">= 1", cli=False)
    vae_lr: float = option(1e-3, "the VAE's AdamW learning rate", positive, "> 0", cli=False)
    vae_weight_decay: float = option(1e-6, "the VAE's AdamW weight decay", non_negative, ">= 0", cli=False)
    noise_std: tuple = option((0.15, 0.25), "the two noisy copies of x_s", cli=False)
    feature_range: str = option("images", "the range f sees the sensitive features in (phase A's joint pass, "
                                "the pool): images, mapped as the images are (2s − 1), so that both inputs "
                                "of f share one range, as in the authors' code (where both stay on [0, 1]); "
                                "pixels, as generated (x − x_r + noise on [0, 1] pixels, while a client's "
                                "own images are on [−1, 1]: the default before 2026-12-06)",
                                lambda v: v in ("pixels", "images"), "pixels or images")
    mixup_alpha: float = option(2.0, "mixup's λ ~ Beta(α, α)", positive, "> 0", cli=False)
    recon_weight: float = option(5.0, "reconstruction loss weight", non_negative, ">= 0", cli=False)
    kl_weight: float = option(0.005, "the VAE's KL weight", non_negative, ">= 0", cli=False)
    sensitive_ce_weight: float = option(2.0, "CE of f on [s1; s2]", non_negative, ">= 0", cli=False)
    ce_weight: float = option(0.4, "CE of f on x in the joint pass", non_negative, ">= 0", cli=False)
    vae_width: int = option(32, "the VAE's channels (16, 32: the specification's); narrower only for tests",
                            lambda v: v >= 2 and v % 2 == 0, "an even number >= 2 (32: the specification's VAE)")
    vae_optimizer: Any = option(None, "the VAE's optimizer (at vae_lr): " + OPTIMIZER_HELP +
                                "; None: optax.adamw(vae_lr, weight_decay=vae_weight_decay)", **_OPT)

    TRACEABLE: ClassVar[tuple[str, ...]] = ()   # not stacked: its pool's size is the partition's
    SMOKE: ClassVar[dict[str, Any]] = {"feature_rounds": 1}


@dataclasses.dataclass(frozen=True)
class PFedKDHConfig(LocalConfig):
    """pFedKDH (defaults: method.md Table 1; λ, T, μ, EA from the validation sweeps of
    experiments/SWEEP.md, scored on a validation split of client train data). Its options are run
    flags of the command line (``--lam``, ``--kd-target``, ...), not ``--method-arg``s."""

    lam: float = option(0.0, "λ, weight of the distillation term", lambda v: 0 <= v <= 1, "in [0, 1]")
    temperature: float = option(4.0, "T, the distillation temperature", positive, "> 0")
    mu: float = option(0.01, "μ, proximal weight on the backbone", non_negative, ">= 0")
    teacher_epochs: int = option(3, "epochs of the teacher-head refit over D_s", non_negative, ">= 0")
    teacher_lr: float | None = option(None, "the refit's learning rate (default: the local lr)", optional_positive, "> 0",
                                      cli=False)
    teacher_warm_start: bool = option(True, "the refit starts from the current φ_g (False: from φ_g⁰)")
    teacher_refit_at_start: bool = option(False, "refit φ_g once on D_s before round 0 (backbone untouched; "
                                          "in Python, by prepare(), not by a round)")
    warmup_epochs: int = option(0, "E_w: train θ_g and φ_g on D_s before round 0 (0: off, as the paper; "
                                "in Python, by prepare(), not by a round)",
                                non_negative, ">= 0")
    ea_steps: int = option(20, "pFedKDH-EA: head-only SGD steps before its evaluation (0: no EA)",
                           non_negative, ">= 0")
    ea_epochs: int = option(0, "> 0: EA takes this many epochs over the client's train split instead",
                            non_negative, ">= 0")
    ea_lr: float | None = option(None, "EA's learning rate (default: the local lr)", optional_positive, "> 0")
    kd_target: str = option("plain", "the teacher distribution distilled: " + ", ".join(KD_TARGETS),
                            lambda v: v in KD_TARGETS, "one of " + ", ".join(KD_TARGETS))
    kd_gate: str = option("none", "per-sample trust in the teacher: " + ", ".join(KD_GATES),
                          lambda v: v in KD_GATES, "one of " + ", ".join(KD_GATES))
    persistent_heads: bool = option(True, "False (ablation): the selected heads are averaged (n_k) and "
                                    "every client's head becomes that average, like the backbone")
    teacher_optimizer: Any = option(None, "the teacher refit's optimizer (at teacher_lr): " + OPTIMIZER_HELP,
                                    **_OPT)
    ea_optimizer: Any = option(None, "EA's optimizer (at ea_lr): " + OPTIMIZER_HELP, **_OPT)

    TRACEABLE: ClassVar[tuple[str, ...]] = ("lr", "lam", "temperature", "mu")


def _is_factory(opt) -> bool:
    return callable(opt) and not (hasattr(opt, "init") and hasattr(opt, "update"))
