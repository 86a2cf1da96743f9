"""Subprocess worker for tests/unit/test_sharding.py: the CPU device count is fixed once JAX starts, so each
case runs in its own process with `--devices N` virtual CPU devices and prints one `RESULT {json}`
line for the test to check.

    python tests/_sharding_worker.py logits|engine|hlo [--devices 8]
    python tests/_sharding_worker.py multihost --devices 2 --process-id {0,1} --port P  (two processes)
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import re
import sys

os.environ["JAX_PLATFORMS"] = "cpu"
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17], [20, 21]]


def _cfg(arch="qwen2", **kw):
    from ssd_jax.models.config import tiny_config

    base = dict(num_heads=8, num_kv_heads=4, vocab_size=64)
    base.update(kw)
    return tiny_config(arch, **base)


def _rel(a, b) -> float:
    import numpy as np

    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def case_logits() -> dict:
    """Prefill, a K+1-token verify-shaped forward and a decode on a TP target vs the unsharded run."""
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.params import random_params
    from ssd_jax.models.transformer import forward
    from ssd_jax.runtime.placement import make_placement
    from ssd_jax.runtime.sharding import init_target_cache, shard_target, tp_config

    fwd = jax.jit(forward, static_argnames=("cfg",), donate_argnames=("cache",))
    rng = np.random.default_rng(0)
    B, S = 2, 32
    prompt = jnp.asarray(rng.integers(0, 64, (B, 8)), jnp.int32)
    lens = jnp.asarray([8, 5], jnp.int32)
    chunk = jnp.asarray(rng.integers(0, 64, (B, 4)), jnp.int32)
    one = jnp.asarray(rng.integers(0, 64, (B, 1)), jnp.int32)

    def run(cfg, params, cache):
        outs = []
        for toks, n in ((prompt, lens), (chunk, None), (one, None)):
            logits, cache = fwd(params, cfg, toks, cache, n)
            outs.append(np.asarray(logits))
        return outs, cache

    out = {}
    # (arch, heads, kv heads): GQA split over shards; Qwen3 q/k norm with KV heads replicated at TP 4
    for arch, h, kvh in (("qwen2", 8, 4), ("qwen3", 8, 2), ("llama", 8, 8)):
        cfg = _cfg(arch, num_heads=h, num_kv_heads=kvh)
        params = random_params(cfg, 0, scale=1.0)
        ref, _ = run(cfg, params, init_cache(cfg, B, S))
        for tp in (2, 4):
            pl = make_placement(f"{tp}+1")
            tcfg, tparams = shard_target(params, cfg, pl.target_mesh)
            cache = init_target_cache(tcfg, B, S, pl.target_mesh)
            got, cache = run(tcfg, tparams, cache)
            out[f"{arch}_h{h}_kv{kvh}_tp{tp}"] = {
                "rel": max(_rel(g, r) for g, r in zip(got, ref)),
                "wqkv_spec": str(tparams.layers[0].wqkv.sharding.spec),
                "wqkv_shard": list(tparams.layers[0].wqkv.addressable_shards[0].data.shape),
                "cache_spec": str(cache.k[0].sharding.spec),
                "cache_kvh": int(cache.k[0].shape[2]),
                "cache_shard": list(cache.k[0].addressable_shards[0].data.shape),
            }
    errors = {}
    for name, cfg, tp in (("kv3_tp2", _cfg(num_heads=6, num_kv_heads=3), 2),
                          ("h8_tp3", _cfg(), 3)):
        try:
            tp_config(cfg, tp)
            errors[name] = ""
        except ValueError as e:
            errors[name] = str(e)
    out["errors"] = errors
    return out


def case_engine() -> dict:
    """Greedy AR / SD / SSD token ids across layouts: unsharded 1+1, TP 2+1 and 4+1, TP 4 with a
    2-device data-parallel draft (4+2), batch 4 (draft batch-sharded) and batch 1 (replicated)."""
    import time

    from ssd_jax.models.model import Model
    from ssd_jax.models.params import perturb, random_params
    from ssd_jax.runtime.engine import Engine, SSDConfig

    cfg = _cfg()
    target = Model(cfg, random_params(cfg, 0, scale=1.0), name="tiny-target")
    draft = Model(cfg, perturb(target.params, jax.random.key(1), 0.2))
    n = 16
    ssd_kw = dict(mode="ssd", max_new_tokens=n, k=3, ssd=SSDConfig(fanout=(2, 2, 1, 1)))
    out = {"ar": {}, "ssd": {}, "sd": {}, "ssd_b1": {}, "metrics": {}, "seconds": {}}
    for layout in ("1+1", "2+1", "4+1", "4+2"):
        t0 = time.perf_counter()
        eng = Engine(target, draft, placement=layout, compilation_cache=False)
        if layout != "4+2":
            out["ar"][layout] = eng.generate(PROMPTS, mode="ar", max_new_tokens=n).token_ids
        if layout != "2+1":
            r = eng.generate(PROMPTS, **ssd_kw)
            out["ssd"][layout] = r.token_ids
            out["metrics"][layout] = {"hits": r.metrics.hits, "lookups": r.metrics.lookups}
        if layout == "4+2":
            out["draft_cache_spec"] = str(eng.worker.cache.k[0].sharding.spec)
            out["draft_cache_devices"] = len(eng.worker.cache.k[0].sharding.device_set)
            out["target_cache_spec"] = str(eng.tcache.k[0].sharding.spec)
            out["target_wqkv_spec"] = str(eng.tparams.layers[0].wqkv.sharding.spec)
            out["sd"][layout] = eng.generate(PROMPTS, mode="sd", max_new_tokens=n, k=3).token_ids
            out["ssd_b1"][layout] = eng.generate(PROMPTS[:1], **ssd_kw).token_ids
            out["draft_cache_spec_b1"] = str(eng.worker.cache.k[0].sharding.spec)
        out["seconds"][layout] = time.perf_counter() - t0
    return out


_COLLECTIVES = ("all-gather", "all-reduce", "all-to-all", "collective-permute", "reduce-scatter")
_HLO_OP = re.compile(r"=\s*(.*?)\s(" + "|".join(_COLLECTIVES) + r")(?:-start)?\(")
_HLO_SHAPE = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def _collectives(text: str) -> list[dict]:
    """One entry per result of each collective instruction (a tuple-shaped all-reduce has several)."""
    ops = []
    for line in text.splitlines():
        m = _HLO_OP.search(line)
        if not m:
            continue
        for dtype, dims in _HLO_SHAPE.findall(m.group(1)):
            ops.append({"op": m.group(2), "dtype": dtype,
                        "shape": [int(d) for d in dims.split(",") if d]})
    return ops


def case_hlo() -> dict:
    """Collectives in the compiled verify step of a TP target, with the shapes they produce."""
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models.params import random_params
    from ssd_jax.algorithm import steps
    from ssd_jax.runtime.placement import make_placement, to_mesh
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.runtime.sharding import init_target_cache, shard_target
    from ssd_jax.algorithm.verify import rejection_sample

    out = {}
    cfg = _cfg(hidden_size=128, intermediate_size=256, vocab_size=256)
    params = random_params(cfg, 0)
    weight_shapes = sorted({tuple(x.shape) for x in jax.tree_util.tree_leaves(params) if x.ndim == 2})
    out["weight_shapes"] = [list(s) for s in weight_shapes]
    out["min_weight_elems"] = int(min(np.prod(s) for s in weight_shapes))
    B, K, S = 2, 3, 64
    for tp in (2, 4):
        pl = make_placement(f"{tp}+1")
        tcfg, tparams = shard_target(params, cfg, pl.target_mesh)
        cache = init_target_cache(tcfg, B, S, pl.target_mesh)
        rep = pl.target
        args = (tparams, tcfg, cache, to_mesh(np.zeros(B, np.int32), rep),
                to_mesh(np.zeros((B, K), np.int32), rep),
                to_mesh(np.ones((B, K, cfg.vocab_size), np.float32), pl.target_rows(cfg.vocab_size)),
                to_mesh(np.ones(B, bool), rep), jnp.int32(0), to_mesh(np.arange(B, dtype=np.int32), rep),
                SamplingParams(temperature=0.0), cfg.vocab_size, rejection_sample)
        text = steps.verify.lower(*args).compile().as_text()
        ops = _collectives(text)
        raw = {name: len(re.findall(rf"\s{name}(?:-start)?\(", text)) for name in _COLLECTIVES}
        found = [m.group(2) for m in map(_HLO_OP.search, text.splitlines()) if m]
        out[f"tp{tp}"] = {"ops": ops, "raw_counts": raw, "num_layers": cfg.num_layers,
                          "parsed_counts": {name: found.count(name) for name in _COLLECTIVES}}
    return out


def case_dp_draft(dump: str) -> dict:
    """Collectives in every program a 2-device data-parallel draft compiles (layout 1+2, batch 4,
    SD and SSD with hits and misses, each backup). The target has one device, so any collective
    is the draft's."""
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import perturb, random_params
    from ssd_jax.runtime.engine import Engine, SSDConfig

    cfg = _cfg()
    target = Model(cfg, random_params(cfg, 0, scale=1.0))
    draft = Model(cfg, perturb(target.params, jax.random.key(1), 0.2))
    eng = Engine(target, draft, placement="1+2", compilation_cache=False)
    for mode, backup in (("sd", "neural"), ("ssd", "random"), ("ssd", "ngram"), ("ssd", "neural")):
        r = eng.generate(PROMPTS, mode=mode, k=3, max_new_tokens=8,
                         ssd=SSDConfig(fanout=(2, 2, 1, 1), backup=backup))
    programs = {}
    for path in sorted(glob.glob(os.path.join(dump, "*after_optimizations.txt"))):
        name = os.path.basename(path).split(".")[1]
        text = open(path).read()
        n = sum(len(re.findall(rf"\s{op}(?:-start)?\(", text)) for op in _COLLECTIVES)
        programs[name] = programs.get(name, 0) + n
    return {"programs": programs, "draft_cache_spec": str(eng.worker.cache.k[0].sharding.spec),
            "hits": r.metrics.hits, "lookups": r.metrics.lookups}


