"""Where a step's compile time goes, and what a cheaper trace of the CPU kernels would save.

    python benchmarks/compile_probe.py --model qwen2.5-coder-0.5b --quant int4 --steps draft_tree,draft_chain
    python benchmarks/compile_probe.py --model qwen2.5-coder-1.5b --steps verify,decode

For each step (the shapes of the CLI's first SSD / SD / AR call: batch 1, a 4,096-slot cache, K=5
with fan-out 0,..,0,1 for the tree, K=4 for SD's chain and verify) and each variant, one process
times: the trace (`jit(...).trace`), the lowering to StableHLO, XLA's compile, the size of the
serialised executable and the time to load it back (`jax.experimental.serialize_executable`),
which is what a persistent-cache hit pays besides reading the file; then the compiled variants'
run times, alternated in one process (median of per-round ratios to the first variant).

Variants: `as-is` (the cpu backend's ops as they are since 138cbc4: each kernel call is
`custom_vjp(kernel)`, models/cpu/build.py `dispatch`); `platform-switch` (how they were before,
and what the figures in benchmarks/README.md call "as-is": the same kernel wrapped in
`lax.platform_dependent(cpu=kernel, default=reference)` under the same custom_vjp, whose tracing
traces the XLA reference of every call as well, and whose CPU lowering keeps the kernel branch
alone); `tree-scan` (as-is, with `draft_tree(tree_loop="scan")`: the K branch steps one
`lax.scan` body instead of K unrolled copies). This file patches the plug-in's modules in its own process only.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("as-is", "platform-switch", "tree-scan")
STEPS = ("draft_tree", "draft_chain", "verify", "decode")


def _patch(variant: str):
    """Make the cpu plug-in's modules call their kernels as `variant` says (this process only)."""
    from ssd_jax.models.cpu import attention, build, int4, matmul, swiglu

    import functools

    import jax

    orig = build.dispatch
    if variant in ("as-is", "tree-scan"):
        fn = orig
    else:  # the dispatch before 138cbc4
        def fn(kernel, reference, *args):
            on_cpu = functools.partial(jax.lax.platform_dependent, cpu=kernel, default=reference)
            return build.differentiable(lambda *a: on_cpu(*a), reference)(*args)
    for m in (attention, int4, matmul, swiglu):
        m.dispatch = fn


def _args(step, model, params, ops, variant="as-is", fan=(0, 0, 0, 0, 0, 1)):
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.models.kv_cache import init_cache

    cfg, B, S = model.cfg, 1, 4096
    V = model.tokenizer.vocab_size if model.tokenizer is not None else cfg.vocab_size
    z = jnp.zeros((B,), jnp.int32)
    n = z + 40
    cache = init_cache(cfg, B, S).with_lengths(n)
    sp = SamplingParams.per_request(SamplingParams(), B)
    seed = jnp.int32(0)
    from ssd_jax.algorithm import steps
    from ssd_jax.algorithm.tree import draft_tree
    from ssd_jax.algorithm.verify import rejection_sample
    if step == "draft_tree":
        k = len(fan) - 1
        top_n = tuple(f + 1 for f in fan[:-1])
        loop = "scan" if variant == "tree-scan" else "unroll"
        return draft_tree, (params, cfg, cache, z, jnp.zeros((B, k), jnp.int32), n,
                            jnp.ones((B,), bool), jnp.zeros((B,), bool), seed, z, sp, V, fan, fan,
                            top_n, np.float32(1.0), "float32"), dict(ops=ops, tree_loop=loop)
    if step == "draft_chain":
        return steps.draft_chain, (params, cfg, cache, z, z, n, seed, z, sp, V, 4), dict(ops=ops)
    if step == "verify":
        k = 4
        return steps.verify, (params, cfg, cache, z, jnp.zeros((B, k), jnp.int32),
                              jnp.full((B, k, cfg.vocab_size), 1.0 / cfg.vocab_size, jnp.float32),
                              jnp.ones((B,), bool), seed, z, sp, V, rejection_sample), dict(ops=ops)
    if step == "decode":
        return steps.decode, (params, cfg, cache, z, jnp.ones((B,), bool), seed, z, sp, V), \
            dict(ops=ops)
    raise ValueError(step)


STATIC = {"cfg", "vocab_size", "k", "saguaro_top_n", "row_dtype", "ops", "verifier", "fanout_hit",
          "fanout_backup"}


