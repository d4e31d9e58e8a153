"""Federated partitions of a pool (method.md §2): D_s, class-wise Dirichlet clients, their splits.

* :func:`make_partition` draws the auxiliary server set D_s uniformly at random from the pool, splits
  the rest over the clients with a class-wise Dirichlet partition (optionally balance-capped as in
  PFLlib), redraws until every client is large enough (or, with ``fill="top_up"``, draws once and
  tops the small clients up from the largest: the form that scales to thousands of clients), and
  splits each client's samples into its own train and test sets;
* :func:`shards_partition` gives each client s shards of the label-sorted samples (the FedAvg paper's
  pathological split);
* :func:`natural_partition` takes the clients from the data (a client id per sample);
* :func:`validation_partition` replaces every client's test split by a share of its train split
  (hyperparameter sweeps never read the test split);
* :func:`partition_summary` / :func:`format_summary` describe a partition; :func:`padded_index_table`
  lays ragged per-client index lists out as one rectangular table for device code.

Host numpy only; invalid options raise :class:`~pfedkdh_jax.data.sources.DataError`.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
from typing import Sequence

import numpy as np

from pfedkdh_jax.data.sources import DataError

@dataclasses.dataclass(frozen=True)
class Partition:
    """A federated split of a pool; every array holds indices into the pool.

    Attributes:
        aux_idx: ``int64 [A]``, sorted: the auxiliary server set D_s.
        train_idx: one ``int64`` array per client: the client's train split (sorted in the partitions
          made here; one's own may be in any order, each sample at most once).
        test_idx: one ``int64`` array per client: the client's own test split (likewise).
        num_clients: number of clients K.
    """

    aux_idx: np.ndarray
    train_idx: tuple
    test_idx: tuple
    num_clients: int



# --------------------------------------------------------------------------------------------------------------
# Partitioning
# --------------------------------------------------------------------------------------------------------------


FILLS = ("auto", "redraw", "top_up")   # how make_partition meets min_client_samples
AUTO_REDRAW_MAX_CLIENTS = 100          # fill="auto": the paper's redraw up to this many clients, top_up above


def _validate_partition_args(n: int, num_clients: int, alpha: float, aux_size: int, min_client_samples: int,
                             train_fraction: float, max_redraws: int, fill: str = "auto") -> None:
    """Raises :class:`DataError` (one line: option name and allowed range) for an invalid partition option."""
    if fill not in FILLS:
        raise DataError(f"fill must be one of {', '.join(FILLS)} (got {fill!r})")
    if not (np.isfinite(alpha) and alpha > 0):
        raise DataError(f"alpha must be > 0 (got {alpha})")
    if num_clients < 2:
        raise DataError(f"num_clients must be >= 2 (got {num_clients})")
    if not 0 <= aux_size < n:
        raise DataError(f"aux_size must be in [0, {n}) for a pool of {n} samples (got {aux_size})")
    if min_client_samples < 2:
        raise DataError(f"min_client_samples must be >= 2 (one train and one test sample; got {min_client_samples})")
    if not 0.0 < train_fraction < 1.0:
        raise DataError(f"train_fraction must be in (0, 1) (got {train_fraction})")
    if max_redraws < 1:
        raise DataError(f"max_redraws must be >= 1 (got {max_redraws})")
    left = n - aux_size
    if num_clients * min_client_samples > left:
        raise DataError(
            f"num_clients * min_client_samples must be <= {left} (the samples left after aux_size={aux_size}; "
            f"got {num_clients} * {min_client_samples} = {num_clients * min_client_samples})"
        )


def _class_proportions(rng: np.random.Generator, alpha: float, sizes: np.ndarray, cap: float | None) -> np.ndarray:
    """Draws p_c ~ Dir(alpha * 1_K); with a cap, clients holding >= cap samples get 0 and the rest renormalise.

    Every client below the cap keeps its share.  If all of those shares happen to be zero (possible in floating
    point for tiny alpha), the class is shared evenly among the eligible clients instead.  Some client is always
    below the cap because the samples still to be assigned keep the assigned total below N.
    """
    p = rng.dirichlet(np.full(len(sizes), alpha))
    eligible = sizes < cap if cap is not None else np.ones(len(sizes), dtype=bool)
    p = np.where(eligible & np.isfinite(p), p, 0.0)
    if not p.sum() > 0:
        p = eligible.astype(np.float64)
    return p / p.sum()


def _dirichlet_assignment(rng: np.random.Generator, labels: np.ndarray, pool_idx: np.ndarray, num_clients: int,
                          alpha: float, balance_cap: bool) -> list:
    """One class-wise Dirichlet draw: returns, per client, the list of pool-index arrays it receives."""
    cap = len(pool_idx) / num_clients if balance_cap else None
    sizes = np.zeros(num_clients, dtype=np.int64)
    chunks = [[] for _ in range(num_clients)]
    sub_labels = labels[pool_idx]
    for c in np.unique(sub_labels):
        members = pool_idx[sub_labels == c]
        members = members[rng.permutation(len(members))]
        p = _class_proportions(rng, alpha, sizes, cap)
        cuts = np.clip(np.floor(np.cumsum(p)[:-1] * len(members)).astype(np.int64), 0, len(members))
        for k, part in enumerate(np.split(members, cuts)):
            chunks[k].append(part)
            sizes[k] += len(part)
    return chunks


def _top_up(rng: np.random.Generator, clients: list, min_size: int) -> list:
    """Every client under ``min_size`` takes random samples from the currently largest client (a donor
    never drops below ``min_size``), in client order, until it holds ``min_size``. Needs
    ``sum(sizes) >= K · min_size``. Moves ``sum(max(0, min_size − n_k))`` samples, nothing else."""
    clients = list(clients)
    short = [k for k, c in enumerate(clients) if len(c) < min_size]
    donors = [(-len(c), k) for k, c in enumerate(clients) if len(c) > min_size]
    heapq.heapify(donors)
    for k in short:
        need, taken = min_size - len(clients[k]), [clients[k]]
        while need > 0:
            _, d = heapq.heappop(donors)
            take = min(need, len(clients[d]) - min_size)
            pick = rng.permutation(len(clients[d]))
            taken.append(clients[d][pick[:take]])
            clients[d] = clients[d][np.sort(pick[take:])]
            need -= take
            if len(clients[d]) > min_size:
                heapq.heappush(donors, (-len(clients[d]), d))
        clients[k] = np.concatenate(taken)
    return clients


def make_partition(labels, *, num_clients: int, alpha: float, aux_size: int = 0, min_client_samples: int = 10,
                   balance_cap: bool = False, train_fraction: float = 0.75, seed: int = 0,
                   max_redraws: int = 1000, fill: str = "auto") -> Partition:
    """Splits a pool into the auxiliary set D_s and ``num_clients`` label-skewed clients (method.md section 2).

    1. D_s: ``aux_size`` pool indices drawn uniformly at random without replacement (default 0: none, as
       ``from_arrays``'s).
    2. The remaining N samples are partitioned class by class: for each class c (in increasing label order) the
       class's samples are shuffled, ``p_c ~ Dir(alpha * 1_K)`` is drawn and the samples are cut at
       ``floor(cumsum(p_c) * n_c)``.  With ``balance_cap=True`` (the PFLlib variant) a client already holding
       ``>= N / K`` samples gets proportion 0 for the class and the other proportions are renormalised.
       ``fill="redraw"`` (the paper's): the whole class-wise draw is repeated until every client
       holds ``>= min_client_samples`` samples; D_s is drawn once and kept. ``fill="top_up"``: one
       draw, then every client under the minimum takes random samples from the currently largest
       client until it holds the minimum (with 1,000 clients at α = 0.1 no redraw succeeds, and each
       costs a whole draw; the top-up moves only the missing samples, so the draw's label skew stays;
       a first draw that satisfies the minimum is kept as it is, as with redraw). ``fill="auto"``
       (default): redraw up to 100 clients (every partition of the paper's size unchanged), top_up
       above.
    3. Each client's samples are shuffled and split into ``max(1, min(n - 1, floor(n * train_fraction)))``
       train samples and the rest as test samples, so every client has at least one of each.

    A single ``numpy.random.default_rng(seed)`` drives every step, so equal arguments give equal partitions.

    Args:
        labels: integer class labels of the pool, shape ``[n]``.
        num_clients: K >= 2.
        alpha: Dirichlet concentration > 0 (small: few classes per client; large: near IID).
        aux_size: size of D_s, in ``[0, n)``.
        min_client_samples: smallest allowed client size (train + test), >= 2.
        balance_cap: use the PFLlib balance cap described above.
        train_fraction: share of each client's samples used for training, in ``(0, 1)``.
        seed: seed of the partition generator.
        max_redraws: number of Dirichlet draws tried before giving up (``fill="redraw"``).
        fill: ``"auto"``, ``"redraw"`` or ``"top_up"`` (above).

    Returns:
        A :class:`Partition` whose index arrays are sorted ``int64`` pool indices.

    Raises:
        DataError: for an invalid option, or when no draw satisfies ``min_client_samples``.
    """
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"labels must be a non-empty 1-D integer array (got shape {labels.shape}, dtype {labels.dtype})")
    if labels.min() < 0:
        raise DataError("labels must be >= 0")
    n = len(labels)
    num_clients, aux_size, min_client_samples, max_redraws = (
        int(num_clients), int(aux_size), int(min_client_samples), int(max_redraws))
    alpha, train_fraction = float(alpha), float(train_fraction)
    _validate_partition_args(n, num_clients, alpha, aux_size, min_client_samples, train_fraction, max_redraws, fill)

    rng = np.random.default_rng(seed)
    aux_idx = np.sort(rng.choice(n, size=aux_size, replace=False)).astype(np.int64)
    in_aux = np.zeros(n, dtype=bool)
    in_aux[aux_idx] = True
    rest = np.flatnonzero(~in_aux).astype(np.int64)

    clients = None
    smallest = 0
    if fill == "auto":
        fill = "redraw" if num_clients <= AUTO_REDRAW_MAX_CLIENTS else "top_up"
    if fill == "top_up":
        chunks = _dirichlet_assignment(rng, labels, rest, num_clients, alpha, balance_cap)
        drawn = [np.concatenate(parts) if parts else np.empty(0, np.int64) for parts in chunks]
        return _split_clients(rng, aux_idx, _top_up(rng, drawn, min_client_samples), train_fraction)
    for _ in range(max_redraws):
        chunks = _dirichlet_assignment(rng, labels, rest, num_clients, alpha, balance_cap)
        candidate = [np.concatenate(parts) if parts else np.empty(0, np.int64) for parts in chunks]
        smallest = min(len(c) for c in candidate)
        if smallest >= min_client_samples:
            clients = candidate
            break
    if clients is None:
        raise DataError(
            f"no partition gave every client >= min_client_samples={min_client_samples} samples in "
            f"{max_redraws} draws (smallest client: {smallest}); lower min_client_samples, "
            "raise alpha, use fewer clients or fill='top_up' (draw once, top small clients up from the largest)"
        )

    return _split_clients(rng, aux_idx, clients, train_fraction)


def shards_partition(labels, *, num_clients: int, shards_per_client: int = 2, aux_size: int = 0,
                     train_fraction: float = 0.75, seed: int = 0) -> Partition:
    """The FedAvg paper's pathological split: D_s drawn first as in :func:`make_partition`, the rest
    sorted by label, cut into ``num_clients · shards_per_client`` shards of (nearly) equal size, and
    each client given ``shards_per_client`` shards at random: mostly one class a shard where shards are
    smaller than a class, but a shard cut across a class boundary holds more than one (MNIST, 20 clients
    × 2 shards: 7 clients hold 3 or 4 classes; with shards larger than a class, many each)."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or labels.size == 0 or not np.issubdtype(labels.dtype, np.integer):
        raise DataError(
            f"labels must be a non-empty 1-D integer array (got shape {labels.shape}, dtype {labels.dtype})")
    n, num_clients, per, aux_size = len(labels), int(num_clients), int(shards_per_client), int(aux_size)
    if num_clients < 2:
        raise DataError(f"num_clients must be >= 2 (got {num_clients})")
    if per < 1:
        raise DataError(f"shards_per_client must be >= 1 (got {per})")
    if not 0 <= aux_size < n:
        raise DataError(f"aux_size must be in [0, {n}) for a pool of {n} samples (got {aux_size})")
    if not 0.0 < float(train_fraction) < 1.0:
        raise DataError(f"train_fraction must be in (0, 1) (got {train_fraction})")
    left = n - aux_size
    if (left // (num_clients * per)) * per < 2:
        raise DataError(f"{num_clients} clients × {per} shards of the {left} samples left after aux_size={aux_size} "
                        "give a client fewer than 2 samples (one train, one test): use fewer clients or shards")
    rng = np.random.default_rng(seed)
    aux_idx = np.sort(rng.choice(n, size=aux_size, replace=False)).astype(np.int64)
    rest = np.setdiff1d(np.arange(n, dtype=np.int64), aux_idx)
    rest = rest[rng.permutation(len(rest))]                    # ties within a class in random order
    shards = np.array_split(rest[np.argsort(labels[rest], kind="stable")], num_clients * per)
    deal = rng.permutation(len(shards))
    clients = [np.concatenate([shards[j] for j in deal[k * per:(k + 1) * per]]) for k in range(num_clients)]
    return _split_clients(rng, aux_idx, clients, float(train_fraction))


def _split_clients(rng: np.random.Generator, aux_idx: np.ndarray, clients: list, train_fraction: float) -> Partition:
    """Each client's samples shuffled and split into ``max(1, min(n − 1, ⌊n·train_fraction⌋))`` train
    samples and the rest as its test split."""
    train_idx, test_idx = [], []
    for members in clients:
        shuffled = members[rng.permutation(len(members))]
        n_train = max(1, min(len(members) - 1, int(np.floor(len(members) * train_fraction))))
        train_idx.append(np.sort(shuffled[:n_train]))
        test_idx.append(np.sort(shuffled[n_train:]))
    return Partition(aux_idx=aux_idx, train_idx=tuple(train_idx), test_idx=tuple(test_idx),
                     num_clients=len(clients))


def natural_partition(client_ids, *, aux_size: int = 0, train_fraction: float = 0.75, seed: int = 0,
                      min_client_samples: int = 2) -> Partition:
    """A partition given by the data: sample i belongs to client ``client_ids[i]`` (as LEAF/FEMNIST-style
    data come), the ids ``0 … K−1``.

    D_s (``aux_size`` samples) is drawn uniformly at random from the whole pool first, as in
    :func:`make_partition`; every client keeps the rest of its samples, split into train and test the
    same way. Each client must hold at least ``min_client_samples`` (>= 2: one train and one test
    sample) after D_s is drawn; otherwise :class:`DataError` names the first that does not.
    """
    ids = np.asarray(client_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise DataError(f"client_ids must be a non-empty 1-D integer array with one id per sample (got shape "
                        f"{ids.shape}, dtype {ids.dtype})")
    if ids.min() < 0:
        raise DataError(f"client_ids must be >= 0; got {int(ids.min())}")
    n, aux_size, min_client_samples = len(ids), int(aux_size), int(min_client_samples)
    if not 0 <= aux_size < n:
        raise DataError(f"aux_size must be in [0, {n}) for a pool of {n} samples (got {aux_size})")
    if min_client_samples < 2:
        raise DataError(f"min_client_samples must be >= 2 (one train and one test sample; got {min_client_samples})")
    if not 0.0 < float(train_fraction) < 1.0:
        raise DataError(f"train_fraction must be in (0, 1) (got {train_fraction})")
    rng = np.random.default_rng(seed)
    aux_idx = np.sort(rng.choice(n, size=aux_size, replace=False)).astype(np.int64)
    rest = np.setdiff1d(np.arange(n, dtype=np.int64), aux_idx)
    k = int(ids.max()) + 1
    if k < 2:
        raise DataError(f"client_ids name {k} client; a federation needs >= 2")
    absent = np.flatnonzero(np.bincount(ids, minlength=k) == 0)
    if absent.size:
        raise DataError(f"client_ids skip id {int(absent[0])}: the ids are the clients 0..K-1 (here K = {k}); renumber "
                        "them with np.unique(client_ids, return_inverse=True)[1]")
    counts = np.bincount(ids[rest], minlength=k)
    small = np.flatnonzero(counts < min_client_samples)
    if small.size:
        c = int(small[0])
        after = " after D_s is drawn" if aux_size else ""
        more = (f" (so do {small.size - 1} more: {', '.join(map(str, small[1:6]))}{' …' if small.size > 6 else ''})"
                if small.size > 1 else "")
        raise DataError(f"client {c} holds {counts[c]} sample(s){after}{more}; every client id 0..{k - 1} needs "
                        f">= {min_client_samples} (one train and one test sample at least): drop or merge them")
    order = rest[np.argsort(ids[rest], kind="stable")]
    clients = np.split(order, np.cumsum(counts)[:-1])
    return _split_clients(rng, aux_idx, clients, float(train_fraction))


# --------------------------------------------------------------------------------------------------------------
# Summaries and layout
# --------------------------------------------------------------------------------------------------------------


def partition_summary(partition: Partition, labels: np.ndarray, num_classes: int) -> dict:
    """JSON-serialisable description of a partition.

    Keys: ``num_clients``, ``aux_size``, ``train_sizes``, ``test_sizes``, ``classes_per_client`` (classes present
    in each client's train and test data together), ``label_histogram`` (per client, the count of each class
    over train and test), ``min_train``, ``max_train``, ``mean_train``.
    """
    labels = np.asarray(labels)
    train_sizes = [int(len(t)) for t in partition.train_idx]
    test_sizes = [int(len(t)) for t in partition.test_idx]
    histogram = []
    for train, test in zip(partition.train_idx, partition.test_idx):
        client_labels = labels[np.concatenate([train, test]).astype(np.int64)]
        histogram.append([int(v) for v in np.bincount(client_labels, minlength=num_classes)[:num_classes]])
    return {
        "num_clients": int(partition.num_clients),
        "aux_size": int(len(partition.aux_idx)),
        "train_sizes": train_sizes,
        "test_sizes": test_sizes,
        "classes_per_client": [int(sum(1 for v in row if v > 0)) for row in histogram],
        "label_histogram": histogram,
        "min_train": int(min(train_sizes)),
        "max_train": int(max(train_sizes)),
        "mean_train": float(np.mean(train_sizes)),
    }


def format_summary(summary: dict, max_clients: int | None = 40) -> str:
    """Renders a :func:`partition_summary` as text: a header, one line per client, and a totals line
    (the scored split named ``validation`` when the summary's ``scored_split`` says so). Above
    ``max_clients`` clients (None: no limit) the first and last ``max_clients // 2`` are listed and one
    line counts those left out (a run's summary.json keeps every client under ``partition``)."""
    scored = summary.get("scored_split", "test")
    head = "val" if scored == "validation" else "test"
    lines = [
        f"{summary['num_clients']} clients, aux set D_s: {summary['aux_size']} samples"
        + ("; scored on a validation split of each client's train data (not its test split)"
           if scored == "validation" else ""),
        f"{'client':>6} {'train':>7} {head:>6} {'classes':>7}",
    ]
    rows = list(zip(summary["train_sizes"], summary["test_sizes"], summary["classes_per_client"]))
    shown = range(len(rows))
    if max_clients is not None and len(rows) > max_clients:
        half = max(1, max_clients // 2)
        shown = [*range(half), *range(len(rows) - half, len(rows))]
    for i, k in enumerate(shown):
        if i and k != shown[i - 1] + 1:
            lines.append(f"{'...':>6} ({k - shown[i - 1] - 1} clients not listed)")
        train, test, classes = rows[k]
        lines.append(f"{k:>6} {train:>7} {test:>6} {classes:>7}")
    lines.append(
        f"train sizes: min {summary['min_train']}, max {summary['max_train']}, mean {summary['mean_train']:.1f}; "
        f"total train {sum(summary['train_sizes'])}, total {scored} {sum(summary['test_sizes'])}"
    )
    empty = sum(1 for t in summary["test_sizes"] if t == 0)
    if empty:   # a client without a scored sample drops out of the macro means
        why = " (one train sample: none to carve)" if scored == "validation" else ""
        lines.append(f"{empty} client(s) hold no {scored} sample{why}: they are not scored (the macro means are "
                     "over the others)")
    return "\n".join(lines)


def padded_index_table(index_lists: Sequence, pad_to: int | None = None) -> tuple:
    """Stacks ragged index lists into a rectangular table for device code.

    Args:
        index_lists: K sequences of non-negative integer indices.
        pad_to: width M of the table; defaults to the longest list.  Must be >= the longest list.

    Returns:
        ``(table, sizes)``: ``table`` is ``int32 [K, M]``, row k holding list k followed by zeros;
        ``sizes`` is ``int32 [K]``, the true length of each list (use it to mask the padding).
    """
    rows = [np.asarray(idx, dtype=np.int64).reshape(-1) for idx in index_lists]
    if not rows:
        raise DataError("index_lists must hold at least one list")
    sizes = np.array([len(r) for r in rows], dtype=np.int64)
    longest = int(sizes.max())
    width = longest if pad_to is None else int(pad_to)
    if width < longest:
        raise DataError(f"pad_to must be >= the longest list ({longest}); got {pad_to}")
    for r in rows:
        if r.size and (r.min() < 0 or r.max() > np.iinfo(np.int32).max):
            raise DataError("indices must lie in [0, 2**31 - 1] to fit int32")
    table = np.zeros((len(rows), width), dtype=np.int32)
    for k, r in enumerate(rows):
        table[k, : len(r)] = r
    return table, sizes.astype(np.int32)




def validation_partition(part: Partition, fraction: float, seed: int) -> Partition:
    """Replace every client's test split by a random ``fraction`` of its train split (sweeps only:
    the real test split is then never looked at); the rest stays the client's train split."""
    rng = np.random.default_rng([seed, 1])
    train, val = [], []
    for idx in part.train_idx:
        idx = rng.permutation(idx)
        n_val = min(max(1, int(math.floor(len(idx) * fraction))), len(idx) - 1)
        val.append(np.sort(idx[:n_val]))
        train.append(np.sort(idx[n_val:]))
    return dataclasses.replace(part, train_idx=tuple(train), test_idx=tuple(val))


def evaluation_clients(num_clients: int, count: int, seed: int) -> np.ndarray:
    """A fixed random subset of ``count`` of the ``num_clients`` clients (sorted ids), the same for a
    data seed whatever the run's seed: the clients ``--eval-clients`` scores."""
    if not 1 <= count <= num_clients:
        raise DataError(f"evaluation_clients: count must be between 1 and the {num_clients} clients; got {count}")
    return np.sort(np.random.default_rng([seed, 2]).choice(num_clients, count, replace=False))


def check_partition(part: Partition, num_samples: int) -> None:
    """Raises :class:`DataError` (one line, in the partition's terms) where ``part`` cannot be trained and
    scored on a pool of ``num_samples`` samples: a client count that is not its lists', an index that is
    not an integer in ``0 … num_samples − 1``, an index array that is not 1-D, a sample twice in one
    client's split (it would weigh twice in the client's epochs and count), a client without train samples (its weight 0 in every
    average, a round of such clients would average nothing), or a client whose train and test splits
    share a sample (its test accuracy would score what it trained on). Clients may share samples with
    each other and with ``aux_idx``, and may hold no test samples (not scored)."""
    k = part.num_clients
    if not isinstance(k, (int, np.integer)) or k < 2:
        raise DataError(f"partition: num_clients must be an int >= 2 (a federation); got {k!r}")
    if len(part.train_idx) != k or len(part.test_idx) != k:
        raise DataError(f"partition.num_clients is {k} but it holds {len(part.train_idx)} train_idx and "
                        f"{len(part.test_idx)} test_idx lists: one of each per client")
    for name, lists in (("aux_idx", [part.aux_idx]), ("train_idx", part.train_idx), ("test_idx", part.test_idx)):
        for c, a in enumerate(lists):
            a = np.asarray(a)
            where = name if name == "aux_idx" else f"{name}[{c}]"
            if a.ndim != 1:
                raise DataError(f"partition.{where} must be a 1-D array of sample indices; got shape {a.shape}")
            if a.size and not np.issubdtype(a.dtype, np.integer):
                raise DataError(f"partition.{where} must hold integer sample indices; got {a.dtype}")
            if a.size and (a.min() < 0 or a.max() >= num_samples):
                bad = a.min() if a.min() < 0 else a.max()
                raise DataError(f"partition.{where} holds index {int(bad)}: indices must be in 0 … {num_samples - 1} "
                                f"(the {num_samples} samples given)")
            twice = np.unique(a, return_counts=True)
            if a.size and twice[1].max() > 1:
                raise DataError(f"partition.{where} holds index {int(twice[0][twice[1] > 1][0])} more than once: "
                                "each sample at most once per split")
    empty = [c for c, t in enumerate(part.train_idx) if len(t) == 0]
    if empty:
        raise DataError(f"partition: client(s) {', '.join(map(str, empty[:5]))}{' …' if len(empty) > 5 else ''} hold "
                        "no train samples; every client needs one (drop them, or renumber the clients)")
    for c, (tr, te) in enumerate(zip(part.train_idx, part.test_idx)):
        both = np.intersect1d(tr, te)
        if both.size:
            raise DataError(f"partition: client {c}'s train_idx and test_idx share {both.size} sample(s) (e.g. "
                            f"{int(both[0])}): its test accuracy would score samples it trained on")


def evaluation_view(part: Partition, clients) -> Partition:
    """The partition an evaluation of only ``clients`` reads: theirs unchanged, every other client's
    train and test splits empty (client ids, hence per-client state, keep their places). Evaluating
    on it computes features of the chosen clients' samples only; the macro accuracy averages over
    the clients that hold test samples, i.e. over ``clients``."""
    ids = np.asarray(clients)
    if ids.dtype == bool and ids.shape == (part.num_clients,):   # a mask over the clients
        ids = np.flatnonzero(ids)
    elif ids.size == 0:
        ids = ids.astype(np.int64)
    if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer) or (ids.size and (ids.min() < 0
                                                                                 or ids.max() >= part.num_clients)):
        raise DataError(f"evaluation_view: clients must be ids in 0 … {part.num_clients - 1} (or a mask of "
                        f"{part.num_clients}); got {ids.tolist() if ids.size <= 8 else ids}")
    keep = np.zeros(part.num_clients, bool)
    keep[ids] = True
    empty = np.zeros(0, np.int64)
    return dataclasses.replace(
        part, train_idx=tuple(t if keep[k] else empty for k, t in enumerate(part.train_idx)),
        test_idx=tuple(t if keep[k] else empty for k, t in enumerate(part.test_idx)))
