"""What the step store adds to each call: a decode step called through `stored_jit` with the
store on, against the same step's plain `jax.jit`, alternated in one process.

    python benchmarks/step_store_overhead.py                       # a tiny model: dispatch bound
    python benchmarks/step_store_overhead.py --model smollm2-135m  # a real one

The stored path binds the arguments, flattens them and looks the step up by its leaves' shapes,
dtypes and shardings in Python before the call (jit does that in C++), a cost per call that grows
with the leaves (params + cache). The plain jit has a cost of its own: the steps carry the KV
cache's debug-check effect, which keeps them off jit's C++ fast path, while the exported step is
traced without it (benchmarks/README.md, "The step store"). The tiny model's step is dispatch
bound, so its difference is those two costs; the real model's ratio is what a decode pays.
Prints the medians (with quartiles) of both and their difference; --out writes the JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", help="tiny (random, 2 layers) or a default name")
    ap.add_argument("--calls", type=int, default=400, help="alternated calls of each")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp

    from ssd_jax.algorithm import aot, steps
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.models import backends
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.runtime.defaults import describe

    if args.model == "tiny":
        from ssd_jax.models.config import tiny_config
        from ssd_jax.models.params import random_params
        cfg = tiny_config("llama", vocab_size=40)
        params, ops = random_params(cfg, 0), backends.select("xla", None)
    else:
        from ssd_jax.models.load import load_draft
        model = load_draft(args.model, "bfloat16", "none")
        cfg, ops = model.cfg, backends.select("auto", None)
        params = ops.prepare(jax.device_put(model.params))
    z = jnp.zeros((1,), jnp.int32)
    rest = (z + 7, jnp.ones((1,), bool), jnp.int32(0), z, SamplingParams(), cfg.vocab_size)
    caches = {"plain": init_cache(cfg, 1, 512).with_lengths(z + 3),
              "stored": init_cache(cfg, 1, 512).with_lengths(z + 3)}
    stored = aot.StoredJit(steps.decode.__wrapped__, steps.decode.static_argnames,
                           steps.decode.donate_argnames)
    fns = {"plain": steps.decode.jit, "stored": stored}
    times = {k: [] for k in fns}
    with tempfile.TemporaryDirectory() as d:
        aot.set_store(d)
        for i in range(args.calls + 20):
            for name in (("plain", "stored") if i % 2 else ("stored", "plain")):
                cache = caches[name].with_lengths(z + 3)  # the same length every call
                t0 = time.perf_counter()
                out = fns[name](params, cfg, cache, *rest, ops=ops)
                jax.block_until_ready(out)
                if i >= 20:  # the first calls compile
                    times[name].append(time.perf_counter() - t0)
                caches[name] = out[2]
        aot.set_store(None)
    assert stored.plain_calls == 0 and stored.exported == 1, "the stored path was not taken"
    q = {k: statistics.quantiles(v, n=4) for k, v in times.items()}
    leaves = len(jax.tree.leaves((params, caches["plain"], *rest)))
    res = dict(model=args.model, backend=ops.name, leaves=leaves, cpu=describe(),
               jax=jax.__version__, calls=args.calls,
               loadavg=Path("/proc/loadavg").read_text().split()[:3],
               median_us={k: round(v[1] * 1e6, 1) for k, v in q.items()},
               quartiles_us={k: [round(v[0] * 1e6, 1), round(v[2] * 1e6, 1)] for k, v in q.items()})
    res["stored_minus_plain_us"] = round(res["median_us"]["stored"] - res["median_us"]["plain"], 1)
    res["ratio"] = round(q["stored"][1] / q["plain"][1], 3)
    print(json.dumps(res, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