def _dynamic(fn, a):
    """(name, value) of the positional arguments a compiled step takes (the static ones dropped)."""
    import inspect
    names = list(inspect.signature(inspect.unwrap(fn)).parameters)
    return [(n, x) for n, x in zip(names, a) if n not in STATIC]


def compile_phases(fn, *args, **kwargs):
    """(compiled, serialised bytes, {trace_s, lower_s, compile_s, load_s}) of jitted `fn` on
    `args`: the seconds of each phase a first call pays (trace, lowering, XLA's compile), and of
    loading the serialised executable back, which a persistent-cache hit pays besides the read."""
    from jax.experimental import serialize_executable as se

    t0 = time.perf_counter()
    traced = fn.trace(*args, **kwargs)
    t1 = time.perf_counter()
    lowered = traced.lower()
    t2 = time.perf_counter()
    compiled = lowered.compile()
    t3 = time.perf_counter()
    payload, in_tree, out_tree = se.serialize(compiled)
    t4 = time.perf_counter()
    se.deserialize_and_load(payload, in_tree, out_tree)
    t5 = time.perf_counter()
    return compiled, payload, dict(trace_s=t1 - t0, lower_s=t2 - t1, compile_s=t3 - t2,
                                   load_s=t5 - t4)


def main(argv=None) -> int:
    """Time trace / lower / compile / load and the run time of each step under each variant."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--quant", default="none", help="a draft format: none, int8, int4")
    ap.add_argument("--steps", default="draft_tree,draft_chain")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--rounds", type=int, default=30, help="alternated runs per variant")
    ap.add_argument("--fanout", default="0,0,0,0,0,1", help="draft_tree's F_0..F_K (K = length - 1)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)

    import jax

    from ssd_jax.models import backends
    from ssd_jax.models.load import load_draft
    from ssd_jax.runtime.defaults import describe

    model = load_draft(args.model, args.dtype, args.quant)
    ops = backends.select("auto", None)
    params = ops.prepare(jax.device_put(model.params))
    res = dict(model=args.model, dtype=args.dtype, quant=args.quant, backend=ops.name,
               cpu=describe(), jax=jax.__version__, date=time.strftime("%Y-%m-%d %H:%M:%S"),
               loadavg=Path("/proc/loadavg").read_text().split()[:3], steps={})
    for step in [s for s in args.steps.split(",") if s]:
        runs, rows = {}, {}
        for v in [v for v in args.variants.split(",") if v]:
            _patch(v)
            jax.clear_caches()
            fn, a, kw = _args(step, model, params, ops, v,
                              tuple(int(x) for x in args.fanout.split(",")))
            compiled, payload, phases = compile_phases(fn, *a, **kw)
            hlo = compiled.as_text()
            rows[v] = dict({k: round(t, 2) for k, t in phases.items()},
                           serialized_mb=round(len(payload) / 1e6, 2),
                           hlo_lines=hlo.count("\n"), custom_calls=hlo.count("custom-call("),
                           fusions=hlo.count(" fusion("))
            print(f"{step} {v}: {rows[v]}", file=sys.stderr, flush=True)
            runs[v] = (compiled, a)
        _patch("as-is")
        # run times: the compiled variants alternated, each round in a shuffled order; the
        # donated cache is rebuilt from a fresh copy each call
        import jax.numpy as jnp
        times = {v: [] for v in runs}
        order = list(runs)
        rng = random.Random(0)
        for r in range(args.rounds + 2):
            rng.shuffle(order)
            for v in order:
                compiled, a = runs[v]
                dyn = [jax.tree_util.tree_map(lambda y: jnp.array(y, copy=True), x)
                       if name == "cache" else x for name, x in _dynamic(fn, a)]  # donated
                jax.block_until_ready(dyn)
                t0 = time.perf_counter()
                jax.block_until_ready(compiled(*dyn))
                if r >= 2:
                    times[v].append(time.perf_counter() - t0)
        base = list(runs)[0]
        for v in runs:
            ratio = [a / b for a, b in zip(times[v], times[base])]
            rows[v].update(run_ms=round(statistics.median(times[v]) * 1e3, 2),
                           run_ratio_median=round(statistics.median(ratio), 4))
        res["steps"][step] = rows
        print(json.dumps({step: rows}), flush=True)
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                           f"compile_probe-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
