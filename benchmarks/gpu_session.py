"""One GPU session: every GPU check and measurement the project has, in one command that fits a
short lease, each step in a process of its own under a time limit, one JSON at the end.

    python benchmarks/gpu_session.py --out $OUT                       # on the GPU machine (all: ~15 min)
    JAX_PLATFORMS=cpu python benchmarks/gpu_session.py --smoke --out /tmp/s   # here, end to end

Steps, in order (each one's stdout goes to `<out>/logs.txt`, its figures into
`<out>/gpu_session.json`, rewritten after every step; `--only a,b` runs some, and the session
stops starting steps at `--budget-s`). The whole list takes ~15 minutes on an H200, more than a
lease's run: the first lease (2026-12-04, benchmarks/README.md "On one H200") ran the first five
of the old order. The next should answer whether the rebuilt GPU path (Pallas attention with the
cache write, add + norm, the tree kernel with its branch write: ~11 launches a layer instead of
20-32, benchmarks/README.md "The Pallas path for an H100") pays on the clock, against the commit
before it on the same warm machine: here, `git worktree add .before 290656c` and
`echo /.before/ >> .git/info/exclude`; then one `run` carrying `.before`:

    pip install -q --no-deps -e . && python benchmarks/gpu_session.py --out $OUT/after \
        --only step,pair_b16,pair_b1_warm --budget-s 330 && cd .before && \
        pip install -q --no-deps -e . && python benchmarks/gpu_session.py --out $OUT/before \
        --only step,pair_b16 --budget-s 200

(~9 minutes; `pair_b1_warm` needs `pair_b1_cold` before it in the same run to be warm, else it
is a second cold row). A second run, if the lease allows one: `--only
inspect_device,engine_check_bf16,step_graphs,kernels_pair` on this commit.

1. `env`: the device and jax's version (and nvidia-smi's line, in the JSON).
2. `engine_check`: benchmarks/gpu_engine_check.py: AR, SD, SSD on the xla and pallas backends
   emit plain decoding's tokens, no kernel falls back; chunked rounds beside round by round.
   `engine_check_bf16`: the same runs in bf16, timed (is the pallas backend slower there too?).
3. `step`: one bare jitted decode step of each of the pair's shapes with the engine's ops and
   the XLA ones side by side (see `step`): its time with
   the host fetching each token, inside one device loop, against its weights' bytes at HBM
   bandwidth, and the fusions and custom calls it compiles to; `step_graphs` again with XLA's
   command buffers (CUDA graphs) over every thunk kind (smoke: the flags are GPU-only, so the
   step is dropped on a CPU).
4. `pair_b1_cold`, `pair_b1_warm`, `pair_b16`: the engine on random weights of the default
   pair's shapes (Qwen2.5-Coder-1.5B target, 0.5B draft), bf16, colocated on the one device:
   AR / SD / SSD tokens/s; per round the verify alone and the draft alone (`timeline=True`,
   rounds read one by one with each phase timed) against the engine's whole round (the default
   pipelined loop: its wall / rounds); each mode's first call (trace, compile, run). `pair_b1_cold` starts with an empty
   persistent cache and step store, `pair_b1_warm` is a second process that finds them filled.
   `chunk_memory`: `pair --chunk-memory`: each chunk of steps or rounds (on by default on a
   GPU) compiled as the engine calls it, its temporaries beside the embedding's bytes; on a CPU a
   hoisted fp32 copy of the table made them 1.4 GB (benchmarks/README.md at 8faea7c, "A chunk's
   loop rewrote the embedding in fp32").
5. `kernels_pair` / `kernels_paper`: pallas_kernels/bench_gpu.py at the default pair's draft
   shape (batch 16) and at the paper's shape: max error against the jnp reference, time per call,
   bytes/s against the HBM roofline, against XLA's forms.
6. `host_overhead`: benchmarks/host_overhead.py on tiny models: Python calls and device->host
   syncs per round and host ms per round on this device.
7. `projection`: benchmarks/paper_projection.py --measure: the published pairs cut to 4 layers.
8. `inspect_device`: `ssd-jax inspect --target local` on the device: the default pair's decode,
   verify, draft and tree steps at b = 16 compiled with the autotuner's GEMM picks (kernels, cache
   copies, bytes; ~1-2 minutes of compiling, the chunks left out for the lease's sake), with XLA
   writing the autotune results, which the JSON carries (`"autotune"`): saved to a file, `ssd-jax
   inspect --target h100 --steps decode,verify,draft,tree --batch 16 --autotune FILE` then
   compiles here, without the device, with the device's GEMM configurations instead of the
   deviceless heuristics (whose split-k partials make the b = 16 steps' bytes,
   benchmarks/README.md "The Pallas path for an H100").

Random weights make every time real and the acceptance an artefact: random tied-embedding models
tend to repeat their last token, so the draft and the target agree on almost every token (the
engine's best case at K 4); tokens/s here is the engine's speed at that acceptance, not the pair's.
`pair` and `step` are subcommands too
(one process each: `gpu_session.py pair --batch 1 16 --json f`).
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# The default pair's published shapes, as `ssd-jax inspect` compiles them
from ssd_jax.tools.inspect import QWEN_0_5B as DRAFT_0_5B, QWEN_1_5B as TARGET_1_5B  # noqa: E402
SMOKE_T = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
               num_kv_heads=2, head_dim=16, tie_embeddings=True)
SMOKE_D = dict(SMOKE_T, num_layers=1)
K, FANOUT = 4, (3, 2, 2, 1, 1)
AUTOTUNE = "autotune.textproto"  # the GEMM configurations XLA's autotuner picked (`inspect_device`)


# ------------------------------------------------------------------------------------------------
# pair: the engine on random weights of the default pair's shapes (one process)
# ------------------------------------------------------------------------------------------------
def _pair_configs(smoke: bool, max_len: int) -> dict:
    """{"target": cfg, "draft": cfg}: the pair's shapes in bf16 (tiny, float32 for --smoke)."""
    from ssd_jax.models.config import tiny_config
    shapes = {"target": SMOKE_T, "draft": SMOKE_D} if smoke else {"target": TARGET_1_5B,
                                                                 "draft": DRAFT_0_5B}
    return {name: tiny_config("qwen2", rope_theta=1e6, max_position_embeddings=max_len,
                              dtype="float32" if smoke else "bfloat16", **shape)
            for name, shape in shapes.items()}


