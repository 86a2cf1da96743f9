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
Only the public API is used (`Engine.generate`, `out.metrics.rounds`), so the script runs
unchanged on any engine with that API.

For each (mode, batch), after one identical warm-up call (its compiles excluded):
- Python calls per round: `sys.setprofile` counts 'call' events (Python functions, including
  generators resumed) and 'c_call' events (builtins / C functions called from Python) during one
  generate call, divided by its rounds (AR: a round is a token of a row).
- syncs per round: during another call, every jax.Array turned into numpy or a Python value or
  waited on: the concrete array class's `__array__ __int__ __float__ __complex__ __bool__
  __index__ item tolist tobytes block_until_ready` and `jax.block_until_ready`, `jax.device_get`
  are wrapped, each outermost call counting 1 (one inside another, e.g. device_get -> __array__,
  is not counted again). On CPU a jax.Array also exports the C buffer protocol, which numpy uses
  before `__array__`, silently (no Python runs); it is switched off for the counted call (its
  type slot nulled, restored after) so that every numpy conversion (np.asarray, np.array,
  np.where(x, ...), ...) reaches the wrapped `__array__`. A self-test checks that one
  np.asarray of a fresh jax.Array counts exactly 1 before anything is measured. `arrays` also
  counts the jax.Array leaves each outermost call fetched (a device_get of a tuple of 3 is one
  sync, 3 arrays). A conversion of an array whose value the host already holds counts too.
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
import ctypes
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

COLUMNS = ("mode", "batch", "rounds", "py calls/round", "c calls/round", "syncs/round",
           "ms/round", "host ms/round", "minimal step ms", "ratio", "host / minimal")


# ------------------------------------------------------------------------------------ the counters
def count_calls(fn):
    """(fn's result, Python 'call' events, 'c_call' events) while fn runs in this thread."""
    counts = {"call": 0, "c_call": 0}

    def prof(frame, event, arg):
        if event in counts:
            counts[event] += 1

    sys.setprofile(prof)
    try:
        out = fn()
    finally:
        sys.setprofile(None)
    # the setprofile(None) call itself is seen as one c_call
    return out, counts["call"], counts["c_call"] - 1


# Where a type object keeps its buffer-protocol table (PyTypeObject.tp_as_buffer): after
# ob_refcnt, ob_type, ob_size and 17 pointer-sized slots, in every CPython 3.x on 64 bits.
_TP_AS_BUFFER = 20 * ctypes.sizeof(ctypes.c_void_p)


@contextlib.contextmanager
def buffer_protocol_off(cls):
    """Switch off `cls`'s C buffer protocol (numpy then falls back to `__array__`)."""
    if platform.python_implementation() != "CPython":
        raise RuntimeError("the sync counter needs CPython (it switches a type slot off)")
    slot = ctypes.c_void_p.from_address(id(cls) + _TP_AS_BUFFER)
    before = slot.value
    slot.value = None
    try:
        yield
    finally:
        slot.value = before


class SyncCounter:
    """`with SyncCounter() as s:` counts device->host syncs (module docstring) in s.syncs, the
    jax.Array leaves they fetched in s.arrays and the syncs by entry point in s.by_kind."""

    METHODS = ("__array__", "__int__", "__float__", "__complex__", "__bool__", "__index__",
               "item", "tolist", "tobytes", "block_until_ready")

    def __init__(self):
        import jax
        import jax.numpy as jnp
        self.jax, self.cls = jax, type(jnp.zeros(1))
        self.syncs = self.arrays = 0
        self.wait_s = 0.0  # seconds inside outermost syncs
        self.by_kind: dict[str, int] = {}
        self._depth = 0

    def _wrap(self, name, fn, leaves):
        def counted(*a, **k):
            outer = self._depth == 0
            if outer:
                self.syncs += 1
                self.by_kind[name] = self.by_kind.get(name, 0) + 1
                self.arrays += leaves(a)
                t0 = time.perf_counter()
            self._depth += 1
            try:
                return fn(*a, **k)
            finally:
                self._depth -= 1
                if outer:
                    self.wait_s += time.perf_counter() - t0
        counted.__name__ = getattr(fn, "__name__", name)
        return counted

    def __enter__(self):
        jax, cls = self.jax, self.cls
        self._saved = [(cls, m, cls.__dict__[m]) for m in self.METHODS if m in cls.__dict__]
        self._saved += [(jax, f, getattr(jax, f)) for f in ("block_until_ready", "device_get")]
        tree_count = lambda a: sum(isinstance(x, jax.Array) for x in jax.tree_util.tree_leaves(a[0]))
        for owner, name, fn in self._saved:
            if owner is cls:
                # a nanobind method (block_until_ready) is a descriptor: call it through its
                # __get__ so the wrapper, a plain function, binds like it
                call = fn if not hasattr(fn, "__get__") or isinstance(fn, type(lambda: 0)) \
                    else (lambda fn: lambda self, *a, **k: fn.__get__(self, cls)(*a, **k))(fn)
                setattr(cls, name, self._wrap(f"Array.{name}", call, lambda a: 1))
            else:
                setattr(owner, name, self._wrap(f"jax.{name}", fn, tree_count))
        self._buffer = buffer_protocol_off(cls)
        self._buffer.__enter__()
        return self

    def __exit__(self, *exc):
        self._buffer.__exit__(*exc)
        for owner, name, fn in self._saved:
            setattr(owner, name, fn)
        return False


def self_test() -> dict:
    """Checks the sync counter on hand-made cases; returns what each counted. Raises if one
    np.asarray of a fresh jax.Array does not count exactly 1, or a method is left patched."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    cls = type(jnp.zeros(1))
    before = {m: cls.__dict__.get(m) for m in SyncCounter.METHODS}
    got = {}
    cases = {
        "np.asarray": lambda x, y: np.asarray(x),
        "np.array": lambda x, y: np.array(x),
        "np.where": lambda x, y: np.where(x > 1, 1, 0),  # x > 1 is a new jax.Array: one fetch
        "int(x[0])": lambda x, y: int(x[0]),
        "y.item()": lambda x, y: y.item(),
        "x.tolist()": lambda x, y: x.tolist(),
        "jax.device_get((x, y))": lambda x, y: jax.device_get((x, y)),
        "jax.block_until_ready(x)": lambda x, y: jax.block_until_ready(x),
        "x.block_until_ready()": lambda x, y: x.block_until_ready(),
        "none (x + 1, x.shape)": lambda x, y: (x + 1, x.shape),
    }
    want = {"np.asarray": 1, "np.array": 1, "np.where": 1, "int(x[0])": 1, "y.item()": 1,
            "x.tolist()": 1, "jax.device_get((x, y))": 1, "jax.block_until_ready(x)": 1,
            "x.block_until_ready()": 1, "none (x + 1, x.shape)": 0}
    for name, case in cases.items():
        x, y = jnp.arange(4) + 1, jnp.float32(2.5) * 2  # fresh arrays: no value on the host yet
        jax.block_until_ready((x, y))
        with SyncCounter() as s:
            case(x, y)
        got[name] = s.syncs
    if got != want:
        raise AssertionError(f"sync counter self-test: counted {got}, expected {want}")
    if {m: cls.__dict__.get(m) for m in SyncCounter.METHODS} != before:
        raise AssertionError("sync counter self-test: a method of the array class stayed patched")
    memoryview(jnp.arange(2) + 1)  # the buffer protocol is back
    return got


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
def rounds_of(out, mode: str) -> int:
    """Rounds of a call: metrics.rounds; for AR the tokens of the longest row where it is 0."""
    r = int(out.metrics.rounds)
    if mode == "ar" and r == 0:
        r = max(len(t) for t in out.token_ids)
    return r


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

    warm = gen()  # compiles
    out, py, c = count_calls(gen)
    rounds = rounds_of(out, mode)
    with SyncCounter() as s:
        out2 = gen()
    same = out2.token_ids == warm.token_ids == out.token_ids and rounds_of(out2, mode) == rounds
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
    return {"mode": mode, "batch": b, "rounds": rounds, "tokens": tokens,
            "tokens_per_round_per_row": round(tokens / b / rounds, 3),
            "hit_rate": _hit_rate(out),
            "py_calls": py, "c_calls": c, "py_calls_per_round": round(py / rounds, 1),
            "c_calls_per_round": round(c / rounds, 1), "syncs": s.syncs,
            # over the counted call's own rounds: backup="auto" follows measured walls, so its
            # calls may run different rounds
            "syncs_per_round": round(s.syncs / rounds_of(out2, mode), 2), "arrays_fetched": s.arrays,
            "syncs_by_kind": dict(sorted(s.by_kind.items())),
            "ms_per_round": ms and round(ms, 3), "minimal_step_ms": step_ms and round(step_ms, 3),
            "ratio": ms and round(ms / step_ms, 2),
            "host_ms_per_round": host_ms and round(host_ms, 3),
            "host_ratio": host_ms and round(host_ms / step_ms, 2),
            "host_ms_per_round_all": [round(x * 1e3, 3) for x in host],
            "ms_per_round_all": [round(x * 1e3, 3) for x in per_round],
            "minimal_step_ms_all": [round(x * 1e3, 3) for x in minimal],
            "minimal_fast_path": loop and loop.fast_path, "same_tokens_every_call": bool(same)}


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
