"""How two CPU cores are best used for full-batch steps of the paper's CNN (issue 28; BENCHMARKS.md,
"Two cores: one process with two XLA:CPU devices against one process per core").

The engine spreads sequential clients over XLA:CPU host devices of one process (``--client-devices``,
two on a 2-core machine). This script measures what that layout gets from the cores against other ways
of running the same steps, each a child process started fresh:

* ``onecore``: one process, one device, pinned to one core (a core's own rate);
* ``inproc``: one process, N devices, calls alternating over them (the engine's layout);
* ``pinned``: N processes, one device each, each pinned to its own core, running at the same time;
* ``free``: the same N processes, not pinned.

The processes of a mode compile and warm up first, then start their timed calls together.

Every step is one SGD step of the CNN (MNIST shapes, a full batch of 64, cross-entropy, ``optax.sgd``),
eight of them unrolled in one compiled call as the engine's chunks are, compiled with the engine's
local-training options. Reported: milliseconds per step and core-seconds per step (for the N-way modes,
wall time ÷ the steps all processes took, the effective rate of the machine). The modes take turns,
``--cycles`` times. Run it with nothing else busy:

    python experiments/core_layouts.py --cycles 3 --write experiments/results/core_layouts.jsonl

Timings are benchmark output, never test assertions.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = ("onecore", "inproc", "pinned", "free")


def child(devices: int, calls: int, core: int | None) -> None:
    """Time ``calls`` rounds of one 8-step call per device; print one JSON line."""
    if core is not None:
        os.sched_setaffinity(0, {core})          # before JAX starts its threads
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                               f" --xla_force_host_platform_device_count={devices}").strip()
    import jax
    import jax.numpy as jnp
    import numpy as np
    import optax

    from pfedkdh_jax.engine.layout import local_training_compiler_options
    from pfedkdh_jax.model import CNN

    model = CNN(10)
    params = model.init(jax.random.key(0), (28, 28, 1))
    tx = optax.sgd(0.015)

    def loss(p, x, y):
        return optax.softmax_cross_entropy_with_integer_labels(model.logits(p, x), y).mean()

    def steps(p, x, y):
        for s in range(x.shape[0]):
            g = jax.grad(loss)(p, x[s], y[s])
            u, _ = tx.update(g, tx.init(p), p)
            p = optax.apply_updates(p, u)
        return p

    f = jax.jit(steps, compiler_options=local_training_compiler_options(), donate_argnums=0)
    rng = np.random.default_rng(0)
    devs = jax.devices()
    xs = [jax.device_put(jnp.asarray(rng.random((8, 64, 28, 28, 1), np.float32)), d) for d in devs]
    ys = [jax.device_put(jnp.asarray(rng.integers(0, 10, (8, 64)), jnp.int32), d) for d in devs]
    ps = [jax.tree_util.tree_map(jnp.copy, jax.device_put(params, d)) for d in devs]
    for _ in range(2):                            # compile and warm up
        ps = [f(ps[i], xs[i], ys[i]) for i in range(len(devs))]
    jax.block_until_ready(ps)
    print("ready", flush=True)                    # the parent starts every process's timing at once
    sys.stdin.readline()
    t = time.perf_counter()
    for _ in range(calls):
        ps = [f(ps[i], xs[i], ys[i]) for i in range(len(devs))]
    jax.block_until_ready(ps)
    wall = time.perf_counter() - t
    print(json.dumps({"devices": len(devs), "steps": calls * 8 * len(devs), "seconds": wall}), flush=True)


def cpu_name() -> str:
    """The processor's model name (Linux), or the platform's."""
    try:
        with open("/proc/cpuinfo") as fh:
            return next(line.split(":", 1)[1].strip() for line in fh if line.startswith("model name"))
    except (OSError, StopIteration):
        import platform
        return platform.processor() or platform.machine()


def run_mode(mode: str, cores: int, calls: int) -> dict:
    """One measurement of ``mode``: ms per step of each process and of the machine."""
    me = [sys.executable, os.path.abspath(__file__), "--child"]
    if mode == "onecore":
        specs = [(1, 0)]
    elif mode == "inproc":
        specs = [(cores, None)]
    else:
        specs = [(1, c if mode == "pinned" else None) for c in range(cores)]
    procs = [subprocess.Popen(me + [str(d), str(calls), "" if c is None else str(c)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True) for d, c in specs]
    for p in procs:                               # every process compiled and warmed up ...
        if p.stdout.readline().strip() != "ready":
            raise RuntimeError(f"a {mode} child failed before its timing (exit {p.wait()})")
    for p in procs:                               # ... before any starts its timed calls
        p.stdin.write("go\n")
        p.stdin.flush()
    outs = [json.loads(p.communicate()[0].strip().splitlines()[-1]) for p in procs]
    steps = sum(o["steps"] for o in outs)
    wall = max(o["seconds"] for o in outs)
    return {"mode": mode, "processes": len(outs),
            "ms_per_step_each": [1e3 * o["seconds"] / o["steps"] for o in outs],
            "ms_per_step_machine": 1e3 * wall / steps}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--child", nargs=3, metavar=("DEVICES", "CALLS", "CORE"), help=argparse.SUPPRESS)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--cores", type=int, default=2, help="devices / processes of the N-way modes")
    ap.add_argument("--calls", type=int, default=15, help="timed calls (8 steps each) per device")
    ap.add_argument("--cycles", type=int, default=3, help="times the modes take turns")
    ap.add_argument("--write", default=None, help="append the JSON rows here")
    args = ap.parse_args()
    if args.child:
        d, calls, core = args.child
        child(int(d), int(calls), int(core) if core else None)
        return
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"--modes: unknown {unknown}; choose from {', '.join(MODES)}")
    have = len(os.sched_getaffinity(0))
    if args.cores > have:
        ap.error(f"--cores {args.cores} but this process may use {have} cores")
    rows, began = [], time.strftime("%H:%M")
    for cycle in range(args.cycles):
        for mode in modes:
            r = run_mode(mode, args.cores, args.calls)
            r["cycle"] = cycle
            rows.append(r)
            print(f"cycle {cycle} {mode:8s} ms a step, each process: "
                  f"{' / '.join(f'{v:.2f}' for v in r['ms_per_step_each'])}; machine: {r['ms_per_step_machine']:.2f}",
                  flush=True)
    print("\n| layout | ms a step, each process (median) | ms a step of the machine (median, min–max) |")
    print("|---|---|---|")
    for mode in modes:
        got = [r for r in rows if r["mode"] == mode]
        each = statistics.median(v for r in got for v in r["ms_per_step_each"])
        mach = [r["ms_per_step_machine"] for r in got]
        print(f"| {mode} | {each:.2f} | {statistics.median(mach):.2f} ({min(mach):.2f}–{max(mach):.2f}) |")
    if args.write:
        stamp = {"date": time.strftime("%Y-%m-%d"), "window": f"{began}-{time.strftime('%H:%M')}", "cpu": cpu_name(),
                 "cores": args.cores}
        with open(args.write, "a") as fh:
            for r in rows:
                fh.write(json.dumps({**stamp, **r}) + "\n")


if __name__ == "__main__":
    main()
