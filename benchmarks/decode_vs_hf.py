"""Target decode-step and K=4 verify time: ssd_jax (JAX, fp32 and bf16) vs HF transformers (torch, fp32 and bf16),
each in its own subprocess pinned to the same cores, plus the memory bandwidth those cores reach.

    python benchmarks/decode_vs_hf.py                      # cores "0" then "0,1", all frameworks
    python benchmarks/decode_vs_hf.py --cores 0,1 --iters 8

Both frameworks run on the same weights: the GGUF dequantized by `ssd_jax.models.loading.gguf.load_gguf`
(ssd_jax restores its orbax copy of those; HF gets them as a state dict). The KV cache holds
`--context` (default 200) tokens; every timed call starts from that length (the cache is rolled back /
cropped between calls). ssd_jax times `ssd_jax.algorithm.steps.decode` (forward + greedy sample) and
`ssd_jax.algorithm.steps.verify` (5-token forward + rejection sampling); HF times `model(...)` + argmax with a
DynamicCache. Decode weight-read bandwidth = parameter bytes (in the framework's dtype) / step time,
reported as a fraction of a numpy-copy bandwidth (bytes read + written / s) on the same cores.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TARGET = "qwen2.5-coder-1.5b"


# ---------------------------------------------------------------------------- shared helpers
def hf_model(name: str, dtype: str = "float32"):
    """An HF transformers model (torch, eval mode) on the weights of our GGUF `name`."""
    from ssd_jax.models import registry
    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.loading.gguf import load_gguf_config
    from ssd_jax.tools.bench_workers import hf_model_on_our_weights

    cfg = ModelConfig.from_hf(load_gguf_config(registry.resolve(name)), "float32")
    return hf_model_on_our_weights(name, dtype, None), cfg


def param_bytes_torch(model) -> int:
    seen, total = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def machine_info() -> dict:
    """Platform, CPU (model and `cpu_features`: the instruction-set flags the kernels use and
    SSD_JAX_CPU_ISA), versions: recorded beside every figure."""
    import numpy as np

    from ssd_jax.runtime.defaults import cpu_features
    info = dict(platform=platform.platform(), python=platform.python_version(),
                cpu_count=os.cpu_count(), numpy=np.__version__, cpu_features=cpu_features())
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    for mod in ("jax", "jaxlib", "flax", "torch", "transformers"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001
            pass
    return info


def run_worker(script: Path, cores: str, args: list[str], threads: int) -> dict:
    """Run `script --worker ...` under `taskset -c cores`; its last stdout line is a JSON object."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
               JAX_PLATFORMS="cpu")
    cmd = ["taskset", "-c", cores, sys.executable, str(script), "--worker", *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    if proc.returncode != 0 or not lines:
        raise RuntimeError(f"worker {' '.join(cmd)} failed (rc {proc.returncode}):\n"
                           f"{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def _times(fn, iters: int, warmup: int = 2) -> list[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


def _stats(ts: list[float]) -> dict:
    return dict(median_s=statistics.median(ts), min_s=min(ts), n=len(ts))


# ---------------------------------------------------------------------------- workers
def _parallel_round(threads: int, fn) -> float:
    """fn(i) on `threads` threads at once: seconds from all starting to all finishing."""
    start, end = threading.Barrier(threads + 1), threading.Barrier(threads + 1)

    def body(i):
        start.wait()
        fn(i)
        end.wait()

    ths = [threading.Thread(target=body, args=(i,)) for i in range(threads)]
    [t.start() for t in ths]
    start.wait()
    t0 = time.perf_counter()
    end.wait()
    dt = time.perf_counter() - t0
    [t.join() for t in ths]
    return dt


def _arrays(threads: int, mib: int):
    """A `mib` MiB source and destination per thread; their total size in bytes."""
    import numpy as np
    srcs = [np.ones(mib << 18, np.float32) for _ in range(threads)]
    return srcs, [np.empty_like(s) for s in srcs], sum(s.nbytes for s in srcs)


def worker_bandwidth(threads: int, mib: int, iters: int) -> dict:
    """numpy copy of a `mib` MiB array per thread, (read + write) bytes / s over all threads (the
    goal's reference); and, for context, a read-only pass (`sum`) over the same arrays: a decode
    only reads, and this VM reads alone slower than it copies."""
    import numpy as np
    srcs, dsts, nbytes = _arrays(threads, mib)

    def times(fn) -> list[float]:
        _parallel_round(threads, fn)  # warm-up: first touch of the pages
        return [_parallel_round(threads, fn) for _ in range(iters)]

    copy = times(lambda i: np.copyto(dsts[i], srcs[i]))
    read_s = min(times(lambda i: srcs[i].sum()))
    return dict(kind="bandwidth", threads=threads, bytes_per_s=2 * nbytes / min(copy),
                best_s=min(copy), median_bytes_per_s=2 * nbytes / statistics.median(copy),
                median_s=statistics.median(copy), read_bytes_per_s=nbytes / read_s)


def worker_jax(context: int, iters: int, k: int, dtype: str = "float32", threads: int = 1,
               bw_mib: int = 512) -> dict:
    import jax
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.load import load_model
    from ssd_jax.models.params import decode_bytes
    from ssd_jax.algorithm import steps
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.algorithm.verify import rejection_sample

    from ssd_jax.models.ops import XLA
    try:  # the CPU kernels' backend table (models/cpu), where they build
        from ssd_jax.models import cpu
        ops = cpu.backend()
    except RuntimeError as e:
        print(f"{e}: XLA's ops", file=sys.stderr)
        ops = XLA
    model = load_model(TARGET, dtype)
    cfg, params = model.cfg, ops.prepare(jax.device_put(model.params))  # the backend's layouts
    nbytes = decode_bytes(params)  # the head's bytes once (an untied copy is read, not the embedding)
    V = model.tokenizer.vocab_size
    sp = SamplingParams()
    rng = np.random.default_rng(0)
    bucket = 1 << (context - 1).bit_length()
    toks = np.zeros((1, bucket), np.int32)
    toks[0, :context] = rng.integers(0, V, context)
    seed, rids = jnp.int32(0), jnp.zeros((1,), jnp.int32)
    cache = init_cache(cfg, 1, 256 * (-(-(context + k + 2) // 256)))
    _, _, cache = steps.prefill(params, cfg, cache, jnp.asarray(toks), jnp.asarray([context], jnp.int32),
                                seed, rids, sp, V, ops=ops)
    state = dict(cache=cache)
    bonus = jnp.asarray([int(rng.integers(V))], jnp.int32)
    active = jnp.ones((1,), bool)
    spec = jnp.asarray(rng.integers(0, V, (1, k)), jnp.int32)
    rows = jax.nn.softmax(jnp.asarray(rng.normal(size=(1, k, cfg.vocab_size)), jnp.float32), -1)
    ctx = np.asarray([context], np.int32)  # numpy: a fresh device buffer each call (the cache is donated)

    def decode():
        tok, lp, c = steps.decode(params, cfg, state["cache"].with_lengths(ctx), bonus, active, seed,
                                  rids, sp, V, ops=ops)
        jax.block_until_ready(tok)
        state["cache"] = c

    def verify():
        res, lp, c = steps.verify(params, cfg, state["cache"].with_lengths(ctx), bonus, spec, rows,
                                  active, seed, rids, sp, V, rejection_sample, ops=ops)
        jax.block_until_ready(res.tokens)
        state["cache"] = c

    t0 = time.process_time(), time.perf_counter()
    d = _times(decode, iters)
    v = _times(verify, iters)
    cpu = (time.process_time() - t0[0]) / (time.perf_counter() - t0[1])
    return dict(kind="jax", dtype=dtype, param_bytes=nbytes, decode=_stats(d), verify=_stats(v),
                cores_used=cpu, cache_len=cache.max_len,
                paired=_paired(decode, nbytes, threads, bw_mib, iters))


def _paired(decode, nbytes: int, threads: int, mib: int, iters: int) -> dict:
    """Decode steps each right after a copy round on the same cores, in this process.

    On a shared VM the bandwidth a neighbour leaves moves by tens of percent within minutes, so a
    copy measured in another process minutes earlier can be from a different machine state. Here
    each decode is paired with the copy just before it, and the fraction is taken per pair. The
    pauses let XLA's worker threads stop spinning before numpy's copy threads run, and the reverse.
    """
    import numpy as np
    srcs, dsts, cbytes = _arrays(threads, mib)
    copy = lambda i: np.copyto(dsts[i], srcs[i])  # noqa: E731
    _parallel_round(threads, copy)  # first touch of the pages
    pairs = []
    for _ in range(iters):
        c = _parallel_round(threads, copy)
        time.sleep(0.05)
        t0 = time.perf_counter()
        decode()
        pairs.append((c, time.perf_counter() - t0))
        time.sleep(0.05)
    fr = [(nbytes / d) / (2 * cbytes / c) for c, d in pairs]
    return dict(copy=_stats([c for c, _ in pairs]), decode=_stats([d for _, d in pairs]),
                copy_bytes=2 * cbytes, fraction_median=statistics.median(fr),
                fraction_min=min(fr), fraction_max=max(fr))


def worker_torch(context: int, iters: int, k: int, dtype: str, threads: int) -> dict:
    import torch
    from transformers import DynamicCache

    torch.set_num_threads(threads)
    model, cfg = hf_model(TARGET, dtype)
    nbytes = param_bytes_torch(model)
    g = torch.Generator().manual_seed(0)
    V = cfg.vocab_size
    prompt = torch.randint(0, V, (1, context), generator=g)
    one = torch.randint(0, V, (1, 1), generator=g)
    five = torch.randint(0, V, (1, k + 1), generator=g)
    with torch.inference_mode():
        pkv = DynamicCache(config=model.config)
        model(prompt, past_key_values=pkv, use_cache=True)

        def step(x):
            out = model(x, past_key_values=pkv, use_cache=True)
            out.logits.argmax(-1)
            pkv.crop(context - pkv.get_seq_length())  # negative: tokens to drop

        t0 = time.process_time(), time.perf_counter()
        d = _times(lambda: step(one), iters)
        v = _times(lambda: step(five), iters)
        cpu = (time.process_time() - t0[0]) / (time.perf_counter() - t0[1])
    return dict(kind="torch", dtype=dtype, param_bytes=nbytes, decode=_stats(d), verify=_stats(v),
                cores_used=cpu, threads=torch.get_num_threads(),
                attn=getattr(model.config, "_attn_implementation", None))


# ---------------------------------------------------------------------------- main
def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cores", default="0;0,1", help="core sets separated by ';' (default '0;0,1')")
    ap.add_argument("--context", type=int, default=200, help="tokens in the KV cache (default 200)")
    ap.add_argument("--iters", type=int, default=8, help="timed calls per measurement (default 8)")
    ap.add_argument("--k", type=int, default=4, help="draft tokens per verify (default 4: 5 tokens)")
    ap.add_argument("--torch-dtypes", default="bfloat16,float32")
    ap.add_argument("--jax-dtypes", default="float32,bfloat16")
    ap.add_argument("--bw-mib", type=int, default=512, help="MiB per copy thread (default 512)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--dtype", default="float32", help=argparse.SUPPRESS)
    ap.add_argument("--threads", type=int, default=1, help=argparse.SUPPRESS)
    a = ap.parse_args(argv)

    if a.worker:
        sys.path.insert(0, str(ROOT))
        if a.worker == "bw":
            r = worker_bandwidth(a.threads, a.bw_mib, a.iters)
        elif a.worker == "jax":
            r = worker_jax(a.context, a.iters, a.k, a.dtype, a.threads, a.bw_mib)
        else:
            r = worker_torch(a.context, a.iters, a.k, a.dtype, a.threads)
        print(json.dumps(r))
        return 0

    script = Path(__file__).resolve()
    common = ["--context", str(a.context), "--iters", str(a.iters), "--k", str(a.k)]
    results = []
    for cores in a.cores.split(";"):
        n = len(cores.split(","))
        row = dict(cores=cores, threads=n)
        print(f"[cores {cores}] bandwidth ...", file=sys.stderr, flush=True)
        row["bandwidth"] = run_worker(script, cores, ["bw", "--threads", str(n), "--bw-mib",
                                                      str(a.bw_mib), "--iters", "5"], n)
        for dt in [d for d in a.jax_dtypes.split(",") if d]:
            print(f"[cores {cores}] jax {dt} ...", file=sys.stderr, flush=True)
            row[f"jax_{dt}"] = run_worker(script, cores, ["jax", "--dtype", dt, "--threads", str(n),
                                                          "--bw-mib", str(a.bw_mib), *common], n)
        for dt in [d for d in a.torch_dtypes.split(",") if d]:
            print(f"[cores {cores}] torch {dt} ...", file=sys.stderr, flush=True)
            row[f"torch_{dt}"] = run_worker(script, cores, ["torch", "--dtype", dt, "--threads",
                                                            str(n), *common], n)
        results.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    report = dict(machine=machine_info(), command=" ".join([Path(sys.executable).name, *sys.argv]),
                  context=a.context, k=a.k, iters=a.iters, results=results)
    print(render(report))
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(report, indent=1))
    return 0


def _fastest(row: dict, prefix: str) -> dict:
    """The framework's run with the shortest decode in this row (its fastest dtype here)."""
    return min((row[x] for x in row if x.startswith(prefix)), key=lambda r: r["decode"]["median_s"])


def render(report: dict) -> str:
    k = report["k"]
    from ssd_jax.runtime.defaults import describe
    feats = report.get("machine", {}).get("cpu_features")
    out = [f"Target {TARGET}, KV cache {report['context']} tokens, verify = {k + 1} tokens, "
           f"median of {report['iters']} calls (ms).",
           f"CPU: {describe(feats) if feats else 'features not recorded'}.", "",
           "| cores | framework | dtype | decode ms | verify ms | verify/decode | ours/HF decode "
           "| ours/HF verify | decode GB/s (weights) | copy GB/s | fraction of copy BW | read GB/s "
           "| fraction of read BW |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for row in report["results"]:
        bw = row["bandwidth"]["bytes_per_s"]
        rbw = row["bandwidth"].get("read_bytes_per_s", float("nan"))
        j = _fastest(row, "jax")
        for key in [x for x in row if x.startswith("jax")] + [x for x in row if x.startswith("torch_")]:
            r = row[key]
            d, v = r["decode"]["median_s"], r["verify"]["median_s"]
            wbw = r["param_bytes"] / d
            ours = key.startswith("jax")
            ours_d = "—" if ours else f"{j['decode']['median_s'] / d:.2f}"
            ours_v = "—" if ours else f"{j['verify']['median_s'] / v:.2f}"
            fw = "ssd_jax" if ours else "HF torch"
            out.append(f"| {row['cores']} | {fw} | {r['dtype']} | {d * 1e3:.1f} | {v * 1e3:.1f} | "
                       f"{v / d:.2f} | {ours_d} | {ours_v} | {wbw / 1e9:.1f} | {bw / 1e9:.1f} | "
                       f"{wbw / bw:.0%} | {rbw / 1e9:.1f} | {wbw / rbw:.0%} |")
    out += ["", "ours/HF < 1 means ssd_jax (in its fastest dtype) is faster. Goals, for each "
            "framework's fastest dtype: decode no slower than HF at equal cores; decode weight reads "
            ">= 70% of copy bandwidth (read bandwidth shown for context); verify <= 1.5x decode.",
            "The table's fraction is the decode's median against the copy's best (the strictest "
            "pairing), measured in separate processes minutes apart, while neighbours' traffic "
            "on this shared VM comes and goes. The goal is judged on `paired`: each decode step "
            "right after a copy round on the same cores in the JAX process, the median of the "
            "per-pair fractions (older JSONs without it: median/median and best/best, both "
            ">= 70%). The separate-process pairings are shown beside it."]
    for row in report["results"]:
        j = _fastest(row, "jax")
        fr = fractions(j, row["bandwidth"])
        vd = j["verify"]["median_s"] / j["decode"]["median_s"]
        if fr["paired"] is not None:
            met = fr["paired"] >= 0.7
        else:  # an older JSON without the copy's median is judged on the strict pairing instead
            met = min(fr["median"] if fr["median"] is not None else fr["strict"], fr["best"]) >= 0.7
        shown = ", ".join(f"{k} {v:.0%}" for k, v in fr.items() if v is not None)
        if any(x.startswith("torch_") for x in row):
            hf = _fastest(row, "torch_")
            vs_hf = (f"decode ours({j['dtype']})/HF({hf['dtype']}) = "
                     f"{j['decode']['median_s'] / hf['decode']['median_s']:.2f} "
                     f"({'met' if j['decode']['median_s'] <= hf['decode']['median_s'] else 'NOT met'})")
        else:
            vs_hf = "no HF run"
        out.append(f"- cores {row['cores']}: {vs_hf}; "
                   f"bandwidth fraction ({shown}) ({'met' if met else 'NOT met'}); "
                   f"verify/decode {vd:.2f} ({'met' if vd <= 1.5 else 'NOT met'}); "
                   f"JAX process used {j['cores_used']:.2f} cores")
        if "paired" in j:
            pr = j["paired"]
            copy_bw = pr["copy_bytes"] / pr["copy"]["median_s"]
            dec = pr["decode"]["median_s"]
            out.append(f"  - paired ({pr['decode']['n']} pairs): copy {copy_bw / 1e9:.1f} GB/s, "
                       f"decode {dec * 1e3:.1f} ms ({j['param_bytes'] / dec / 1e9:.1f} GB/s) (medians); "
                       f"per-pair fraction median {pr['fraction_median']:.0%}, "
                       f"range {pr['fraction_min']:.0%}-{pr['fraction_max']:.0%}")
    return "\n".join(out)


def fractions(j: dict, bw: dict) -> dict:
    """The decode's weight-read rate over the copy bandwidth: paired (median of per-pair fractions,
    copy and decode back to back in one process, see `_paired`), like for like across processes
    (median over median, best over best) and strict (median over best, the table's). None where
    an older JSON lacks the figure."""
    nbytes, dec = j["param_bytes"], j["decode"]
    med = bw.get("median_bytes_per_s")
    paired = j.get("paired", {}).get("fraction_median")
    return dict(paired=paired, median=None if med is None else nbytes / dec["median_s"] / med,
                best=nbytes / dec["min_s"] / bw["bytes_per_s"],
                strict=nbytes / dec["median_s"] / bw["bytes_per_s"])


if __name__ == "__main__":
    sys.exit(main())