def case_multihost(process_id: int, num_processes: int, port: int) -> dict:
    """Two-process smoke of multi-controller JAX on the CPU (gloo collectives): each process has
    2 devices; a 2+2 layout takes one device of each process per mesh, so the TP target all-reduces
    across processes and the data-parallel draft's batch spans them. SD, SSD and AR calls on the
    round loop every layout runs (`ssd_jax.runtime.device_loop`)."""
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import perturb, random_params
    from ssd_jax.runtime.engine import Engine, SSDConfig
    from ssd_jax.runtime.placement import make_placement

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(f"localhost:{port}", num_processes=num_processes,
                               process_id=process_id)
    devs = sorted(jax.devices(), key=lambda d: (d.id % 2, d.process_index))
    cfg = _cfg()
    target = Model(cfg, random_params(cfg, 0, scale=1.0))
    draft = Model(cfg, perturb(target.params, jax.random.key(1), 0.2))
    eng = Engine(target, draft, placement=make_placement("2+2", devs), compilation_cache=False)
    kw = dict(max_new_tokens=8)
    sd = eng.generate(PROMPTS[:2], mode="sd", k=3, **kw)
    ssd = eng.generate(PROMPTS[:2], mode="ssd", k=3, ssd=SSDConfig(fanout=(2, 2, 1, 1)), **kw)
    out = {"process": jax.process_index(), "devices": len(jax.devices()),
           "local": len(jax.local_devices()),
           "ar": eng.generate(PROMPTS[:2], mode="ar", **kw).token_ids,
           "sd": sd.token_ids, "ssd": ssd.token_ids,
           # a draft that failed would fall back to plain decoding, whose greedy tokens are the same
           "fallback": [sd.metrics.fallback, ssd.metrics.fallback],
           "sd_rounds": sd.metrics.rounds, "lookups": ssd.metrics.lookups,
           "accepted": sum(i * c for i, c in enumerate(ssd.metrics.accept_hist)),
           "draft_cache_spec": str(eng.worker.cache.k[0].sharding.spec)}
    jax.distributed.shutdown()
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("case", choices=("logits", "engine", "hlo", "dp_draft", "multihost"))
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--process-id", type=int, default=0)
    ap.add_argument("--num-processes", type=int, default=2)
    ap.add_argument("--port", type=int, default=0)
    a = ap.parse_args()
    jax.config.update("jax_num_cpu_devices", a.devices)
    if a.case == "multihost":
        res = case_multihost(a.process_id, a.num_processes, a.port)
    elif a.case == "dp_draft":
        import tempfile

        dump = tempfile.mkdtemp(prefix="ssd_jax_hlo_")
        # read when the CPU client starts, i.e. at the first jax.devices() below
        os.environ["XLA_FLAGS"] = (f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} "
                                   "--xla_dump_hlo_as_text --xla_dump_hlo_pass_re=^$")
        assert len(jax.devices()) == a.devices, jax.devices()
        res = case_dp_draft(dump)
    else:
        assert len(jax.devices()) == a.devices, jax.devices()
        res = {"logits": case_logits, "engine": case_engine, "hlo": case_hlo}[a.case]()
    print("RESULT " + json.dumps(res))


if __name__ == "__main__":
    main()