def _median(xs):
    return float(statistics.median(xs)) if xs else None


def _chunk_memory_row(eng, models, prompts, mkw, kw) -> dict:
    """The chunk `mkw["mode"]` runs, compiled as the engine calls it: its temporaries beside the
    embedding's bytes (a weight-sized temporary is a weight rewritten every chunk)."""
    from chunk_memory import chunk_temporaries
    temp, arg = chunk_temporaries(eng, mkw["mode"], prompts,
                                  **{k: v for k, v in mkw.items() if k != "mode"}, **kw)
    return dict(chunk_temp_mib=temp / 2**20, chunk_args_mib=arg / 2**20,
                embed_mib={n: m.params.embed.nbytes / 2**20 for n, m in models.items()})


def _timed_row(eng, prompts, mkw, kw, first_calls_only: bool) -> dict:
    """One mode's first call (trace, compile, run), then unless `first_calls_only` a timed call
    and, for SD / SSD, the per-phase medians of timed rounds (`timeline=True`)."""
    mode, row = mkw["mode"], {}
    t0 = time.perf_counter()
    out = eng.generate(prompts, **mkw, **kw)
    row["first_call_s"] = time.perf_counter() - t0
    row["first_call_compile_s"] = out.metrics.compile_s
    if first_calls_only:
        return row
    t0 = time.perf_counter()
    out = eng.generate(prompts, **mkw, **kw)
    wall = time.perf_counter() - t0
    m = out.metrics
    toks = sum(len(t) for t in out.token_ids)
    row.update(wall_s=wall, tokens=toks, tok_per_s=toks / wall, rounds=m.rounds,
               round_ms=wall / max(1, m.rounds) * 1e3, compile_s=m.compile_s,
               prefill_s=m.prefill_s)
    if mode == "ssd":
        row.update(hits=m.hits, lookups=m.lookups)
    if mode != "ar":
        row["acceptance_hist"] = list(m.accept_hist)
        tl = eng.generate(prompts, **mkw, timeline=True, **kw).metrics.timeline
        steady = [r for r in tl if not r.compiled][1:] or tl
        row.update(timeline_round_ms=_median([r.round_s * 1e3 for r in steady]),
                   verify_ms=_median([r.verify_s * 1e3 for r in steady]),
                   draft_ms=_median([r.draft_s * 1e3 for r in steady]),
                   backup_ms=_median([r.backup_s * 1e3 for r in steady]))
        # (the 2026-12-04 JSON also holds round_minus_parts_ms = round_ms - these parts:
        # negative there, since the parts come from the slower host loop, so not a host share;
        # dropped)
    return row


