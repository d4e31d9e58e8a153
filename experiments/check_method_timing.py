"""How long ``check_method`` takes: README's example setting (400 digits over 4 clients, a one-layer MLP
backbone of 64 features, one local epoch of batch 16), for the example method FedPerM and for each of
the package's methods, every check; one JSON line per method (with the error where a check fails, and
the RoundOffWarnings where a repetition's gap is round-off).

    python experiments/check_method_timing.py [--methods fedper,fedavg] [--out results.jsonl]

Run it with nothing else busy: each check compiles the round again, so the figure is mostly XLA's
compile time on this CPU.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
# FedFed is checked at tol=3e-3, the tolerance its layouts check passes at (test_protocol.py's; at 1e-4 its
# sequential and vmapped layouts differ by 1e-3: its VAE grows round-off, BENCHMARKS.md "FedFed's runner check
# settled")
TOL = {"fedfed": 3e-3}


def example_module():
    spec = importlib.util.spec_from_file_location("own_method_timed", os.path.join(HERE, "examples", "own_method.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules["own_method_timed"] = mod
    spec.loader.exec_module(mod)
    return mod


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    from pfedkdh_jax.algorithms import METHODS
    ap.add_argument("--methods", default="fedperm," + ",".join(METHODS),
                    help="fedperm (the example) and the package's method names, comma-separated")
    ap.add_argument("--out", default=None, help="append the JSON lines to this file too")
    a = ap.parse_args(argv)
    import flax.linen as nn
    import jax

    import pfedkdh_jax as p
    from pfedkdh_jax.data.sources import load_pool
    mod = example_module()
    pool = load_pool("digits")
    data = p.from_arrays(pool.images[:400], pool.labels[:400], num_clients=4, alpha=1.0, aux_size=40, seed=0)
    model = p.LinenModel(mod.MLP(), nn.Dense(10))
    for name in a.methods.split(","):
        if name == "fedperm":
            algo = mod.FedPerM(model, mod.FedPerMConfig(local_epochs=1, batch_size=16))
        else:
            config = METHODS[name].config   # FedAvgConfig configures p.FedAvg, and so on
            algo = getattr(p, config.__name__.removesuffix("Config"))(model, config(local_epochs=1, batch_size=16))
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always", p.RoundOffWarning)
            try:
                p.check_method(algo, data, tol=TOL.get(name, 1e-4))
                error = None
            except p.ProtocolError as e:   # recorded: the time to the first broken promise, and which
                error = str(e)
        round_off = [str(w.message) for w in caught if issubclass(w.category, p.RoundOffWarning)]
        for w in caught:   # the others as they came
            if not issubclass(w.category, p.RoundOffWarning):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno)
        row = {"method": name, "seconds": round(time.perf_counter() - t0, 1), "passed": error is None,
               **({"error": error} if error else {}), **({"round_off": round_off} if round_off else {}),
               "backend": jax.default_backend(),
               "device_kind": jax.devices()[0].device_kind, "date": time.strftime("%Y-%m-%d")}
        print(json.dumps(row), flush=True)
        if a.out:
            with open(a.out, "a") as f:
                f.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
