"""The cache-attention kernel (models/cpu/attention.py) against its XLA reference, side by side.

    taskset -c 0 python benchmarks/cache_attention.py
    taskset -c 0,1 python benchmarks/cache_attention.py --slots 256,2048 --tokens 1,5

For each cache size and token count: 28 layers' KV write + attention in one jit (the 1.5B target's
shapes: 12 query heads, 2 kv heads, head dim 128, bf16, one sequence, the cache filled to 56 slots
short of its end), the caches donated and fed back, median of `--iters` calls. The reference's
time is XLA's formulation alone; in the model it also paid a copy of each cache after the write.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--slots", default="256,2048", help="cache sizes (comma-separated)")
    ap.add_argument("--tokens", default="1,5", help="new tokens per call (comma-separated)")
    ap.add_argument("--layers", type=int, default=28)
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models.cpu import attention
    from ssd_jax.models.ops import xla_attend

    H, KVH, D, dt = 12, 2, 128, jnp.bfloat16
    rng = np.random.default_rng(0)
    a = lambda *s: jnp.asarray(rng.standard_normal(s, dtype=np.float32), dt)  # noqa: E731
    print(f"{args.layers} layers, {H}/{KVH} heads, D {D}, bf16, {jax.device_count()} device(s), "
          f"median of {args.iters} (ms)")
    print("| cache slots | new tokens | XLA reference | kernel | reference / kernel |")
    print("|---|---|---|---|---|")
    for S in map(int, args.slots.split(",")):
        for T in map(int, args.tokens.split(",")):
            q, kn, vn = a(1, T, H, D), a(1, T, KVH, D), a(1, T, KVH, D)
            pos = jnp.asarray(S - 56 + np.arange(T)[None], jnp.int32)
            res = {}
            for name, fn in (("reference", xla_attend),
                             ("kernel", attention.kernel)):
                def layers(x, ks, vs, fn=fn):
                    out_k, out_v = [], []
                    for kc, vc in zip(ks, vs):  # each layer's output feeds the next one's query
                        o, kc, vc = fn(x, kn, vn, pos, kc, vc)
                        x = x + 0 * o.reshape(x.shape)
                        out_k.append(kc)
                        out_v.append(vc)
                    return x, out_k, out_v
                f = jax.jit(layers, donate_argnums=(1, 2))
                ks = [a(1, S, KVH, D) for _ in range(args.layers)]
                vs = [a(1, S, KVH, D) for _ in range(args.layers)]
                x, ks, vs = f(q, ks, vs)
                jax.block_until_ready(x)
                times = []
                for _ in range(args.iters):
                    t0 = time.perf_counter()
                    x, ks, vs = f(q, ks, vs)
                    jax.block_until_ready(x)
                    times.append(time.perf_counter() - t0)
                res[name] = statistics.median(times) * 1e3
            print(f"| {S} | {T} | {res['reference']:.2f} | {res['kernel']:.2f} | "
                  f"{res['reference'] / res['kernel']:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
