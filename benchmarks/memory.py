"""What a run holds: peak host RSS and the bytes on each device, measured on the default pair, and
projected (no allocation) for the paper's pairs beside 80 GB and 141 GB of HBM.

    python benchmarks/memory.py                       # measure AR / SD / SSD in fp32 and bf16, then project
    python benchmarks/memory.py --modes ar --dtypes bfloat16
    python benchmarks/memory.py --project-only

Measured: each (mode, dtype) runs in a fresh process (`load_model` + `load_draft` + `Engine` +
one greedy `generate` of `--new-tokens` tokens): its peak RSS (VmHWM of /proc/self/status, which
is what /usr/bin/time -v reports) and, after the call, `ssd_jax.runtime.metrics.memory_of(engine)`
(weights, KV cache and speculation cache per device) beside every live jax.Array
(`jax.live_arrays()`) per device. Run the default pair's conversion once first (a load writes
the conversion cache), or the first row times a conversion. Only one such process runs at a time.

Projected: the published configs (benchmarks/paper_projection.py's shapes) as abstract params
(`jax.eval_shape`: shapes and dtypes, nothing allocated), each leaf's shard on one device under
the placement's shardings (`ssd_jax.models.tp.leaf_spec`: the target tensor-parallel over the
layout's T devices, the draft whole on its own), bf16 weights, a bf16 KV cache of
`--context` positions for batch 1 and `--batch`, and the SSD speculation cache's rows at the
README's fan-out (3, 2, 1, 1, 1).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

_RUN = r"""
import json, sys
import jax
from ssd_jax.models.load import load_draft, load_model
from ssd_jax.runtime.engine import Engine
from ssd_jax.runtime.metrics import device_bytes, memory_of

def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) * 1024

mode, dtype, target, draft, n = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
t = load_model(target, dtype)
d = load_draft(draft, dtype) if mode != "ar" else None
engine = Engine(t, d)
out = engine.generate(["def fibonacci(n):"], mode=mode, max_new_tokens=n)
live = device_bytes(jax.live_arrays())
print(json.dumps({"mode": mode, "dtype": dtype, "peak_rss": status("VmHWM:"),
                  "memory": memory_of(engine), "live": live, "token_ids": out.token_ids[0]}))
"""


def measure(mode: str, dtype: str, target: str, draft: str, new_tokens: int) -> dict:
    out = subprocess.run([sys.executable, "-c", _RUN, mode, dtype, target, draft, str(new_tokens)],
                         capture_output=True, text=True, env={**os.environ, "JAX_PLATFORMS": "cpu"})
    if out.returncode:
        raise SystemExit(f"{mode} {dtype} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f}"


def measured_table(rows: list[dict]) -> str:
    lines = ["| mode | dtype | peak RSS GB | device | weights GB | KV GB | spec GB | live GB |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        m = r["memory"]
        for dev in sorted(r["live"]):
            lines.append(f"| {r['mode']} | {r['dtype']} | {_gb(r['peak_rss'])} | {dev} | "
                         f"{_gb(m['weights'].get(dev, 0))} | {_gb(m['kv_cache'].get(dev, 0))} | "
                         f"{_gb(m['spec_cache'].get(dev, 0))} | {_gb(r['live'][dev])} |")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------- projection
def abstract_params(cfg):
    """The Params of `cfg` as shapes and dtypes only (`jax.eval_shape`; nothing allocated)."""
    import jax
    import jax.numpy as jnp

    from ssd_jax.models.params import LayerParams, Params

    H, KVH, D, E, I, V = (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size,
                          cfg.intermediate_size, cfg.vocab_size)

    def build():
        def z(*s):
            return jnp.zeros(s, cfg.dtype)
        layer = LayerParams(attn_norm=z(E), wqkv=z(E, (H + 2 * KVH) * D),
                            bqkv=z((H + 2 * KVH) * D) if cfg.qkv_bias else None,
                            q_norm=z(D) if cfg.qk_norm else None, k_norm=z(D) if cfg.qk_norm else None,
                            wo=z(H * D, E), mlp_norm=z(E), w_gate_up=z(E, 2 * I), w_down=z(I, E))
        return Params(embed=z(V, E), layers=(layer,) * cfg.num_layers, final_norm=z(E),
                      lm_head=None if cfg.tie_embeddings else z(E, V))

    return jax.eval_shape(build)


def per_device_weight_bytes(cfg, tp: int) -> int:
    """Bytes of one device's shard of every leaf of `cfg`'s params laid out for TP `tp`."""
    import jax
    import numpy as np
    from jax.sharding import PartitionSpec as P

    from ssd_jax.models.tp import TP_AXIS
    from ssd_jax.runtime.sharding import param_specs

    params = abstract_params(cfg)
    specs = param_specs(params, tp)

    def shard(x, spec):
        shape = [d // tp if ax == TP_AXIS else d for d, ax in zip(x.shape, tuple(spec) + (None,) * x.ndim)]
        return int(np.prod(shape)) * np.dtype(x.dtype).itemsize

    return sum(jax.tree_util.tree_leaves(jax.tree_util.tree_map(
        shard, params, specs, is_leaf=lambda s: isinstance(s, P))))


def kv_bytes(cfg, batch: int, context: int, tp: int = 1) -> int:
    """One device's share of the KV cache [B, S, KVH, D] x 2 x layers (KV heads split over tp)."""
    import jax

    from ssd_jax.models.kv_cache import init_cache

    cache = jax.eval_shape(lambda: init_cache(cfg, batch, context))
    return sum(x.size * x.dtype.itemsize for x in jax.tree_util.tree_leaves(cache)
               if x.ndim == 4) // min(tp, cfg.num_kv_heads)


