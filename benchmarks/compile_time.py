"""What a generate call compiles, on the default pair: a first process with an empty persistent
compilation cache, then a second process that finds it warm.

    python benchmarks/compile_time.py                                   # the default pair
    python benchmarks/compile_time.py --target smollm2-135m --draft smollm2-135m --dtype float32

Each process (a fresh `python`, so nothing is cached in memory) times: the models' load (the
conversion from the GGUF file, then the conversion cache's restore, in the first process only
with `--convert`), the Engine's set-up (placement + the backend's layout pass), then one call per
mode in `--modes` order with the CLI's defaults (greedy, K=4 for SD, K=5 and fan-out 0,..,0,1 for
SSD): wall seconds to the first streamed token and to the end of the call, and JAX's compile
events by jitted function (trace, lowering to MLIR, backend compile, which on a persistent-cache
hit is the cache read and the executable's deserialisation; cache hits and misses). The first process then runs a sweep of four sampled values per SD / SSD
(temperature, top-k, top-p and, for SSD, Saguaro C): the first sampled call compiles the sampled
steps, the next three should compile nothing. The second process repeats the per-mode calls with
the first process's persistent cache: its compile seconds as a fraction of the first's is what the
persistent cache saves a second start.

`--step-store` turns the Engine's step store on in both processes (`ssd_jax.algorithm.aot`: the
first exports each step, the second reads the exported modules back instead of tracing and
lowering them, as the CLI does by default).

The persistent cache is the Engine's (`ssd_jax.runtime.compile_cache`), pointed at a fresh
temporary directory (`--compile-cache` to give one) so the first process really starts cold. The
table goes to stdout, the JSON (with the CPU's features and the load average before and after
each process) to benchmarks/results/compile_time-<date>.json.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

EVENTS = {"/jax/core/compile/jaxpr_trace_duration": "trace",
          "/jax/core/compile/jaxpr_to_mlir_module_duration": "lower",
          "/jax/core/compile/backend_compile_duration": "backend",
          "/jax/compilation_cache/cache_retrieval_time_sec": "retrieve"}
COUNTS = {"/jax/compilation_cache/cache_hits": "hits",
          "/jax/compilation_cache/cache_misses": "misses"}
PROMPT = "def fibonacci(n):"
# a sweep of four sampled points (after a greedy first call, so the first compiles the sampled steps)
SWEEP = [dict(temperature=0.7), dict(temperature=1.0, top_p=0.9), dict(temperature=0.8, top_k=20),
         dict(temperature=1.2, top_k=5, top_p=0.95)]
SAGUARO_C = [1.0, 0.75, 0.5, 0.25]


class Events:
    """JAX's compile events (durations by jitted function name) and persistent-cache counts,
    collected while a `span` is open."""

    def __init__(self):
        import jax
        self.rows: list[tuple[str, str, float]] | None = None
        self.counts: dict[str, int] = {}
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)

    def _duration(self, event, duration, **kw):
        if self.rows is not None and event in EVENTS:
            self.rows.append((EVENTS[event], str(kw.get("fun_name", "?")), float(duration)))

    def _event(self, event, **_):
        if self.rows is not None and event in COUNTS:
            self.counts[COUNTS[event]] = self.counts.get(COUNTS[event], 0) + 1

    def start(self):
        """Open a span (forgets the last one)."""
        self.rows, self.counts = [], {}

    def stop(self) -> dict:
        """Close the span: {"compile_s": trace + lower + backend, each of those summed, "retrieve"
        (the part of "backend" spent reading the persistent cache), "hits", "misses",
        "by_function": {name: {kind: s, "n_compiles": backend compiles or cache reads}}}."""
        rows, self.rows = self.rows or [], None
        out = {k: 0.0 for k in EVENTS.values()}
        by_fn: dict[str, dict] = {}
        for kind, fn, d in rows:
            out[kind] += d
            f = by_fn.setdefault(fn, {})
            f[kind] = f.get(kind, 0.0) + d
            if kind == "backend":
                f["n_compiles"] = f.get("n_compiles", 0) + 1
        out = {k: round(v, 3) for k, v in out.items()}
        # JAX times a cache read inside its backend-compile event: "retrieve" is part of "backend"
        out["compile_s"] = round(out["trace"] + out["lower"] + out["backend"], 3)
        out.update(hits=self.counts.get("hits", 0), misses=self.counts.get("misses", 0))
        out["by_function"] = {fn: {k: round(v, 3) if isinstance(v, float) else v
                                   for k, v in f.items()}
                              for fn, f in sorted(by_fn.items(), key=lambda x: -sum(
                                  v for k, v in x[1].items() if k != "n_compiles"))}
        return out


def _loadavg() -> list[float]:
    try:
        return [float(x) for x in Path("/proc/loadavg").read_text().split()[:3]]
    except OSError:
        return []


def child(args) -> dict:
    """One fresh process's figures (see the module docstring)."""
    t_import = time.perf_counter()
    import jax  # noqa: F401

    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.models.load import load_draft, load_model
    from ssd_jax.runtime.config import SSDConfig
    from ssd_jax.runtime.defaults import choose, cpu_features
    from ssd_jax.runtime.engine import Engine
    from ssd_jax.tools.cli import DEFAULT_K, default_fanout

    out = dict(phase=args.phase, loadavg_start=_loadavg(), cpu_features=cpu_features(),
               jax=jax.__version__, devices=[str(d) for d in jax.devices()])
    out["import_s"] = round(time.perf_counter() - t_import, 2)
    ev = Events()
    choice = choose(args.backend, args.dtype, args.draft_quant)
    dtype, quant = choice["dtype"], choice["draft_quant"]
    out.update(backend_choice=choice["backend"].name, dtype=dtype, draft_quant=quant)
    if args.convert:  # the conversion a first load pays (nothing written), then the cache's restore
        for name, role in ((args.target, "target"), (args.draft, "draft")):
            t0 = time.perf_counter()
            m = load_model(name, dtype, use_cache=False)
            jax.block_until_ready(m.params)
            out[f"convert_{role}_s"] = round(time.perf_counter() - t0, 2)
            del m
    t0 = time.perf_counter()
    target = load_model(args.target, dtype)
    jax.block_until_ready(target.params)
    out["load_target_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    draft = load_draft(args.draft, dtype, quant)
    jax.block_until_ready(draft.params)
    out["load_draft_s"] = round(time.perf_counter() - t0, 2)
    t0 = time.perf_counter()
    ev.start()
    engine = Engine(target, draft, placement=args.placement, max_len=args.max_len,
                    backend=args.backend, compilation_cache=args.compile_cache,
                    step_store=args.step_store)
    jax.block_until_ready(engine.tparams)
    out["engine_s"] = round(time.perf_counter() - t0, 2)
    out["engine_compile"] = ev.stop()
    out["backend"] = engine.backend

    def call(mode, sampling, c=1.0):
        k = DEFAULT_K[mode]
        first = []
        ev.start()
        t0 = time.perf_counter()
        res = engine.generate([PROMPT], mode=mode, max_new_tokens=args.max_new_tokens, k=k,
                              sampling=SamplingParams(**sampling), seed=0,
                              ssd=SSDConfig(fanout=default_fanout(k), saguaro_c=c),
                              on_tokens=lambda row, ids: first or first.append(time.perf_counter()))
        wall = time.perf_counter() - t0
        r = ev.stop()
        r.update(mode=mode, sampling=sampling, saguaro_c=c, wall_s=round(wall, 2),
                 first_token_s=round(first[0] - t0, 2) if first else None,
                 engine_compile_s=round(res.metrics.compile_s, 3),
                 tokens_per_s=round(res.metrics.tokens_per_s, 2),
                 new_tokens=res.metrics.new_tokens)
        print(f"[{args.phase}] {mode} {sampling} C={c}: compile {r['compile_s']:.1f} s "
              f"(trace {r['trace']:.1f}, lower {r['lower']:.1f}, backend {r['backend']:.1f}, "
              f"retrieve {r['retrieve']:.1f}; hits {r['hits']}, misses {r['misses']}), "
              f"wall {wall:.1f} s, first token {r['first_token_s']} s", file=sys.stderr, flush=True)
        return r

    out["first_calls"] = [call(m, {}) for m in args.modes]
    if args.sweep:
        out["sweep"] = []
        for mode in (m for m in args.modes if m != "ar"):
            for i, sp in enumerate(SWEEP):
                out["sweep"].append(call(mode, sp, SAGUARO_C[i] if mode == "ssd" else 1.0))
    out["loadavg_end"] = _loadavg()
    return out


def _table(res: dict) -> str:
    cold, warm = res["cold"], res.get("warm")
    lines = [f"# compile time: {res['target']} target, {res['draft']} draft "
             f"({cold['dtype']}, draft {cold['draft_quant']}, backend {cold['backend']}, "
             f"step store "
             f"{'on' if res.get('step_store') else 'off'})",
             f"CPU: {res['cpu']}; jax {cold['jax']}; load average (1, 5, 15 min) "
             f"{cold['loadavg_start']} at the start, {(warm or cold)['loadavg_end']} at the end", ""]
    load = [f"load target {cold['load_target_s']} s, draft {cold['load_draft_s']} s"]
    if "convert_target_s" in cold:
        load.insert(0, f"conversion target {cold['convert_target_s']} s, draft "
                       f"{cold['convert_draft_s']} s")
    lines += ["first process: import " + str(cold["import_s"]) + " s, " + "; ".join(load) +
              f"; engine set-up {cold['engine_s']} s", ""]
    lines += ["| call | process | compile s | trace | lower | backend | of it, cache read | hits / misses "
              "| first token s | wall s |", "|---|---|---|---|---|---|---|---|---|---|"]
    for proc in ("cold", "warm"):
        p = res.get(proc)
        if not p:
            continue
        for r in p["first_calls"] + p.get("sweep", []):
            what = r["mode"] + (f" {r['sampling']}" if r["sampling"] else " greedy") + (
                f" C={r['saguaro_c']}" if r["mode"] == "ssd" and r["sampling"] else "")
            lines.append(f"| {what} | {proc} | {r['compile_s']:.2f} | {r['trace']:.2f} | "
                         f"{r['lower']:.2f} | {r['backend']:.2f} | {r['retrieve']:.2f} | "
                         f"{r['hits']} / {r['misses']} | {r['first_token_s']} | {r['wall_s']} |")
    if warm:
        c = sum(r["compile_s"] for r in cold["first_calls"])
        w = sum(r["compile_s"] for r in warm["first_calls"])
        lines += ["", f"first calls ({', '.join(r['mode'] for r in cold['first_calls'])}): "
                      f"{c:.1f} s compiling in the first process, {w:.1f} s in the second: "
                      f"{w / c:.1%} of the first" if c else ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    """Run the two processes (or, with --phase, be one of them) and write the table and JSON."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="qwen2.5-coder-1.5b")
    ap.add_argument("--draft", default="qwen2.5-coder-0.5b")
    ap.add_argument("--dtype", default="auto", help="as `ssd-jax generate --dtype` (default auto)")
    ap.add_argument("--draft-quant", default="auto", help="as `ssd-jax generate` (default auto)")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--placement", default="split",
                    help="the Engine's placement (default split: one process, both models)")
    ap.add_argument("--modes", default="ssd,sd,ar", help="first calls in this order")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-len", type=int, default=4096, help="as the CLI (default 4096)")
    ap.add_argument("--compile-cache", default=None,
                    help="the persistent cache directory (default: a fresh temporary one)")
    ap.add_argument("--convert", action="store_true",
                    help="also time a conversion from the GGUF files in the first process")
    ap.add_argument("--no-warm", action="store_true", help="skip the second process")
    ap.add_argument("--no-sweep", action="store_true", help="skip the first process's sweep")
    ap.add_argument("--step-store", action="store_true",
                    help="the Engine's step store on in both processes (default off)")
    ap.add_argument("--out", default=None, help="the JSON's path (default benchmarks/results/)")
    ap.add_argument("--phase", choices=("cold", "warm"), default=None, help=argparse.SUPPRESS)
    ap.add_argument("--result", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    args.modes = [m for m in args.modes.split(",") if m]
    if args.phase:
        args.sweep = args.phase == "cold" and not args.no_sweep
        res = child(args)
        Path(args.result).write_text(json.dumps(res))
        return 0

    from ssd_jax.runtime.defaults import describe
    tmp = None
    if args.compile_cache is None:
        tmp = tempfile.TemporaryDirectory(prefix="ssd_jax_compile_cache_")
        args.compile_cache = tmp.name
    res = dict(target=args.target, draft=args.draft, cpu=describe(),
               date=time.strftime("%Y-%m-%d %H:%M:%S"), compile_cache=args.compile_cache,
               argv=sys.argv[1:], step_store=args.step_store)
    base = [sys.executable, __file__, "--target", args.target, "--draft", args.draft, "--dtype",
            args.dtype, "--draft-quant", args.draft_quant, "--backend", args.backend,
            "--placement", args.placement, "--modes", ",".join(args.modes), "--max-new-tokens",
            str(args.max_new_tokens), "--max-len", str(args.max_len), "--compile-cache",
            args.compile_cache] + (["--no-sweep"] if args.no_sweep else []) + (
                ["--step-store"] if args.step_store else [])
    for phase in ("cold",) if args.no_warm else ("cold", "warm"):
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            cmd = base + ["--phase", phase, "--result", f.name] + (
                ["--convert"] if args.convert and phase == "cold" else [])
            subprocess.run(cmd, check=True, env=dict(os.environ))
            res[phase] = json.loads(Path(f.name).read_text())
    if tmp is not None:
        tmp.cleanup()
    text = _table(res)
    res["table"] = text
    print(text)
    out = Path(args.out) if args.out else (Path(__file__).parent / "results" /
                                           f"compile_time-{time.strftime('%Y%m%d-%H%M%S')}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=1))
    print(f"wrote {out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
