"""Where a decode step of the target spends its time: XLA's thunks, summed over a few steps.

    taskset -c 0,1 python benchmarks/profile_decode.py            # the 1.5B target, bf16
    taskset -c 0 python benchmarks/profile_decode.py --steps 8 --context 1000

Runs `ssd_jax.algorithm.steps.decode` (forward + greedy sample) under `jax.profiler.trace` and prints, per
step: the time of each kind of thunk (the name without its number: `ffi_call`, `ynn_fusion`, ...),
and for the CPU kernels' calls the time and GB/s per weight shape (the matmuls) or the total (the
cache attention). The step's wall time and the sum of thunk times are printed too: XLA:CPU runs
the thunks of one step one after another, so their sum is the step less the dispatch. Nothing
else runs in the process; pin it with taskset like decode_vs_hf.py.
"""
from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-coder-1.5b")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--context", type=int, default=200, help="tokens in the KV cache")
    ap.add_argument("--steps", type=int, default=5, help="decode steps traced")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.load import load_model
    from ssd_jax.algorithm import steps
    from ssd_jax.algorithm.sampling import SamplingParams

    from ssd_jax.models.ops import XLA
    try:  # the CPU kernels' backend table (models/cpu), where they build
        from ssd_jax.models import cpu
        ops = cpu.backend()
    except RuntimeError as e:
        print(f"{e}: XLA's ops", file=sys.stderr)
        ops = XLA
    model = load_model(args.model, args.dtype)
    cfg, params = model.cfg, ops.prepare(jax.device_put(model.params))  # the backend's layouts
    V = model.tokenizer.vocab_size
    sp = SamplingParams()
    ctx = args.context
    max_len = 256 * (-(-(ctx + 8) // 256))
    bucket = 1 << (ctx - 1).bit_length()
    toks = np.zeros((1, bucket), np.int32)
    toks[0, :ctx] = np.random.default_rng(0).integers(0, V, ctx)
    seed, rids = jnp.int32(0), jnp.zeros((1,), jnp.int32)
    cache = init_cache(cfg, 1, max_len)
    _, _, cache = steps.prefill(params, cfg, cache, jnp.asarray(toks),
                                jnp.asarray([ctx], jnp.int32), seed, rids, sp, V, ops=ops)
    state = dict(cache=cache)
    bonus, active = jnp.asarray([1], jnp.int32), jnp.ones((1,), bool)
    lengths = np.asarray([ctx], np.int32)

    def decode():
        tok, _, c = steps.decode(params, cfg, state["cache"].with_lengths(lengths), bonus, active,
                                 seed, rids, sp, V, ops=ops)
        jax.block_until_ready(tok)
        state["cache"] = c

    hlo = steps.decode.lower(params, cfg, state["cache"], bonus, active, seed, rids, sp,
                             V, ops=ops).compile().as_text()
    for _ in range(3):
        decode()
    wall = []
    with tempfile.TemporaryDirectory() as tmp:
        with jax.profiler.trace(tmp, create_perfetto_trace=True):
            for _ in range(args.steps):
                t0 = time.perf_counter()
                decode()
                wall.append(time.perf_counter() - t0)
        trace = sorted(glob.glob(f"{tmp}/**/*.trace.json.gz", recursive=True))[-1]
        events = [e for e in json.load(gzip.open(trace))["traceEvents"] if e.get("ph") == "X"]

    # custom calls by name -> what they are (target, and the weight's shape for a matmul)
    what = {}
    for m in re.finditer(r"%(ffi_call[.0-9]*) = .*?custom_call_target=\"(\w+)\", "
                         r"operand_layout_constraints=\{(.*?\}), (\S+?)\{", hlo):
        name, target, _, second = m.groups()
        what[name] = (f"matmul {second}" if "matmul" in target
                      else target.replace("ssd_jax_", ""))
    kinds, kernels = collections.Counter(), collections.defaultdict(list)
    for e in events:
        n = e["name"]
        if not re.fullmatch(r"[a-z][a-z0-9_\-]*(\.\d+)?", n) or n == "shard_args":
            continue  # Python frames, the executor's own spans, dispatch: not thunks
        kinds[re.sub(r"[.\d]+$", "", n)] += e["dur"]
        if n in what:
            kernels[what[n]].append(e["dur"])
    steps_n = args.steps
    total = sum(kinds.values()) / steps_n / 1e3
    print(f"{args.model} {args.dtype}, {ctx} tokens cached, {steps_n} steps, "
          f"{jax.device_count()} device(s), step wall median {statistics.median(wall) * 1e3:.1f} ms; "
          f"thunks {total:.1f} ms a step")
    print("\nby kind of thunk (ms a step):")
    for k, us in kinds.most_common(15):
        print(f"  {us / steps_n / 1e3:8.2f}  {k}")
    print("\nthe CPU kernels' calls (ms a step, calls a step, median us a call, GB/s of weights):")
    for k, durs in sorted(kernels.items(), key=lambda kv: -sum(kv[1])):
        med = statistics.median(durs)
        shape = re.match(r"matmul bf16\[(\d+),(\d+)\]", k)
        gbs = f"  {int(shape[1]) * int(shape[2]) * 2 / med / 1e3:5.1f}" if shape else ""
        print(f"  {sum(durs) / steps_n / 1e3:8.2f}  {len(durs) / steps_n:5.1f}  {med:9.1f}{gbs}  {k}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
