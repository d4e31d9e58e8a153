"""How the command line and the library read the names of methods and datasets: regardless of case,
'-' and '_', and by a dataset's common alias. Imports nothing."""

from __future__ import annotations

# the datasets' other common spellings, as _bare writes them (difflib would take "fmnist" for "mnist")
DATASET_ALIASES = {"fmnist": "fashion_mnist", "fashionmnist": "fashion_mnist"}


def canonical_name(value, names):
    """``value`` as one of ``names`` when it names one regardless of case, '-' and '_', or by a
    dataset's common alias (``FedAvg`` and ``fed-avg`` → ``fedavg``, ``fmnist`` → ``fashion_mnist``);
    ``value`` unchanged otherwise (an exact match, an ambiguous one, or no match: the caller then
    names the nearest)."""
    if not isinstance(value, str) or value in names:
        return value
    alias = DATASET_ALIASES.get(bare(value))
    if alias in names:
        return alias
    same = [n for n in names if bare(n) == bare(value)]
    return same[0] if len(same) == 1 else value


def bare(name: str) -> str:
    """A name without case, '-' or '_' (``Fed-Avg`` and ``fedavg``, ``fashion-mnist`` and ``fashion_mnist``)."""
    return name.lower().replace("-", "").replace("_", "")


def clashing_name(name: str, taken) -> str | None:
    """The name of ``taken`` that ``name`` would be read as, or shadow, regardless of case, '-' and '_'
    or as a dataset's alias (``Mnist`` and ``mnist``, ``fmnist`` and ``fashion_mnist``); ``None`` if none.
    A registration under such a name would make one of the two unreachable by some spelling."""
    other = canonical_name(name, [t for t in taken if t != name])   # the reading every lookup makes
    return None if other == name else other
