"""A decode step with its layers unrolled (models/transformer.py `forward`, as the engine runs it)
against the same step as a `lax.scan` over stacked layers: compile cost and run time.

    python benchmarks/scan_layers_probe.py --model smollm2-135m --cache-lens 256,2048

The plain-XLA op table only (`ssd_jax.models.ops`): the cpu table's attention kernel updates one
layer's cache in place and has no form that takes a stacked cache and a layer index, so a scan
over it would copy a layer's cache in and out every layer (what transformer.py's docstring says of
a scan with the cache as scanned state). Two scans over the stacked cache [L, B, S, KVH, D]:
`scan` carries it and writes each layer's new row on the carry (`.at[i].set`), attention reading
layer i's slice; `scan-readonly` reads layer i's cache as a scanned input, attends to it and to
the new rows as two blocks of one softmax, returns the new rows, and writes all layers' rows after
the loop (one scatter into the donated cache). Every variant donates its cache and gets it back
each call, as the engine's steps do. Per variant: trace, lowering, XLA compile, the serialised executable's size and
load time (what a persistent-cache hit pays besides the read), and the run time of the two
compiled steps alternated in one process (median of per-round ratios to unrolled), at each
cache length; the greedy tokens and logits are checked equal.
"""
from __future__ import annotations

import argparse
import functools
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _carry(name, a, out):
    """Feed a call's donated cache back as the next call's (lengths kept: the same row rewritten)."""
    import jax.numpy as jnp
    if name == "unrolled":
        a[1] = out[2].with_lengths(jnp.array(_LEN[0], copy=True))
    else:
        a[2], a[3] = out[2], out[3]


_LEN = [None]


