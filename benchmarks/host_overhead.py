"""The engine's own host work per round (issue #32): Python calls, device->host syncs and wall
time per round of AR / SD / SSD on tiny random models, whose compute is next to nothing.

    python benchmarks/host_overhead.py                          # b = 1, 16, 64; K = 4; 96 tokens
    python benchmarks/host_overhead.py --batch 1 --tokens 24 --cprofile ssd@1
    python benchmarks/host_overhead.py --modes ssd --backup auto --cprofile ''      # backup="auto"
    python benchmarks/host_overhead.py --placement tp2-dp2 --modes sd,ssd --cprofile ''  # 2 devices

Models: a random qwen2-shaped target (vocab 256, 2 layers, hidden 64) and a draft that is the
target's weights perturbed (`--perturb`), both built deterministically.
`Engine(target, draft, placement="colocated", backend="xla", compilation_cache=False)`, greedy;
`--placement tp2-dp2`: a 2-way tensor-parallel target and a 2-way data-parallel draft on two CPU
devices (`make_placement("colocated", target_devices=2, draft_devices=2)`).
The engine is driven through its public API only (`Engine.generate`, `out.metrics.rounds`); the
counters come from the checkout's own `ssd_jax.testing.host_work` (to compare a commit older than
that module, run that commit's own copy of this script).

For each (mode, batch), after one identical warm-up call (its compiles excluded), the counters of
`ssd_jax.testing.host_work` (`call_work`; its docstring says what each counts, and its
`self_test` runs before anything is measured):
- Python calls per round: the 'call' and 'c_call' events of one generate call, divided by its
  rounds (AR: a round is a token of a row).
- syncs per round: during another call, every jax.Array turned into numpy or a Python value or
  waited on, each outermost conversion counting 1; `arrays` the jax.Array leaves they fetched.
- ms per round: the call's wall time / rounds (the prefill included), against a minimal loop's
  step: one jitted decode step of the same target (`forward` on a [B, 1] token and the KV cache,
  greedy argmax, the cache donated, traced without the cache's debug-check effect where the
  library offers that, so it takes jit's C++ fast path) plus one np.asarray fetch of the token,
  in a Python loop of `--tokens` steps. The two are timed alternately `--repeats` times in one
  run; medians and their ratio are reported. The counts are deterministic, the times are noisy.
- host ms per round: the timed calls run inside the sync counter, which also clocks each
  outermost sync; wall minus that waiting, / rounds, is what the host itself spends on a round
  (Python, dispatch, transfers set up; the counter's own wrapper is in it, a few microseconds a
  sync). On a CPU the device's compute fills most of the rest; on a GPU the waiting becomes the
  verify's and the tree's device time, and the host ms is what a round adds to them unless it
  overlaps. "host / minimal" compares it with the minimal loop's whole step.

Prints the table and writes the JSON (+ .md) to --out (default
benchmarks/results/host_overhead.json) with the CPU, jax version and git commit.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from ssd_jax.testing.host_work import (  # noqa: E402 - after the path above
    SyncCounter, call_work, rounds_of, self_test)

COLUMNS = ("mode", "batch", "rounds", "py calls/round", "c calls/round", "syncs/round",
           "ms/round", "host ms/round", "minimal step ms", "ratio", "host / minimal")


# ---------------------------------------------------------------------------------- the models
def build_pair(vocab: int, layers: int, rel: float):
    """(target, draft) `Model`s: random tiny transformers, the draft the target perturbed."""
    import jax
    from ssd_jax.models.config import tiny_config
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import perturb, random_params
    cfg = tiny_config("qwen2", vocab_size=vocab, num_layers=layers)
    target = Model(cfg, random_params(cfg, 0))
    return target, Model(cfg, perturb(target.params, jax.random.key(1), rel))


def make_prompts(b: int, length: int, vocab: int) -> list[list[int]]:
    import numpy as np
    rng = np.random.default_rng(0)
    return [[int(t) for t in rng.integers(0, vocab, length)] for _ in range(b)]


class MinimalLoop:
    """One jitted greedy decode step of `target` plus one np.asarray fetch per token."""

    def __init__(self, target, b: int, prompt_len: int, tokens: int):
        import jax
        import jax.numpy as jnp
        from ssd_jax.models import kv_cache
        from ssd_jax.models.transformer import forward
        cfg = target.cfg
        self.b, self.prompt_len, self.tokens = b, prompt_len, tokens
        self.cache_len = max(256, -(-(prompt_len + tokens + 8) // 256) * 256)
        self.params = jax.device_put(target.params)
        self.init = lambda: kv_cache.init_cache(cfg, b, self.cache_len).with_lengths(
            jnp.full((b,), prompt_len, jnp.int32))

        def step(params, tok, cache):
            logits, cache = forward(params, cfg, tok[:, None], cache)
            return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

        self.step = jax.jit(step, donate_argnums=2)
        off = getattr(kv_cache, "traced_checks_off", None)
        self.fast_path = off is not None
        with (off() if off else contextlib.nullcontext()):
            self.run()  # the trace and compile
        self.run()  # and one warm loop

    def run(self) -> float:
        """Seconds per step of one loop of `tokens` steps."""
        import jax
        import jax.numpy as jnp
        import numpy as np
        cache, tok = self.init(), jnp.zeros((self.b,), jnp.int32)
        jax.block_until_ready((cache, tok))
        t0 = time.perf_counter()
        for _ in range(self.tokens):
            tok, cache = self.step(self.params, tok, cache)
            np.asarray(tok)
        return (time.perf_counter() - t0) / self.tokens


# ------------------------------------------------------------------------------------- measuring
def _hit_rate(out):
    """SSD's speculation-cache hit rate where the metrics report one (else None)."""
    h = getattr(out.metrics, "hit_rate", None)
    return None if h is None or h != h else round(float(h), 3)  # NaN: no lookups (AR, SD)


