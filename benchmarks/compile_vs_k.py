"""How the compile of the K-dependent steps grows with the lookahead K (issue 35: `--k 100` was
still compiling after 600 s): the draft chain (SD drafting and the neural backup, unrolled over K),
the draft tree (SSD, `tree_loop` "unroll" as the engine runs it, and "scan") and the target's
verify, each lowered and compiled from abstract arguments (`jax.ShapeDtypeStruct`s: no weights
are made, so the default pair's shapes cost only the compile).

    python benchmarks/compile_vs_k.py                       # tiny random shapes
    python benchmarks/compile_vs_k.py --shapes default      # Qwen2.5-Coder 0.5B draft / 1.5B target
    python benchmarks/compile_vs_k.py --ks 4,8,16 --steps chain,verify

Prints one line per (step, K): trace + lowering seconds, XLA's compile seconds (wall), the CPU
seconds of both and their ratio to the first K's (CPU time: on a shared machine the wall seconds
follow the other load); the JSON goes to benchmarks/results/compile_vs_k-<shapes>-<date>.json.
The engine's bound on K (`ssd_jax.runtime.config.MAX_K`) is the largest K whose total (chain +
tree + verify) CPU seconds stay within 2x of K = 4's (benchmarks/README.md, "Compile time against K").
Greedy; batch 1; fan-out one branch per position (F_j = 1), a cache of 256 slots.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from ssd_jax.algorithm import steps  # noqa: E402
from ssd_jax.algorithm.sampling import SamplingParams  # noqa: E402
from ssd_jax.algorithm.tree import draft_tree  # noqa: E402
from ssd_jax.algorithm.verify import rejection_sample  # noqa: E402
from ssd_jax.models.config import ModelConfig, tiny_config  # noqa: E402
from ssd_jax.models.kv_cache import init_cache  # noqa: E402
from ssd_jax.models.params import random_params  # noqa: E402

QWEN = dict(arch="qwen2", vocab_size=151936, rms_norm_eps=1e-6, rope_theta=1000000.0,
            qkv_bias=True, max_position_embeddings=32768, dtype="bfloat16")
SHAPES = {
    "tiny": (tiny_config("qwen2", vocab_size=256, num_layers=4),) * 2,
    # (draft, target): Qwen2.5-Coder-0.5B-Instruct and -1.5B-Instruct's config.json
    "default": (ModelConfig(hidden_size=896, intermediate_size=4864, num_layers=24, num_heads=14,
                            num_kv_heads=2, head_dim=64, tie_embeddings=True, **QWEN),
                ModelConfig(hidden_size=1536, intermediate_size=8960, num_layers=28, num_heads=12,
                            num_kv_heads=2, head_dim=128, tie_embeddings=True, **QWEN)),
}
S, B = 256, 1


def abstract(tree):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def timed(jitted, *args, **kwargs) -> tuple[float, float, float]:
    """(trace + lowering seconds, compile seconds, CPU seconds of both) of `jitted` on abstract
    arguments. The CPU seconds (this process's, every thread) hardly move with other load on a
    shared machine, where the wall seconds do: the ratios are taken from them."""
    c0, t0 = time.process_time(), time.perf_counter()
    lowered = jitted.lower(*args, **kwargs)
    t1 = time.perf_counter()
    lowered.compile()
    return t1 - t0, time.perf_counter() - t1, time.process_time() - c0


def measure(step: str, k: int, draft: ModelConfig, target: ModelConfig):
    cfg = draft if step.startswith("tree") or step == "chain" else target
    params = jax.eval_shape(lambda: random_params(cfg, 0))
    cache = jax.eval_shape(lambda: init_cache(cfg, B, S))
    i32 = jax.ShapeDtypeStruct((B,), jnp.int32)
    sp, seed, V = SamplingParams(), jax.ShapeDtypeStruct((), jnp.int32), cfg.vocab_size
    if step == "chain":
        return timed(steps.draft_chain.jit, params, cfg, cache, i32, i32, i32, seed, i32, sp,
                     vocab_size=V, k=k)
    if step.startswith("tree"):
        f = (1,) * (k + 1)
        return timed(draft_tree.jit, params, cfg, cache, i32, jax.ShapeDtypeStruct((B, k), jnp.int32),
                     i32, jax.ShapeDtypeStruct((B,), bool), jax.ShapeDtypeStruct((B,), bool),
                     seed, i32, sp, vocab_size=V, fanout_hit=f, fanout_backup=f,
                     tree_loop=step.split("_")[1])
    rows = jax.ShapeDtypeStruct((B, k, V), jnp.float32)
    return timed(jax.jit(steps.verify, static_argnames=("cfg", "vocab_size", "verifier", "ops")),
                 params, cfg, cache, i32, jax.ShapeDtypeStruct((B, k), jnp.int32), rows,
                 jax.ShapeDtypeStruct((B,), bool), seed, i32, sp, vocab_size=V,
                 verifier=rejection_sample)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--shapes", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--ks", default="4,8,12,16,32")
    p.add_argument("--steps", default="chain,tree_unroll,tree_scan,verify")
    a = p.parse_args()
    jax.config.update("jax_enable_compilation_cache", False)
    draft, target = SHAPES[a.shapes]
    out = []
    for step in a.steps.split(","):
        base = None
        for k in map(int, a.ks.split(",")):
            lower_s, compile_s, cpu_s = measure(step, k, draft, target)
            base = base or cpu_s
            out.append(dict(step=step, k=k, lower_s=lower_s, compile_s=compile_s, cpu_s=cpu_s))
            print(f"{step:12s} K={k:3d}  trace+lower {lower_s:7.2f} s  compile {compile_s:7.2f} s"
                  f"  CPU {cpu_s:7.2f} s  x{cpu_s / base:5.2f}", flush=True)
    res = Path(__file__).resolve().parent / "results"
    res.mkdir(exist_ok=True)
    name = res / f"compile_vs_k-{a.shapes}-{time.strftime('%Y%m%d-%H%M')}.json"
    name.write_text(json.dumps(dict(shapes=a.shapes, batch=B, cache_len=S, rows=out), indent=1))
    print(f"wrote {name}")


if __name__ == "__main__":
    main()