def pair(argv) -> int:
    ap = argparse.ArgumentParser(prog="gpu_session.py pair")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--new", type=int, default=64, help="new tokens per row")
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--cache", default=None, help="persistent compile cache + step store dir")
    ap.add_argument("--first-calls-only", action="store_true",
                    help="time each mode's first call only (the warm second process)")
    ap.add_argument("--chunk-memory", action="store_true",
                    help="time nothing: each mode's chunk (decode_chunk, sd_chunk, ssd_chunk) "
                         "compiled as the engine calls it, its temporaries beside the "
                         "embedding's bytes (benchmarks/chunk_memory.py)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU)")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)

    t_start = time.perf_counter()
    import jax
    import numpy as np

    from ssd_jax.models.model import Model
    from ssd_jax.models.params import init_params
    from ssd_jax.runtime.engine import Engine, SSDConfig

    max_len = args.prompt_len + args.new + 64
    models = {}
    t0 = time.perf_counter()
    for seed, (name, cfg) in enumerate(_pair_configs(args.smoke, max_len).items()):
        models[name] = Model(cfg, init_params(cfg, jax.random.key(seed), scale=0.5), name=name)
    jax.block_until_ready([m.params for m in models.values()])
    init_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    eng = Engine(models["target"], models["draft"], placement="colocated", max_len=max_len,
                 compilation_cache=args.cache or False, step_store=bool(args.cache))
    engine_s = time.perf_counter() - t0
    rng = np.random.default_rng(0)
    vocab = models["target"].cfg.vocab_size
    res = dict(device=str(jax.devices()[0]), jax=jax.__version__,
               dtype=models["target"].cfg.dtype, k=K,
               fanout=list(FANOUT), new_tokens=args.new, prompt_len=args.prompt_len,
               init_params_s=init_s, engine_s=engine_s, backend=dict(eng.backend), runs=[])
    modes = {"ar": dict(mode="ar"), "sd": dict(mode="sd", k=K),
             "ssd": dict(mode="ssd", k=K, ssd=SSDConfig(fanout=FANOUT))}
    if args.chunk_memory:
        eng.round_chunks = True  # on by default on a GPU; forced, so --smoke's CPU runs them too
    for b in args.batch:
        prompts = [[int(x) for x in rng.integers(1, vocab, args.prompt_len)] for _ in range(b)]
        kw = dict(max_new_tokens=args.new, eos_ids=[])
        for mode, mkw in modes.items():
            row = dict(batch=b, mode=mode)
            if args.chunk_memory:
                row.update(_chunk_memory_row(eng, models, prompts, mkw, kw))
            else:
                row.update(_timed_row(eng, prompts, mkw, kw, args.first_calls_only))
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            res["total_s"] = time.perf_counter() - t_start
            Path(args.json).write_text(json.dumps(res, indent=1))  # each row: a time limit keeps them
    return 0