def measure(engine, target, mode: str, b: int, a) -> dict:
    """One table row (module docstring) for `mode` at batch `b`."""
    prompts = make_prompts(b, a.prompt_len, a.vocab)

    kw = {}
    if mode == "ssd" and getattr(a, "backup", "neural") != "neural":
        from ssd_jax.runtime.engine import SSDConfig
        kw = dict(ssd=SSDConfig(backup=a.backup))

    def gen():
        return engine.generate(prompts, mode=mode, max_new_tokens=a.tokens, k=a.k, **kw)

    work = call_work(gen, mode)
    out = work.pop("out")
    loop = MinimalLoop(target, b, a.prompt_len, a.tokens) if a.repeats > 0 else None
    per_round, host, minimal = [], [], []
    for i in range(a.repeats):  # alternated, so both see the same load
        order = ("engine", "loop") if i % 2 == 0 else ("loop", "engine")
        for which in order:
            if which == "loop":
                minimal.append(loop.run())
            else:
                with SyncCounter() as timed:
                    t0 = time.perf_counter()
                    o = gen()
                    wall = time.perf_counter() - t0
                per_round.append(wall / rounds_of(o, mode))
                host.append((wall - timed.wait_s) / rounds_of(o, mode))
    ms = statistics.median(per_round) * 1e3 if per_round else None  # --repeats 0: counts only
    host_ms = statistics.median(host) * 1e3 if host else None
    step_ms = statistics.median(minimal) * 1e3 if minimal else None
    tokens = sum(len(t) for t in out.token_ids)
    return {"mode": mode, "batch": b, "tokens": tokens,
            "tokens_per_round_per_row": round(tokens / b / work["rounds"], 3),
            "hit_rate": _hit_rate(out), **work,
            "ms_per_round": ms and round(ms, 3), "minimal_step_ms": step_ms and round(step_ms, 3),
            "ratio": ms and round(ms / step_ms, 2),
            "host_ms_per_round": host_ms and round(host_ms, 3),
            "host_ratio": host_ms and round(host_ms / step_ms, 2),
            "host_ms_per_round_all": [round(x * 1e3, 3) for x in host],
            "ms_per_round_all": [round(x * 1e3, 3) for x in per_round],
            "minimal_step_ms_all": [round(x * 1e3, 3) for x in minimal],
            "minimal_fast_path": loop and loop.fast_path}


def _repo_frame(frame):
    """The innermost frame of this repository's library code (ssd_jax/, models/) at or above
    `frame`, or None."""
    while frame is not None:
        f = frame.f_code.co_filename
        if f.startswith(LIBRARY):
            return frame
        frame = frame.f_back
    return None


LIBRARY_DIRS = ("ssd_jax", "models")
LIBRARY = tuple(str(ROOT / d) + os.sep for d in LIBRARY_DIRS)


