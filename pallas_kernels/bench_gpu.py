"""Check and time the SSD Pallas kernels on one GPU against their XLA formulations.

Run on the GPU machine (one H200, JAX 0.11, no registry access needed):

    python -m ssd_jax.pallas_kernels.bench_gpu                 # full check + timing + small config sweep
    python -m ssd_jax.pallas_kernels.bench_gpu --no-sweep      # default configs only (faster)
    python -m ssd_jax.pallas_kernels.bench_gpu --check-only    # device correctness checks only
    python -m ssd_jax.pallas_kernels.bench_gpu --smoke         # tiny shapes, interpret mode, on the CPU

Shapes (`--shape paper`, the default): batch 16, tree of MQ 24 branches, K 7 drafted tokens, 32 query / 8 KV heads,
head dim 64, live prefix 2048, bf16; lookup rows [16, 24, 7, 151936] bf16. `--shape pair`: the
default pair's draft (Qwen2.5-Coder-0.5B, 14 / 2 heads) at batch 16, K 4, 9 branches, prefix 512.

Each measurement runs many iterations inside one jit (`lax.fori_loop`, partly unrolled); inputs
change every iteration (step, prefix lengths, a query scale, the outcome) so XLA cannot hoist the
work out of the loop. Exit status: 0 when every kernel matched its reference, 1 on a mismatch.
See pallas_kernels/BENCHMARKS.md for the roofline arithmetic.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from ssd_jax.pallas_kernels.cache_gather import cache_gather, cache_gather_reference, gather_bytes
from ssd_jax.pallas_kernels.tree_attention import (default_num_splits, default_tiling, prefix_bytes,
                                           tree_attention, tree_attention_reference,
                                           tree_attention_xla)

HBM_BYTES_PER_S = 4.8e12  # H200 HBM3e, nominal
BF16_DENSE_FLOPS = 989e12  # H200 dense bf16 tensor-core peak, nominal

FULL = dict(B=16, MQ=24, K=7, H=32, KVH=8, D=64, P=2048, S=2048, V=151936,
            fanout=[6, 5, 4, 3, 2, 2, 1, 1])
SMOKE = dict(B=2, MQ=6, K=3, H=4, KVH=2, D=64, P=90, S=100, V=300, fanout=[3, 2, 1, 0])
# the default pair's draft (Qwen2.5-Coder-0.5B: 14 query / 2 KV heads, head dim 64) at batch 16,
# K 4 and gpu_engine_check's fan-out, with a 512-token live prefix
PAIR = dict(B=16, MQ=9, K=4, H=14, KVH=2, D=64, P=512, S=1024, V=151936, fanout=[3, 2, 2, 1, 1])
SHAPES = {"paper": FULL, "pair": PAIR}


# ------------------------------------------------------------------------------------------------
# Problem construction (on the device)
# ------------------------------------------------------------------------------------------------
def tree_inputs(cfg, dtype, seed=0):
    """A tree step as SSD builds it: branch (j, c) sees prefix n + j + 1, max = cfg['P']."""
    B, MQ, K, H, KVH, D, S = (cfg[k] for k in ("B", "MQ", "K", "H", "KVH", "D", "S"))
    fan = cfg["fanout"]
    assert sum(fan) == MQ and len(fan) <= K + 1
    j = np.repeat(np.arange(len(fan)), fan)
    n = cfg["P"] - len(fan)  # so the deepest fork sees exactly P slots
    prefix = np.broadcast_to(n + j + 1, (B, MQ)).astype(np.int32)
    keys = jax.random.split(jax.random.key(seed), 5)
    nrm = lambda k, s: jax.random.normal(k, s, jnp.float32).astype(dtype)  # noqa: E731
    valid = np.ones((B, MQ), bool)
    return dict(q=nrm(keys[0], (B, MQ, H, D)), k_cache=nrm(keys[1], (B, S, KVH, D)),
                v_cache=nrm(keys[2], (B, S, KVH, D)), prefix_len=jnp.asarray(prefix),
                branch_k=nrm(keys[3], (B, MQ, K, KVH, D)),
                branch_v=nrm(keys[4], (B, MQ, K, KVH, D)), branch_valid=jnp.asarray(valid))


def tree_kernel(q, k_cache, v_cache, prefix_len, branch_k, branch_v, step, valid, **kw):
    """The kernel with the reference's arguments: it writes entry `step` of the branch buffers
    with the rows already there, and its attention output is compared and timed."""
    take = lambda buf: jax.lax.dynamic_index_in_dim(buf, step, axis=2, keepdims=False)  # noqa: E731
    return tree_attention(q, take(branch_k), take(branch_v), k_cache, v_cache, prefix_len,
                          branch_k, branch_v, step, valid, **kw)[0]


def tree_args(t, step, prefix_len=None, valid=None, q=None):
    return (t["q"] if q is None else q, t["k_cache"], t["v_cache"],
            t["prefix_len"] if prefix_len is None else prefix_len, t["branch_k"], t["branch_v"],
            jnp.int32(step) if isinstance(step, int) else step,
            t["branch_valid"] if valid is None else valid)


def gather_inputs(cfg, dtype, seed=1):
    B, MQ, K, V = cfg["B"], cfg["MQ"], cfg["K"], cfg["V"]
    rng = np.random.default_rng(seed)
    fan = cfg["fanout"]
    j = np.repeat(np.arange(len(fan)), fan)
    keys = np.empty((B, MQ, 2), np.int32)
    for b in range(B):
        c = np.concatenate([rng.choice(V, size=f, replace=False) for f in fan if f])
        keys[b] = np.stack([j, c], -1)
    tokens = rng.integers(0, V, size=(B, MQ, K)).astype(np.int32)
    rows = jax.random.uniform(jax.random.key(seed), (B, MQ, K, V), jnp.float32).astype(dtype)
    return dict(keys=jnp.asarray(keys), valid=jnp.ones((B, MQ), bool), tokens=jnp.asarray(tokens),
                rows=rows)


# ------------------------------------------------------------------------------------------------
# Timing
# ------------------------------------------------------------------------------------------------
def timed_loop(body, iters, unroll):
    """The jitted loop `time_loop` times: `body(i, carry, data)` `iters` times, `unroll` a trip."""
    return jax.jit(lambda c, d: lax.fori_loop(0, iters, lambda i, x: body(i, x, d), c,
                                              unroll=unroll))


def time_loop(body, init, data, iters, reps, unroll):
    """Seconds per iteration of `body(i, carry, data)` run `iters` times in one jit (best of reps).

    The arrays travel as jit arguments (not closed-over constants), as in the engine.
    """
    run = timed_loop(body, iters, unroll)
    jax.block_until_ready(run(init, data))  # compile and warm up
    best = math.inf
    for _ in range(reps):
        t0 = time.perf_counter()
        jax.block_until_ready(run(init, data))
        best = min(best, time.perf_counter() - t0)
    return best / iters


def _live(carry):
    """0 in practice, but computed from the previous iteration's result (its first element is
    never 1e30): an iteration that reads it cannot be dropped. Before 2026-12-04 the bodies ignored
    their carry, so in an unrolled trip every result but the last was dead and XLA removed those
    iterations: the first H200 run timed one call in `unroll` and reported a gather "faster" than
    HBM."""
    first = jax.tree.leaves(carry)[-1].reshape(-1)[0]
    return (first.astype(jnp.float32) > 1e30).astype(jnp.int32)


def tree_body(fn, K):
    """Loop body: step, prefix lengths and a query scale vary with i, so nothing is loop-invariant,
    and the query reads the previous result (`_live`), so no unrolled iteration is dead."""
    def body(i, carry, t):
        wiggle = (i % 2).astype(jnp.int32) + _live(carry)
        q = t["q"] * (1 + wiggle.astype(t["q"].dtype) * jnp.asarray(2.0 ** -7, t["q"].dtype))
        return fn(*tree_args(t, i % K, prefix_len=t["prefix_len"] - wiggle, q=q))
    return body


def gather_body(fn):
    def body(i, carry, g):
        B, MQ = g["keys"].shape[:2]
        # a different (always valid) branch each iteration, chosen after the previous result
        pick = (i + _live(carry) + jnp.arange(B)) % MQ
        outcome = g["keys"][jnp.arange(B), pick]
        return fn(g["keys"], g["valid"], g["tokens"], g["rows"], outcome)
    return body


# ------------------------------------------------------------------------------------------------
# Checks
# ------------------------------------------------------------------------------------------------
def check_tree(cfg, interpret, kernel_kw, report):
    """Kernel vs reference on the device at the benchmark shape, bf16 and fp32, every step."""
    ok = True
    for dtype, tol in ((jnp.bfloat16, 2e-2), (jnp.float32, 1e-5)):
        t = tree_inputs(cfg, dtype)
        # Mix in what the engine produces: invalid (padding) branches, a finished sequence, an
        # empty prefix and exact block boundaries.
        valid = np.ones(t["branch_valid"].shape, bool)
        valid[0, -3:] = False
        valid[-1] = False
        plen = np.array(t["prefix_len"])
        plen[0, 0], plen[0, 1], plen[0, 2] = 0, min(64, cfg["S"]), min(128, cfg["S"])
        for step in range(cfg["K"]):
            args = tree_args(t, step, prefix_len=jnp.asarray(plen), valid=jnp.asarray(valid))
            out = tree_kernel(*args, interpret=interpret, **kernel_kw)
            ref = tree_attention_reference(*args)
            err = float(jnp.max(jnp.abs(out.astype(jnp.float32) - ref.astype(jnp.float32))))
            bad = bool(jnp.isnan(out).any()) or err > tol
            bad |= bool(jnp.any(out[~valid] != 0))
            if bad or step == cfg["K"] - 1:
                report(f"  check tree_attention {jnp.dtype(dtype).name} step {step}: "
                       f"max|delta| {err:.3g} (tol {tol}) {'FAIL' if bad else 'ok'}")
            ok &= not bad
    return ok


def check_gather(cfg, interpret, kernel_kw, report):
    ok = True
    for dtype in (jnp.bfloat16, jnp.float32):
        g = gather_inputs(cfg, dtype)
        B, MQ = g["keys"].shape[:2]
        valid = np.ones((B, MQ), bool)
        valid[:, -1] = False
        keys = np.asarray(g["keys"])
        outcome = keys[np.arange(B), np.arange(B) % MQ].copy()
        outcome[1 % B] = keys[1 % B, -1]   # key of an invalid branch: a miss
        if B > 2:
            outcome[2] = (cfg["K"] + 3, 0)  # unknown key: a miss
        args = (g["keys"], jnp.asarray(valid), g["tokens"], g["rows"], jnp.asarray(outcome))
        out = cache_gather(*args, interpret=interpret, **kernel_kw)
        ref = cache_gather_reference(*args)
        same = all(bool(jnp.array_equal(a, b)) and a.dtype == b.dtype for a, b in zip(out, ref))
        report(f"  check cache_gather {jnp.dtype(dtype).name}: hits {int(ref[0].sum())}/{B}, "
               f"{'bit-exact ok' if same else 'MISMATCH'}")
        ok &= same
    return ok


# ------------------------------------------------------------------------------------------------
# Main
# ------------------------------------------------------------------------------------------------
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes in interpret mode (CPU)")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="paper",
                    help="paper: the shapes above; pair: the default pair's draft at batch 16")
    ap.add_argument("--iters", type=int, default=None, help="iterations per timed loop")
    ap.add_argument("--reps", type=int, default=5, help="timed repetitions (best is kept)")
    ap.add_argument("--no-sweep", action="store_true", help="time the default configs only")
    ap.add_argument("--check-only", action="store_true", help="run the device checks, no timing")
    ap.add_argument("--json", default=None, help="also write the results to this file")
    args = ap.parse_args(argv)

    smoke = args.smoke
    cfg = SMOKE if smoke else SHAPES[args.shape]
    interpret = smoke
    iters = args.iters or (3 if smoke else 200)
    reps = 1 if smoke else args.reps
    unroll = 1 if smoke else 8
    lines = []

    def report(s):
        print(s, flush=True)
        lines.append(s)

    dev = jax.devices()[0]
    report(f"jax {jax.__version__} on {dev.platform}: {dev.device_kind}"
           f"{'  [SMOKE: tiny shapes, interpret mode - timings meaningless]' if smoke else ''}")
    if not smoke and dev.platform != "gpu":
        report("WARNING: not a GPU; the kernels will fail to compile. Use --smoke on a CPU.")
    report(f"shape: B {cfg['B']}, MQ {cfg['MQ']}, K {cfg['K']}, heads {cfg['H']}/{cfg['KVH']}, "
           f"D {cfg['D']}, live prefix {cfg['P']} (cache {cfg['S']}), V {cfg['V']}, bf16")

    B, MQ, K, H, KVH, D, P, V = (cfg[k] for k in ("B", "MQ", "K", "H", "KVH", "D", "P", "V"))
    G = H // KVH
    R = max(16, 1 << (MQ * G - 1).bit_length())
    block_s0, warps0 = default_tiling(R, D)
    splits0 = default_num_splits(B, KVH, cfg["S"], block_s0)
    report(f"tree kernel defaults: rows {MQ}x{G}={MQ * G} -> {R}, block_s {block_s0}, "
           f"splits {splits0}, warps {warps0}; grid ({B}, {KVH}, {splits0})")

    # ---- correctness on the device -------------------------------------------------------
    report("correctness (kernel vs jnp reference, on this device):")
    ok = True
    for check in (check_tree, check_gather):
        try:
            ok &= check(cfg, interpret, {}, report)
        except Exception as e:  # e.g. Triton compile failure: report it, keep going, exit 1
            report(f"  {check.__name__}: FAILED to run: {type(e).__name__}: {e}")
            ok = False

    if args.check_only:
        report("RESULT: " + ("all kernels match their references" if ok else "MISMATCH or failure"))
        return 0 if ok else 1

    # ---- roofline arithmetic ------------------------------------------------------------
    isz = 2
    pre_b = prefix_bytes(B, P, KVH, D, isz)
    own_b = 2 * B * MQ * K * KVH * D * isz
    qo_b = 2 * B * MQ * H * D * isz
    tree_b = pre_b + own_b + qo_b
    flops = 4 * B * KVH * R * P * D  # QK^T and PV on the padded rows
    gat_b = gather_bytes(B, K, V, isz)
    report("roofline (H200: %.1f TB/s HBM, %.0f TFLOP/s dense bf16):"
           % (HBM_BYTES_PER_S / 1e12, BF16_DENSE_FLOPS / 1e12))
    report(f"  tree: prefix K+V 2*{B}*{P}*{KVH}*{D}*2 B = {pre_b / 1e6:.1f} MB, own path "
           f"{own_b / 1e6:.1f} MB, q+out {qo_b / 1e6:.1f} MB -> {tree_b / 1e6:.1f} MB "
           f"= {tree_b / HBM_BYTES_PER_S * 1e6:.1f} us at peak bandwidth")
    report(f"        tensor-core work 4*{B}*{KVH}*{R}*{P}*{D} = {flops / 1e9:.2f} GFLOP "
           f"= {flops / BF16_DENSE_FLOPS * 1e6:.1f} us at peak (memory-bound: "
           f"{flops / pre_b:.0f} FLOP/B < ridge {BF16_DENSE_FLOPS / HBM_BYTES_PER_S:.0f})")
    report(f"  gather: read + write 2*{B}*{K}*{V}*2 B = {gat_b / 1e6:.1f} MB "
           f"= {gat_b / HBM_BYTES_PER_S * 1e6:.1f} us at peak bandwidth")

    # ---- timing --------------------------------------------------------------------------
    results = []

    def record(name, sec, nbytes, base=None):
        us = sec * 1e6
        bw = nbytes / sec
        extra = f", {base / sec:.2f}x vs XLA ref" if base else ""
        report(f"  {name:<44s} {us:9.2f} us  {bw / 1e12:6.3f} TB/s "
               f"({100 * bw / HBM_BYTES_PER_S:5.1f}% of HBM){extra}")
        results.append(dict(name=name, us=us, tb_per_s=bw / 1e12, vs_xla_ref=(base / sec)
                            if base else None))

    report(f"timing ({iters} iterations per jit, unroll {unroll}, best of {reps}):")
    empty = time_loop(lambda i, c, d: c + i, jnp.int32(0), (), iters, reps, unroll)
    report(f"  empty loop iteration: {empty * 1e6:.2f} us (included in every number below)")

    t = tree_inputs(cfg, jnp.bfloat16)
    init_t = jnp.zeros_like(t["q"])
    ref_s = time_loop(tree_body(tree_attention_reference, K), init_t, t, iters, reps, unroll)
    record("tree: XLA reference (jnp, f32)", ref_s, tree_b)
    xla_s = time_loop(tree_body(tree_attention_xla, K), init_t, t, iters, reps, unroll)
    record("tree: XLA folded bf16 (tree_attention_xla)", xla_s, tree_b, ref_s)
    tree_cfgs = [dict()]
    if not args.no_sweep:
        tree_cfgs += ([dict(block_s=16, num_splits=2, num_warps=4)] if smoke else
                      [dict(block_s=bs, num_splits=ns, num_warps=nw)
                       for bs in (32, 64, 128) for ns in (1, 2, 4, 8) for nw in (4, 8)])
    best_tree = math.inf
    for kw in tree_cfgs:
        fn = lambda *a, kw=kw: tree_kernel(*a, interpret=interpret, **kw)  # noqa: E731
        try:
            s = time_loop(tree_body(fn, K), init_t, t, iters, reps, unroll)
        except Exception as e:  # a config Triton cannot compile (e.g. out of registers/smem)
            report(f"  tree kernel {kw or 'default'}: failed to run ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:100]})")
            continue
        record(f"tree: Pallas {kw or 'default'}", s, tree_b, ref_s)
        best_tree = min(best_tree, s)
    if best_tree < math.inf:
        report(f"  best tree kernel: {best_tree * 1e6:.2f} us, {ref_s / best_tree:.2f}x vs XLA "
               f"reference, {xla_s / best_tree:.2f}x vs XLA folded")

    g = gather_inputs(cfg, jnp.bfloat16)
    init_g = cache_gather_reference(g["keys"], g["valid"], g["tokens"], g["rows"],
                                    g["keys"][:, 0])
    gref_s = time_loop(gather_body(cache_gather_reference), init_g, g, iters, reps, unroll)
    record("gather: XLA reference (jnp gather)", gref_s, gat_b)
    gather_cfgs = [dict()]
    if not args.no_sweep:
        gather_cfgs += ([dict(block_v=128)] if smoke else
                        [dict(block_v=bv, num_warps=nw)
                         for bv in (1024, 2048, 4096, 8192, 16384) for nw in (4, 8)])
    best_g = math.inf
    for kw in gather_cfgs:
        fn = lambda *a, kw=kw: cache_gather(*a, interpret=interpret, **kw)  # noqa: E731
        try:
            s = time_loop(gather_body(fn), init_g, g, iters, reps, unroll)
        except Exception as e:
            report(f"  gather kernel {kw or 'default'}: failed to run ({type(e).__name__}: "
                   f"{str(e).splitlines()[0][:100]})")
            continue
        record(f"gather: Pallas {kw or 'default'}", s, gat_b, gref_s)
        best_g = min(best_g, s)
    if best_g < math.inf:
        report(f"  best gather kernel: {best_g * 1e6:.2f} us, {gref_s / best_g:.2f}x vs XLA")

    ok &= best_tree < math.inf and best_g < math.inf
    report("RESULT: " + ("all kernels match their references" if ok else "MISMATCH or failure"))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(ok=ok, config=cfg, smoke=smoke, results=results, log=lines), f,
                      indent=1)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