# ------------------------------------------------------------------------------------------------
# step: one bare decode step of each model, against its weights' bytes (one process)
# ------------------------------------------------------------------------------------------------
def step(argv) -> int:
    """A jitted one-token decode step (`forward`, greedy argmax, the cache donated) of the pair's
    shapes at a 512-token context: per step when the host dispatches and fetches each token (as
    a plain decode loop does), and inside one `lax.fori_loop` (the device's time alone), against
    the weights' bytes at HBM bandwidth; and how many fusions and custom calls XLA's optimized
    program holds (~ the kernels a step launches). The engine's AR round on the same shapes,
    over this step, is what the engine adds."""
    ap = argparse.ArgumentParser(prog="gpu_session.py step")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    ap.add_argument("--iters", type=int, default=64)
    ap.add_argument("--backends", default="auto,xla",
                    help="the op tables timed side by side (default auto,xla: on a GPU the "
                         "Pallas kernels the engine runs, and the XLA reference ops)")
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--json", required=True)
    args = ap.parse_args(argv)
    import re

    import jax
    import jax.numpy as jnp
    import numpy as np
    from jax import lax

    from ssd_jax.algorithm.aot import step_jit
    from ssd_jax.models.backends import select
    from ssd_jax.models.kv_cache import init_cache
    from ssd_jax.models.params import init_params, param_bytes
    from ssd_jax.models.transformer import forward

    context, window = (16, 64) if args.smoke else (512, 1024)
    res = dict(device=str(jax.devices()[0]), jax=jax.__version__, context=context, window=window,
               iters=args.iters, hbm_bytes_per_s=4.8e12, runs=[])
    for (name, cfg), backend in itertools.product(_pair_configs(args.smoke, window).items(),
                                                  args.backends.split(",")):
        ops = select(backend)
        params = init_params(cfg, jax.random.key(0))
        wbytes = param_bytes(params)
        params = ops.prepare(params)

        def decode(p, tok, cache, cfg=cfg, ops=ops):
            logits, cache = forward(p, cfg, tok, cache, last_only=True, window=window, ops=ops)
            return jnp.argmax(logits, -1).astype(jnp.int32)[:, None], cache

        def device_loop(p, tok, cache):
            return lax.fori_loop(0, args.iters, lambda i, c: decode(p, *c), (tok, cache))

        # compiled as the engine compiles its steps (the library's XLA options: aot.step_jit)
        one = step_jit(decode, donate_argnums=2)
        loop = step_jit(device_loop, donate_argnums=2)
        for b in args.batch:
            def fresh():
                c = init_cache(cfg, b, window)
                keys = jax.random.split(jax.random.key(b), 2 * len(c.k))
                rnd = [jax.random.normal(k, x.shape, jnp.float32).astype(x.dtype)
                       for k, x in zip(keys, c.k + c.v)]
                return c.replace(k=tuple(rnd[:len(c.k)]), v=tuple(rnd[len(c.k):]),
                                 lengths=jnp.full((b,), context, jnp.int32))
            tok = jnp.ones((b, 1), jnp.int32)
            # compiled once each, and called as compiled (a jit's call would compile again)
            one_c = one.lower(params, tok, fresh()).compile()
            loop_c = loop.lower(params, tok, fresh()).compile()
            hlo = one_c.as_text()
            kernels = dict(fusions=len(re.findall(r"= \S+ fusion\(", hlo)),
                           custom_calls=len(re.findall(r"custom-call\(", hlo)))
            cache = fresh()
            tok, cache = one_c(params, tok, cache)
            np.asarray(tok)
            t0 = time.perf_counter()
            for _ in range(args.iters):
                tok, cache = one_c(params, tok, cache)
                np.asarray(tok)  # the host learns each token, as a plain decode loop does
            host_ms = (time.perf_counter() - t0) / args.iters * 1e3
            jax.block_until_ready(loop_c(params, tok, fresh()))
            best = float("inf")
            for _ in range(3):
                c = fresh()
                jax.block_until_ready(c)
                t0 = time.perf_counter()
                jax.block_until_ready(loop_c(params, tok, c))
                best = min(best, time.perf_counter() - t0)
            row = dict(model=name, backend=ops.name, batch=b, weight_bytes=wbytes,
                       host_loop_ms=host_ms,
                       device_loop_ms=best / args.iters * 1e3,
                       roofline_ms=wbytes / res["hbm_bytes_per_s"] * 1e3, **kernels)
            res["runs"].append(row)
            print(json.dumps(row), flush=True)
            Path(args.json).write_text(json.dumps(res, indent=1))
    return 0