def profile_rounds(engine, mode: str, b: int, a, top: int) -> tuple[dict, str]:
    """Where one warm call's Python calls come from, per round: (1) the Python functions called
    most (cProfile, built-ins left out), (2) the calls grouped by file, (3) each call charged to
    the innermost library function (ssd_jax/, models/) on the stack, i.e. that function's own
    calls and all the jax / numpy work it triggers. Returns (the JSON, the text)."""
    import cProfile
    import pstats
    prompts = make_prompts(b, a.prompt_len, a.vocab)
    gen = lambda: engine.generate(prompts, mode=mode, max_new_tokens=a.tokens, k=a.k)
    gen()
    prof = cProfile.Profile()
    out = prof.runcall(gen)
    rounds = rounds_of(out, mode)
    funcs, files = [], {}
    for (file, line, fn), (cc, nc, tt, ct, _) in pstats.Stats(prof).stats.items():
        if file == "~":  # a built-in
            continue
        short = _short(file)
        funcs.append(dict(function=f"{fn} ({short}:{line})", calls_per_round=round(nc / rounds, 2),
                          own_ms_per_round=round(tt * 1e3 / rounds, 4)))
        files[short] = files.get(short, 0) + nc
    funcs.sort(key=lambda r: -r["calls_per_round"])
    by_file = sorted(({"file": f, "calls_per_round": round(n / rounds, 1)} for f, n in files.items()),
                     key=lambda r: -r["calls_per_round"])
    charged: dict[str, int] = {}

    def prof_fn(frame, event, arg):
        if event == "call":
            f = _repo_frame(frame)
            if f is None:
                key = "(outside the library)"
            else:
                key = f"{f.f_code.co_name} ({_short(f.f_code.co_filename)}:{f.f_code.co_firstlineno})"
                step = f.f_locals.get("self") if f.f_code.co_name == "__call__" else None
                if getattr(step, "__name__", None):  # a jitted step's wrapper: name the step
                    key = f"step {step.__name__}: " + key
            charged[key] = charged.get(key, 0) + 1

    sys.setprofile(prof_fn)
    try:
        gen()
    finally:
        sys.setprofile(None)
    by_source = sorted(({"source": k, "calls_per_round": round(n / rounds, 1)}
                        for k, n in charged.items()), key=lambda r: -r["calls_per_round"])
    res = dict(mode=mode, batch=b, rounds=rounds, functions=funcs[:top], files=by_file[:top],
               sources=by_source[:top])
    t = [f"Where one {mode.upper()} call's Python calls come from, b={b}, {rounds} rounds, "
         "per round:", "",
         "| calls charged to the innermost library function on the stack | per round |", "|---|---:|"]
    t += [f"| {r['source']} | {r['calls_per_round']:,.1f} |" for r in by_source[:top]]
    t += ["", "| calls by file | per round |", "|---|---:|"]
    t += [f"| {r['file']} | {r['calls_per_round']:,.1f} |" for r in by_file[:min(top, 15)]]
    t += ["", "| Python function (cProfile) | calls/round | own ms/round |", "|---|---:|---:|"]
    t += [f"| {r['function']} | {r['calls_per_round']:,.1f} | {r['own_ms_per_round']:.3f} |"
          for r in funcs[:top]]
    return res, "\n".join(t)


def _short(file: str) -> str:
    """A file's path from its package root (jax/_src/pjit.py, ssd_jax/runtime/engine.py)."""
    p = Path(file)
    for anchor in ("site-packages", "dist-packages"):
        if anchor in p.parts:
            return "/".join(p.parts[p.parts.index(anchor) + 1:])
    try:
        return str(p.relative_to(ROOT))
    except ValueError:
        return file


# ---------------------------------------------------------------------------------- the report
def _num(x, fmt):
    return "-" if x is None else format(x, fmt)


def table(rows: list[dict]) -> str:
    out = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" if c == "mode" else "---:"
                                                           for c in COLUMNS) + "|"]
    for r in rows:
        out.append(f"| {r['mode'].upper()} | {r['batch']} | {r['rounds']} | "
                   f"{r['py_calls_per_round']:,.0f} | {r['c_calls_per_round']:,.0f} | "
                   f"{r['syncs_per_round']:.2f} | {_num(r['ms_per_round'], '.2f')} | "
                   f"{_num(r.get('host_ms_per_round'), '.2f')} | "
                   f"{_num(r['minimal_step_ms'], '.3f')} | {_num(r['ratio'], '.1f')}x | "
                   f"{_num(r.get('host_ratio'), '.1f')}x |")
    return "\n".join(out)


