"""How a round's cost grows with the number of clients K and the clients a round C (issue 28;
BENCHMARKS.md, "Scaling with clients").

Every point is one ``pfedkdh run`` in a child process (so its peak memory is its own): MNIST α = 0.5,
paper preset (E = 2, batch 64, lr 0.015), data seed 0, ``--min-client-samples 5``, ``--slot-granule 8``
and ``--fused-steps 2`` (every narrow width, and every client under one batch, two steps, as one call:
what a 50-round run's auto takes at K = 10,000, where a few rounds would not pay them), a few rounds, one
evaluation of every client at the end (``--eval-every`` = the rounds; pFedKDH's EA with it). Two sweeps:

* **K at a fixed number of selected samples a round**: K ∈ {20, 100, 1,000, 10,000} on MNIST (and
  50,000 on the synthetic set, ``--dataset synthetic``), C chosen so that C · (mean train size) ≈
  ``--samples`` (4,900 by default: C = 2, 10, 100, 1,000 on MNIST). What grows with K here is the
  cost of many small clients (padding, per-client overhead, per-client state), not the samples' work;
* **C at a fixed K** (1,000): C ∈ {10, 50, 100, 200}.

Reported per point: the median training time of the rounds after the first (which compiles), the
selected clients' samples a round, the evaluation time (Fair of all K clients; for pFedKDH Fair + EA)
and the peak resident memory; then, per method, the least-squares fit ``seconds ≈ a + b · samples``
over the points and each point's distance from it. Writes JSON lines and a markdown table
(``--write``), and the figure (``--figure``).

    python experiments/scaling.py --data-dir ../shared/data/tfds --write experiments/results/scaling.jsonl \\
        --figure experiments/scaling.png

Run it with nothing else busy on the machine; timings are benchmark output, never test assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

CHILD = r"""
import json, resource, sys
from pfedkdh_jax.run import cli
rc = cli.main(sys.argv[1:])
print("SCALING " + json.dumps({"rc": rc, "peak_rss": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024}))
"""


def train_sizes(dataset: str, k: int, data_dir: str | None, samples: int | None) -> np.ndarray:
    from pfedkdh_jax.run.config import make_config
    from pfedkdh_jax.run.experiment import prepare_data
    cfg = make_config("paper", dataset=dataset, alpha=0.5, num_clients=k, min_client_samples=5,
                      data_dir=data_dir, **({"synthetic_samples": samples} if samples else {}))
    _, part, _ = prepare_data(cfg)
    return np.array([len(t) for t in part.train_idx])


def run_point(method: str, dataset: str, k: int, c: int, rounds: int, data_dir: str | None,
              synthetic: int | None, extra: list[str]) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "run")
        args = ["run", "--method", method, "--dataset", dataset, "--preset", "paper", "--alpha", "0.5",
                "--clients", str(k), "--clients-per-round", str(c), "--min-client-samples", "5",
                "--rounds", str(rounds), "--eval-every", str(rounds), "--ea-every", str(rounds),
                "--checkpoint-every", "0", "--out", out, "--no-progress",
                # the form a long run takes (auto would judge a few rounds too short to pay the widths' compiles)
                "--slot-granule", "8", "--fused-steps", "2", *extra]
        if data_dir:
            args += ["--data-dir", data_dir]
        if synthetic:
            args += ["--synthetic-samples", str(synthetic)]
        p = subprocess.run([sys.executable, "-c", CHILD, *args], capture_output=True, text=True, cwd=REPO)
        tail = [ln for ln in p.stdout.splitlines() if ln.startswith("SCALING ")]
        if p.returncode or not tail or json.loads(tail[-1][8:])["rc"] != 0:
            err = (p.stderr.strip().splitlines() or ["?"])[-1]
            return {"error": err[:300]}
        child = json.loads(tail[-1][8:])
        with open(os.path.join(out, "metrics.jsonl")) as f:
            rows = [json.loads(ln) for ln in f if ln.strip()]
    return {"rows": rows, "peak_rss": child["peak_rss"]}


def fit(points: list[dict]) -> tuple[float, float]:
    x = np.array([p["samples"] for p in points], float)
    y = np.array([p["seconds"] for p in points], float)
    b, a = np.polyfit(x, y, 1) if len(points) > 1 else (y[0] / x[0], 0.0)
    return float(a), float(b)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-dir", default=None)
    ap.add_argument("--methods", default="fedavg,fedper,pfedkdh,ditto")
    ap.add_argument("--ks", default="20,100,1000,10000", help="K of the fixed-samples sweep (MNIST)")
    ap.add_argument("--samples", type=int, default=4900, help="selected train samples a round to aim at")
    ap.add_argument("--synthetic-k", type=int, default=50000, help="K on the synthetic set (0: none)")
    ap.add_argument("--synthetic-samples", type=int, default=400_000)
    ap.add_argument("--synthetic-methods", default="fedavg,fedper")
    ap.add_argument("--cs", default="10,50,100,200", help="C of the fixed-K sweep (0 values: none)")
    ap.add_argument("--fixed-k", type=int, default=1000)
    ap.add_argument("--c-methods", default="fedavg,fedper")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--write", default=None, help="append JSON lines of every point here")
    ap.add_argument("--figure", default=None, help="write the figure (PNG) here")
    args = ap.parse_args()

    plan = []   # (sweep, method, dataset, K, synthetic samples or None)
    for k in map(int, args.ks.split(",")):
        for m in args.methods.split(","):
            plan.append(("K", m, "mnist", k, None))
    if args.synthetic_k:
        for m in args.synthetic_methods.split(","):
            plan.append(("K", m, "synthetic", args.synthetic_k, args.synthetic_samples))
    for c in (int(v) for v in args.cs.split(",") if v and int(v) > 0):
        for m in args.c_methods.split(","):
            plan.append(("C", m, "mnist", args.fixed_k, c))

    sizes_of: dict = {}
    points = []
    for sweep, method, dataset, k, extra in plan:
        synthetic = extra if dataset == "synthetic" else None
        key = (dataset, k)
        if key not in sizes_of:
            sizes_of[key] = train_sizes(dataset, k, args.data_dir, synthetic)
        sizes = sizes_of[key]
        c = extra if sweep == "C" else max(1, min(k, round(args.samples / sizes.mean())))
        got = run_point(method, dataset, k, c, args.rounds, args.data_dir, synthetic, [])
        point = {"sweep": sweep, "method": method, "dataset": dataset, "K": k, "C": c,
                 "rounds": args.rounds, "mean_train_size": float(sizes.mean())}
        if "error" in got:
            point["error"] = got["error"]
        else:
            rows = got["rows"]
            timed = rows[1:] or rows
            point.update(
                seconds=statistics.median(r["train_seconds"] for r in timed),
                first_round_seconds=rows[0]["train_seconds"],
                samples=float(np.mean([sizes[np.asarray(r["clients"])].sum() for r in timed])),
                eval_seconds=rows[-1]["eval_seconds"], peak_rss=got["peak_rss"],
                personalized_macro_accuracy=rows[-1].get("personalized_macro_accuracy"))
        points.append(point)
        print(json.dumps(point), flush=True)
        if args.write:
            with open(args.write, "a") as f:
                f.write(json.dumps(point) + "\n")
    print(table(points))
    if args.figure:
        figure(points, args.figure)


def table(points: list[dict]) -> str:
    """The markdown table of the points and, per method, the fit over its fixed-samples points."""
    lines = ["| sweep | method | data | K | C | selected samples | s/round | eval s | peak memory | from the fit |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    fits = {}
    for m in dict.fromkeys(p["method"] for p in points):
        ok = [p for p in points if p["method"] == m and "seconds" in p]
        if ok:
            fits[m] = fit(ok)
    for p in points:
        if "error" in p:
            lines.append(f"| {p['sweep']} | {p['method']} | {p['dataset']} | {p['K']:,} | {p['C']} | | failed: "
                         f"{p['error'][:80]} | | | |")
            continue
        a, b = fits[p["method"]]
        off = p["seconds"] / (a + b * p["samples"])
        lines.append(f"| {p['sweep']} | {p['method']} | {p['dataset']} | {p['K']:,} | {p['C']} | {p['samples']:,.0f} "
                     f"| {p['seconds']:.2f} | {p['eval_seconds']:.2f} | {p['peak_rss'] / 2 ** 30:.2f} GiB | {off:.2f}× |")
    lines.append("")
    lines.append("Fits, seconds a round ≈ a + b · selected samples: " + "; ".join(
        f"{m}: a = {a:.2f} s, b = {1e3 * b:.3f} ms/sample" for m, (a, b) in fits.items()))
    return "\n".join(lines)


def figure(points: list[dict], path: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    ks = [p for p in points if p["sweep"] == "K" and "seconds" in p]
    cs = [p for p in points if p["sweep"] == "C" and "seconds" in p]
    for m in dict.fromkeys(p["method"] for p in ks):
        mine = sorted((p for p in ks if p["method"] == m), key=lambda p: p["K"])
        xs = [p["K"] for p in mine]
        axes[0].plot(xs, [p["seconds"] / p["samples"] * 1e3 for p in mine], "o-", label=m)
        axes[1].plot(xs, [p["peak_rss"] / 2 ** 30 for p in mine], "o-", label=m)
    for m in dict.fromkeys(p["method"] for p in cs):
        mine = sorted((p for p in cs if p["method"] == m), key=lambda p: p["C"])
        axes[2].plot([p["samples"] for p in mine], [p["seconds"] for p in mine], "o-", label=m)
    axes[0].set(xscale="log", xlabel="clients K (synthetic set at the largest)",
                ylabel="ms a selected sample", title="round time / selected samples")
    axes[1].set(xscale="log", xlabel="clients K", ylabel="GiB", title="peak memory")
    axes[2].set(xlabel="selected samples a round", ylabel="s a round",
                title=f"K = {cs[0]['K']:,}, C varied" if cs else "C varied")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=90)


if __name__ == "__main__":
    main()