# ------------------------------------------------------------------------------------------------
# the session: each step a subprocess with a time limit
# ------------------------------------------------------------------------------------------------
def _steps(out: Path, smoke: bool, cache: Path):
    """(name, command, time limit s, the JSON file it writes under `out`[, extra environment])
    per step."""
    py, here = sys.executable, str(Path(__file__).resolve())
    bench = [py, "-m", "ssd_jax.pallas_kernels.bench_gpu"]
    s = ["--smoke"] if smoke else []
    env_cmd = [py, "-c", "import jax; print(jax.__version__, jax.devices(), "
               "jax.devices()[0].device_kind)"]
    steps = [
        ("env", env_cmd, 60, None),
        ("engine_check", [py, str(ROOT / "benchmarks" / "gpu_engine_check.py"), *s,
                          "--json", str(out / "engine_check.json")], 150, "engine_check.json"),
        ("engine_check_bf16", [py, str(ROOT / "benchmarks" / "gpu_engine_check.py"), *s,
                               "--dtype", "bfloat16", "--json", str(out / "engine_check_bf16.json")],
         150, "engine_check_bf16.json"),
        ("step", [py, here, "step", *s, "--json", str(out / "step.json")], 240, "step.json"),
        # the same steps with XLA's command buffers (CUDA graphs) over every kind of thunk,
        # loops and conditionals included: if `step` is launch-bound, this is the first lever
        ("step_graphs", [py, here, "step", *s, "--json", str(out / "step_graphs.json")], 240,
         "step_graphs.json", {"XLA_FLAGS": "--xla_gpu_enable_command_buffer=FUSION,CUBLAS,"
                              "CUBLASLT,CUSTOM_CALL,WHILE,CONDITIONAL "
                              "--xla_gpu_graph_min_graph_size=1"}),
        ("pair_b1_cold", [py, here, "pair", *s, "--batch", "1", "--cache", str(cache),
                          "--json", str(out / "pair_b1_cold.json")], 240, "pair_b1_cold.json"),
        ("pair_b1_warm", [py, here, "pair", *s, "--batch", "1", "--cache", str(cache),
                          "--first-calls-only", "--json", str(out / "pair_b1_warm.json")], 90,
         "pair_b1_warm.json"),
        ("pair_b16", [py, here, "pair", *s, "--batch", "16", "--cache", str(cache),
                      "--json", str(out / "pair_b16.json")], 240, "pair_b16.json"),
        ("chunk_memory", [py, here, "pair", *s, "--batch", "1", "--chunk-memory",
                          "--json", str(out / "chunk_memory.json")], 150, "chunk_memory.json"),
        ("kernels_pair", [*bench, *s, "--shape", "pair", "--no-sweep",
                          "--json", str(out / "kernels_pair.json")], 90, "kernels_pair.json"),
        ("kernels_paper", [*bench, *s, "--json", str(out / "kernels_paper.json")], 150,
         "kernels_paper.json"),
        ("host_overhead", [py, str(ROOT / "benchmarks" / "host_overhead.py"), "--batch", "1,16",
                           "--tokens", "24" if smoke else "64", "--repeats", "3",
                           "--cprofile", "", "--out", str(out / "host_overhead.json")], 120,
         "host_overhead.json"),
        ("projection", [py, str(ROOT / "benchmarks" / "paper_projection.py"), "--acceptance",
                        "0.86", "--hit-rate", "0.85", "--measure", "--layers", "4",
                        "--json", str(out / "projection.json")], 150, "projection.json"),
        ("inspect_device", [py, "-m", "ssd_jax", "inspect", "--target", "local", "--steps",
                            "decode,verify,draft,tree", "--batch", "16",
                            "--json", str(out / "inspect_device.json")], 150, "inspect_device.json",
         {"XLA_FLAGS": f"--xla_gpu_dump_autotune_results_to={out / AUTOTUNE}"}),
    ]
    # on a CPU: the command-buffer and autotune flags are the GPU's, and the published shapes are
    # too large (tests/test_paper_suite runs --measure on tiny ones; `ssd-jax inspect --target
    # local` is tested in tests/tools/test_inspect.py)
    return [st for st in steps
            if not (smoke and st[0] in ("step_graphs", "projection", "inspect_device"))]