def main(argv=None) -> int:
    """Compile both variants at each cache length, check them equal, time them alternated."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--cache-lens", default="256,2048")
    ap.add_argument("--context", type=int, default=100, help="tokens already cached")
    ap.add_argument("--rounds", type=int, default=60)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from compile_probe import compile_phases  # this folder (the script's sys.path[0])
    from ssd_jax.models import transformer as tf
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.load import load_model
    from ssd_jax.models.ops import XLA, write_kv, cache_attention
    from ssd_jax.runtime.defaults import describe

    model = load_model(args.model, args.dtype)
    cfg, params = model.cfg, jax.device_put(model.params)
    stacked = jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *params.layers)

    @functools.partial(jax.jit, donate_argnums=(1,))
    def unrolled(params, cache, bonus):
        logits, cache = tf.forward(params, cfg, bonus[:, None], cache, ops=XLA)
        return jnp.argmax(logits[:, 0], -1), logits[:, 0], cache

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def scanned(params, stacked, kc, vc, lengths, bonus):
        positions = lengths[:, None]
        x = params.embed[bonus[:, None]]

        def body(carry, layer):
            x, kc, vc = carry
            i, lp = layer
            q, k, v = tf._qkv(lp, cfg, XLA, x, positions, 1)
            kc = kc.at[i].set(write_kv(kc[i], positions, k))  # in place on the carry
            vc = vc.at[i].set(write_kv(vc[i], positions, v))
            att = cache_attention(q, kc[i], vc[i], positions)
            x = x + XLA.dense(att, lp.wo)
            x = x + tf._mlp(lp, cfg, XLA, x, 1)
            return (x, kc, vc), None

        (x, kc, vc), _ = jax.lax.scan(body, (x, kc, vc), (jnp.arange(cfg.num_layers), stacked))
        logits = tf._logits(params, cfg, XLA, x)
        return jnp.argmax(logits[:, 0], -1), logits[:, 0], kc, vc

    def two_block_attention(q, kc, vc, k_new, v_new, lengths):
        """softmax over [cache slots < lengths, new rows t' <= t] without writing the cache."""
        B, T, H, D = q.shape
        W, KVH = kc.shape[1], kc.shape[2]
        qg = q.reshape(B, T, KVH, H // KVH, D)
        s1 = jnp.einsum("btkgd,bskd->bkgts", qg, kc, preferred_element_type=jnp.float32)
        s2 = jnp.einsum("btkgd,bskd->bkgts", qg, k_new.astype(kc.dtype),
                        preferred_element_type=jnp.float32)
        s1 = jnp.where((jnp.arange(W)[None, :] < lengths[:, None])[:, None, None, None], s1 * D ** -0.5, -1e30)
        causal = jnp.arange(T)[:, None] >= jnp.arange(T)[None, :]
        s2 = jnp.where(causal[None, None, None], s2 * D ** -0.5, -1e30)
        m = jnp.maximum(s1.max(-1, keepdims=True), s2.max(-1, keepdims=True))
        p1, p2 = jnp.exp(s1 - m), jnp.exp(s2 - m)
        z = p1.sum(-1, keepdims=True) + p2.sum(-1, keepdims=True)
        p1, p2 = (p1 / z).astype(vc.dtype), (p2 / z).astype(vc.dtype)
        o = (jnp.einsum("bkgts,bskd->btkgd", p1, vc, preferred_element_type=jnp.float32)
             + jnp.einsum("bkgts,bskd->btkgd", p2, v_new.astype(vc.dtype),
                          preferred_element_type=jnp.float32))
        return o.reshape(B, T, H * D).astype(q.dtype)

    @functools.partial(jax.jit, donate_argnums=(2, 3))
    def scanned_ro(params, stacked, kc, vc, lengths, bonus):
        """The scan reads each layer's cache (xs) and returns its new rows (ys); one write after."""
        positions = lengths[:, None]
        x = params.embed[bonus[:, None]]

        def body(x, layer):
            lp, kci, vci = layer
            q, k, v = tf._qkv(lp, cfg, XLA, x, positions, 1)
            att = two_block_attention(q, kci, vci, k, v, lengths)
            x = x + XLA.dense(att, lp.wo)
            x = x + tf._mlp(lp, cfg, XLA, x, 1)
            return x, (k, v)

        x, (k_new, v_new) = jax.lax.scan(body, x, (stacked, kc, vc))
        write = jax.vmap(write_kv, in_axes=(0, None, 0))
        kc, vc = write(kc, positions, k_new), write(vc, positions, v_new)
        logits = tf._logits(params, cfg, XLA, x)
        return jnp.argmax(logits[:, 0], -1), logits[:, 0], kc, vc

    res = dict(model=args.model, dtype=args.dtype, cpu=describe(), jax=jax.__version__,
               date=time.strftime("%Y-%m-%d %H:%M:%S"),
               loadavg=Path("/proc/loadavg").read_text().split()[:3], runs={})
    bonus = jnp.asarray([17], jnp.int32)
    for S in [int(s) for s in args.cache_lens.split(",") if s]:
        lengths = jnp.asarray([args.context], jnp.int32)
        _LEN[0] = lengths
        cache = init_cache(cfg, 1, S).with_lengths(lengths)
        # the same cached context for both: random rows in the first `context` slots
        key = jax.random.key(0)
        ks = [jax.random.normal(jax.random.fold_in(key, i), c.shape, c.dtype) * 0.5
              for i, c in enumerate(cache.k + cache.v)]
        L = cfg.num_layers
        cache = type(cache)(k=tuple(ks[:L]), v=tuple(ks[L:]), lengths=lengths)
        kc, vc = jnp.stack(cache.k), jnp.stack(cache.v)
        rows, compiled = {}, {}
        fresh = lambda t: jax.tree_util.tree_map(lambda y: jnp.array(y, copy=True), t)
        for name, fn, a in (("unrolled", unrolled, (params, fresh(cache), bonus)),
                            ("scan", scanned, (params, stacked, fresh(kc), fresh(vc), lengths, bonus)),
                            ("scan-readonly", scanned_ro, (params, stacked, fresh(kc), fresh(vc),
                                                           lengths, bonus))):
            c, payload, phases = compile_phases(fn, *a)
            rows[name] = dict({k: round(t, 2 if k == "compile_s" else 3) for k, t in phases.items()},
                              serialized_mb=round(len(payload) / 1e6, 2))
            compiled[name] = (c, list(a))
        outs = {}
        for n, (c, a) in compiled.items():
            o = c(*a)
            outs[n] = o[:2]
            _carry(n, a, o)
        same_tok = all(bool(np.array_equal(np.asarray(outs["unrolled"][0]), np.asarray(o[0])))
                       for o in outs.values())
        max_diff = max(float(jnp.max(jnp.abs(outs["unrolled"][1] - o[1]))) for o in outs.values())
        times = {n: [] for n in compiled}
        order, rng = list(compiled), random.Random(0)
        for r in range(args.rounds + 3):
            rng.shuffle(order)
            for n in order:
                c, a = compiled[n]
                t0 = time.perf_counter()
                o = jax.block_until_ready(c(*a))
                if r >= 3:
                    times[n].append(time.perf_counter() - t0)
                _carry(n, a, o)
        for n in compiled:
            rows[n]["run_ms"] = round(statistics.median(times[n]) * 1e3, 3)
            ratio = [s / u for s, u in zip(times[n], times["unrolled"])]
            q = statistics.quantiles(ratio, n=4)
            rows[n].update(over_unrolled=round(statistics.median(ratio), 4),
                           ratio_quartiles=[round(q[0], 4), round(q[2], 4)])
        res["runs"][S] = dict(rows, same_tokens=same_tok, max_logit_diff=max_diff)
        print(json.dumps({S: res["runs"][S]}), flush=True)
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                           f"scan_layers_probe-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