def projection(batch: int, context: int, layout: str = "4+1") -> tuple[list[dict], str]:
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from paper_projection import PAIRS

    from ssd_jax.algorithm.speculation_cache import cache_bytes
    from ssd_jax.models.config import tiny_config

    tp = int(layout.split("+")[0])
    fan = (3, 2, 1, 1, 1)  # the README's example fan-out (K 4)
    k = len(fan) - 1
    rows, lines = [], [f"layout {layout}: the target tensor-parallel over {tp} devices, the draft "
                       f"on one; bf16 weights and KV cache; SSD rows fp32 at fan-out {fan}", "",
                       "| model | device | B | context | weights GB | KV GB | spec GB | total GB "
                       "| of 80 GB | of 141 GB |", "|---|---|---|---|---|---|---|---|---|---|"]
    for big, small in PAIRS.values():
        for shape, role, t in ((big, "target", tp), (small, "draft", 1)):
            cfg = tiny_config("qwen3" if shape.qk_norm else "llama", vocab_size=shape.vocab,
                              hidden_size=shape.hidden, intermediate_size=shape.intermediate,
                              num_layers=shape.layers, num_heads=shape.heads,
                              num_kv_heads=shape.kv_heads, head_dim=shape.head_dim,
                              tie_embeddings=shape.tied, dtype="bfloat16")
            w = per_device_weight_bytes(cfg, t)
            for b in sorted({1, batch}):
                kv = kv_bytes(cfg, b, context, t)
                spec = cache_bytes(b, sum(fan), k, shape.vocab, "float32") if role == "draft" else 0
                total = w + kv + spec
                rows.append(dict(model=shape.name, role=role, devices=t, batch=b, context=context,
                                 weights=w, kv_cache=kv, spec_cache=spec, total=total))
                lines.append(f"| {shape.name} ({role}) | 1 of {t} | {b} | {context} | {_gb(w)} | "
                             f"{_gb(kv)} | {_gb(spec)} | {_gb(total)} | {100 * total / 80e9:.0f}% | "
                             f"{100 * total / 141e9:.0f}% |")
    return rows, "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="+", default=["ar", "sd", "ssd"])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--new-tokens", type=int, default=16)
    ap.add_argument("--project-only", action="store_true")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)), "results"))
    args = ap.parse_args(argv)
    measured = []
    if not args.project_only:
        for dtype in args.dtypes:
            for mode in args.modes:
                measured.append(measure(mode, dtype, args.target, args.draft, args.new_tokens))
                print(f"{mode} {dtype}: peak RSS {_gb(measured[-1]['peak_rss'])} GB", flush=True)
    projected, ptext = projection(args.batch, args.context)
    text = (f"## measured ({args.target} / {args.draft}, {args.new_tokens} greedy tokens)\n\n"
            + measured_table(measured) + "\n\n" if measured else "") + "## projected\n\n" + ptext
    print(text)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from _results import write_results
    write_results("memory", args.out, dict(measured=measured, projected=projected), text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