def session(args) -> int:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the steps' own files stay out of `out`, which holds two: a lease returns few files
    work = Path(args.work or tempfile.mkdtemp(prefix="gpu_session_"))
    parts, cache = work / "parts", work / "cache"
    parts.mkdir(parents=True, exist_ok=True)
    deadline = time.monotonic() + args.budget_s
    report = dict(started=time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
                  smoke=args.smoke, budget_s=args.budget_s, steps={})
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if not args.smoke:
        try:
            report["nvidia_smi"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                 "--format=csv,noheader"], capture_output=True, text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError) as e:
            report["nvidia_smi"] = f"{type(e).__name__}: {e}"
    only = set(args.only.split(",")) if args.only else None
    with open(out / "logs.txt", "a") as log:
        for name, cmd, limit, result, *extra in _steps(parts, args.smoke, cache):
            if only and name not in only:
                continue
            left = deadline - time.monotonic()
            if left < 20:
                report["steps"][name] = dict(status="skipped: the session's budget ran out")
                continue
            limit = min(limit, left)
            print(f"== {name} (limit {limit:.0f} s)", flush=True)
            log.write(f"\n== {name}: {' '.join(cmd)}{f' with {extra[0]}' if extra else ''}\n")
            log.flush()
            t0 = time.monotonic()
            try:
                p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                   timeout=limit, env=dict(env, **(extra[0] if extra else {})),
                                   cwd=str(ROOT))
                status, text = ("ok" if p.returncode == 0 else f"exit {p.returncode}"), p.stdout
            except subprocess.TimeoutExpired as e:
                text = e.stdout if isinstance(e.stdout, str) else (e.stdout or b"").decode()
                status = f"timed out after {limit:.0f} s"
            log.write(text)
            log.flush()
            step = dict(status=status, wall_s=round(time.monotonic() - t0, 1),
                        tail=text.splitlines()[-12:])
            if result and (parts / result).exists():  # a timed-out step may have left rows
                step["result"] = json.loads((parts / result).read_text())
            if name == "inspect_device" and (parts / AUTOTUNE).exists():
                step["autotune"] = (parts / AUTOTUNE).read_text(errors="replace")
            report["steps"][name] = step
            print(f"   {status} in {step['wall_s']} s; " + " | ".join(step["tail"][-3:]),
                  flush=True)
            (out / "gpu_session.json").write_text(json.dumps(report, indent=1))
    report["finished"] = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    (out / "gpu_session.json").write_text(json.dumps(report, indent=1))
    bad = [n for n, s in report["steps"].items() if s["status"] != "ok"]
    print("RESULT: " + ("every step ok" if not bad else f"not ok: {', '.join(bad)}"))
    return 0 if not bad else 1


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["pair"]:
        return pair(argv[1:])
    if argv[:1] == ["step"]:
        return step(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="folder for gpu_session.json and the logs")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes, interpret mode (CPU)")
    ap.add_argument("--budget-s", type=float, default=480, help="stop starting steps after this")
    ap.add_argument("--work", default=None,
                    help="folder for the steps' files and the compile cache (default: a new temp)")
    ap.add_argument("--only", default=None, help="comma-separated step names")
    return session(ap.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
