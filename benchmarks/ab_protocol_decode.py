"""A/B: the built-in model's decode step through the model protocol against the direct call.

    taskset -c 0,1 python benchmarks/ab_protocol_decode.py --rounds 200

`steps.decode` reaches the transformer through `ssd_jax.models.protocol.forward`, which for a
`ModelConfig` calls `transformer.forward` with the same arguments. `direct` below is the step as
it was before the protocol (transformer.forward and cache.lengths called directly). The script
checks that the two compile to the same optimised HLO (names and source metadata aside), then
times them alternating every round in a shuffled order (a small random transformer, --context
tokens cached, the cpu / xla backend) and reports the median ratio protocol / direct over rounds
(1.00 = no change). Measured 2026-12-01 on the shared 2-core VM, cpu backend, 300 rounds: same
optimised HLO, median step 20.8 vs 22.0 ms, median per-round ratio 0.999.
"""
from __future__ import annotations

import argparse
import functools
import random
import re
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=200)
    ap.add_argument("--context", type=int, default=200)
    ap.add_argument("--backend", default="auto")
    args = ap.parse_args(argv)

    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.algorithm import sampling as smp
    from ssd_jax.algorithm import steps
    from ssd_jax.models import backends, transformer
    from ssd_jax.models.config import tiny_config
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.params import random_params

    @functools.partial(jax.jit, static_argnames=("cfg", "vocab_size", "ops"),
                       donate_argnames=("cache",))
    def direct(params, cfg, cache, bonus, active, seed, request_ids, sampling, vocab_size, ops):
        n = cache.lengths
        logits, cache = transformer.forward(params, cfg, bonus[:, None], cache,
                                            active.astype(jnp.int32), ops=ops)
        keys = smp.position_keys(seed, request_ids, n + 1, smp.STREAM_SAMPLE)
        tok, _ = smp.sample(logits[:, 0], sampling, keys, vocab_size)
        return tok, steps.token_logprobs(logits[:, 0], tok), cache

    cfg = tiny_config("qwen2", vocab_size=4096, hidden_size=512, intermediate_size=1408,
                      num_heads=8, num_kv_heads=2, head_dim=64, num_layers=6)
    ops = backends.select(args.backend, None)
    params = ops.prepare(random_params(cfg, 0))
    B, S = 1, args.context + 2 * args.rounds + 8
    sp = smp.SamplingParams.per_request(smp.SamplingParams(temperature=0.0), B)
    ins = (jnp.zeros((B,), jnp.int32), jnp.ones((B,), bool), jnp.int32(0),
           jnp.zeros((B,), jnp.int32), sp, cfg.vocab_size)
    fns = {"protocol": steps.decode, "direct": direct}

    def fresh():
        return init_cache(cfg, B, S).with_lengths(jnp.full((B,), args.context, jnp.int32))

    def text(f):  # the optimised HLO XLA runs, without module names and source metadata
        t = f.lower(params, cfg, fresh(), *ins, ops=ops).compile().as_text()
        t = re.sub(r", metadata=\{[^}]*\}", "", t)
        tables = r"^(\d+ .*|FileNames|FunctionNames|FileLocations|StackFrames)$"
        t = re.sub(tables, "", t, flags=re.M)
        return "\n".join(ln for ln in re.sub(r"jit_\w+", "jit_", t).splitlines() if ln.strip())

    hlo = {k: text(f) for k, f in fns.items()}
    same = hlo["protocol"] == hlo["direct"]
    print(f"backend {ops.name}; same optimised HLO: {same}")
    caches = {k: fresh() for k in fns}
    for k, f in fns.items():  # compile
        _, _, caches[k] = jax.block_until_ready(f(params, cfg, caches[k], *ins, ops=ops))
    times = {k: [] for k in fns}
    for _ in range(args.rounds):
        order = list(fns)
        random.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            _, _, caches[k] = jax.block_until_ready(fns[k](params, cfg, caches[k], *ins, ops=ops))
            times[k].append(time.perf_counter() - t0)
    ratio = statistics.median(np.asarray(times["protocol"]) / np.asarray(times["direct"]))
    print(f"median step: protocol {1e3 * statistics.median(times['protocol']):.3f} ms, direct "
          f"{1e3 * statistics.median(times['direct']):.3f} ms; median per-round ratio "
          f"protocol / direct {ratio:.3f} over {args.rounds} rounds")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
