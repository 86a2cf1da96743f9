"""A/B the target's decode step against variants of itself, alternating every step in one process.

    taskset -c 0,1 python benchmarks/ab_decode_step.py                      # all variants
    taskset -c 0,1 python benchmarks/ab_decode_step.py --variants no-helper --rounds 300

Why: on this shared VM the memory bandwidth drifts by tens of percent within minutes, so two runs
minutes apart cannot show a 1-2% change, and even blocks of a few steps alternated in one process
differed by up to 4.5% between two copies of the same step. Here every round runs each variant's
step once, in a shuffled order, and each variant is judged by the median over rounds of its time
over the baseline's in the same round. `control` (the baseline compiled a second time) shows the
noise floor: its ratio should be ~1.00.

Variants (each compiled beside the baseline, the 1.5B target in bf16, `--context` tokens cached):
- `control`: the baseline again;
- `xla-swiglu`: the MLP's silu(gate) * up as XLA's fusion instead of the CPU kernel (the cpu
  backend's table with its `swiglu` replaced by `xla_swiglu`);
- `xla-attention`: the KV write and attention as XLA's ops instead of the CPU kernel (`attend`
  replaced by `xla_attend`);
- `no-helper`: the kernels split their work on XLA's pool only (`cpu.use_helper_thread`).
A ratio above 1 means the variant is slower than the baseline (so what it removes helps).
"""
from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

VARIANTS = ("control", "xla-swiglu", "xla-attention", "no-helper")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=200, help="tokens in the KV cache")
    ap.add_argument("--rounds", type=int, default=150, help="steps per variant (default 150)")
    ap.add_argument("--variants", default=",".join(VARIANTS),
                    help=f"comma-separated, from {', '.join(VARIANTS)}")
    args = ap.parse_args(argv)
    chosen = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(chosen) - set(VARIANTS))
    if unknown or not chosen:
        ap.error(f"unknown variant(s) {unknown}; choose from {', '.join(VARIANTS)}")

    import dataclasses

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models import cpu
    from ssd_jax.models.ops import xla_attend, xla_swiglu
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.load import load_model
    from ssd_jax.algorithm import steps
    from ssd_jax.algorithm.sampling import SamplingParams

    if not cpu.available():
        sys.exit(f"the CPU kernels are not available here ({cpu.build.reason()}): nothing to compare")
    ops = cpu.backend()
    model = load_model(args.model, args.dtype)
    cfg, params = model.cfg, ops.prepare(jax.device_put(model.params))
    V, sp = model.tokenizer.vocab_size, SamplingParams()
    max_len = 256 * (-(-(args.context + 8) // 256))
    lengths = np.asarray([args.context], np.int32)
    seed, rids = jnp.int32(0), jnp.zeros((1,), jnp.int32)
    bonus, active = jnp.asarray([1], jnp.int32), jnp.ones((1,), bool)

    def compile_step(table=ops):
        jax.clear_caches()  # trace again: a second compile of the same table for `control`
        return steps.decode.lower(params, cfg, init_cache(cfg, 1, max_len), bonus, active, seed,
                                  rids, sp, V, ops=table).compile()

    runs = {"baseline": compile_step()}
    for v in chosen:
        if v in ("control", "no-helper"):
            runs[v] = compile_step()
        elif v == "xla-swiglu":
            runs[v] = compile_step(dataclasses.replace(ops, name="cpu-xla-swiglu", swiglu=xla_swiglu))
        elif v == "xla-attention":
            runs[v] = compile_step(dataclasses.replace(ops, name="cpu-xla-attention",
                                                       attend=xla_attend))
    caches = {name: init_cache(cfg, 1, max_len).with_lengths(lengths) for name in runs}

    def step(name):
        cpu.use_helper_thread(name != "no-helper")
        t0 = time.perf_counter()
        tok, _, c = runs[name](params, caches[name], bonus, active, seed, rids, sp)  # sp: traced
        jax.block_until_ready(tok)
        caches[name] = c.with_lengths(lengths)
        return time.perf_counter() - t0

    for name in runs:  # warm-up
        for _ in range(3):
            step(name)
    times = {name: [] for name in runs}
    order = list(runs)
    rng = random.Random(0)
    for _ in range(args.rounds):
        rng.shuffle(order)
        for name in order:
            times[name].append(step(name))
    cpu.use_helper_thread(True)

    base = times["baseline"]
    print(f"{args.model} {args.dtype}, {args.context} tokens cached, {args.rounds} rounds, "
          f"{jax.device_count()} device(s); baseline step median {statistics.median(base) * 1e3:.1f} ms")
    print("| variant | step median ms | variant / baseline, per round: median | quartiles |")
    print("|---|---|---|---|")
    for name in chosen:
        r = [a / b for a, b in zip(times[name], base)]
        q = statistics.quantiles(r, n=4)
        print(f"| {name} | {statistics.median(times[name]) * 1e3:.1f} | {statistics.median(r):.3f} "
              f"| {q[0]:.3f}-{q[2]:.3f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