def cpu_info(cpuinfo: str | None = None) -> dict:
    """The CPU's model name and the flags avx2 / avx512f / avx512_bf16 / avx512_vnni / amx
    (any amx_* flag) from /proc/cpuinfo (all False where it cannot be read)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            cpuinfo = ""
    model, flags = None, set()
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "model name" and model is None:
            model = value.strip()
        elif key.strip() == "flags" and not flags:
            flags = set(value.split())
    return {"model": model or platform.processor() or None, "cores": os.cpu_count(),
            **{f: f in flags for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni")},
            "amx": any(f.startswith("amx") for f in flags)}


def cpu_line(c: dict) -> str:
    flags = [f for f in ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx") if c.get(f)]
    return f"{c['model']}, {c['cores']} cores visible, flags: {' '.join(flags) or 'none of those read'}"


def git_commit(*paths: str) -> str:
    """The checkout's commit (with `paths`: the last commit that changed them), "+dirty" where
    they have uncommitted changes, "unknown" outside git."""
    try:
        git = lambda *a: subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True,
                                        check=True).stdout.strip()
        head = git("log", "-1", "--format=%H", "--", *paths) if paths else git("rev-parse", "HEAD")
        dirty = git("status", "--porcelain", "--untracked-files=no", "--", *paths)
        return head + ("+dirty" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--modes", default="ar,sd,ssd")
    ap.add_argument("--round-chunks", action="store_true",
                    help="Engine(round_chunks=True): SD and SSD in chunks of rounds (a CPU's "
                         "default is off)")
    ap.add_argument("--batch", default="1,16,64", help="batch sizes, comma-separated")
    ap.add_argument("--placement", default="colocated", choices=("colocated", "tp2-dp2"),
                    help="tp2-dp2: a 2-way TP target and a 2-way DP draft on two CPU devices")
    ap.add_argument("--backup", default="neural", choices=("neural", "random", "ngram", "auto"),
                    help="SSD's backup (greedy: the tokens do not depend on it)")
    ap.add_argument("--tokens", type=int, default=96, help="new tokens per row")
    ap.add_argument("--k", type=int, default=4, help="lookahead K")
    ap.add_argument("--vocab", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--perturb", type=float, default=0.1,
                    help="the draft's relative perturbation (0.1: SD makes ~3 tokens a round)")
    ap.add_argument("--prompt-len", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=5,
                    help="timed calls (and minimal loops); 0: the counts only")
    ap.add_argument("--cprofile", default="ssd@16", help="mode@batch to cProfile ('' for none)")
    ap.add_argument("--top", type=int, default=25, help="rows of each profile breakdown")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host_overhead.json"),
                    help="the JSON's path ('' writes nothing); the .md goes beside it")
    a = ap.parse_args(argv)

    import jax
    if a.placement == "tp2-dp2":
        jax.config.update("jax_num_cpu_devices", 2)
    from ssd_jax.runtime.engine import Engine
    from ssd_jax.runtime.placement import make_placement

    checks = self_test()
    target, draft = build_pair(a.vocab, a.layers, a.perturb)
    placement = (make_placement("colocated", target_devices=2, draft_devices=2)
                 if a.placement == "tp2-dp2" else "colocated")
    # round_chunks only when asked: without it the script still runs an older engine (A/B
    # worktrees)
    engine = Engine(target, draft, placement=placement, backend="xla", compilation_cache=False,
                    **({"round_chunks": True} if a.round_chunks else {}))
    rows = []
    for b in (int(x) for x in a.batch.split(",")):
        for mode in a.modes.split(","):
            r = measure(engine, target, mode, b, a)
            rows.append(r)
            print(f"{mode}@{b}: {r['rounds']} rounds, {r['py_calls_per_round']:,.0f} py calls, "
                  f"{r['syncs_per_round']:.2f} syncs {r['syncs_by_kind']}, "
                  f"{_num(r['ms_per_round'], '.2f')} ms / round "
                  f"(host {_num(r.get('host_ms_per_round'), '.2f')}) vs "
                  f"{_num(r['minimal_step_ms'], '.3f')} ms",
                  file=sys.stderr, flush=True)
    cpu = cpu_info()
    text = (f"K = {a.k}, {a.tokens} new tokens, tiny random models (vocab {a.vocab}, {a.layers} "
            f"layers), greedy, {a.placement}, xla. AR: a round is a token.\n\n{table(rows)}\n\n"
            f"CPU: {cpu_line(cpu)}; jax {jax.__version__}; commit {git_commit()} (library: "
            f"{git_commit(*LIBRARY_DIRS)})")
    profile = None
    if a.cprofile:
        mode, _, b = a.cprofile.partition("@")
        profile, ptext = profile_rounds(engine, mode, int(b or 1), a, a.top)
        text += "\n\n" + ptext
    print(text)
    if a.out:
        from _results import write_results
        payload = dict(cpu=cpu, jax=jax.__version__, commit=git_commit(),
                       library_commit=git_commit(*LIBRARY_DIRS),
                       settings=dict(k=a.k, tokens=a.tokens, vocab=a.vocab, layers=a.layers,
                                     perturb=a.perturb, prompt_len=a.prompt_len,
                                     placement=a.placement, repeats=a.repeats),
                       self_test=checks, rows=rows, profile=profile)
        write_results("host_overhead", os.path.dirname(a.out) or ".", payload, text,
                      stem=os.path.splitext(a.out)[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
