"""Where a statistical test case's time goes: one chunk of tests/_engine_stats.py's engine run,
each jitted step timed alone.

    python benchmarks/stat_case_time.py                       # SSD, random backup, 25,000 rows
    python benchmarks/stat_case_time.py --case saguaro --rows 2500 --mode ssd --steady 5

The case's own pair (V = 4, hidden 32, a 2-layer target, its 1-layer draft), its
Engine(max_len=16, compilation_cache=False), K = 2, 8 new tokens, T = 1, fresh request ids each
call. Every jitted step the device loop calls (`steps.*`, `round_steps.*`, the draft's tree) is
wrapped to wait for its result, so each one's seconds are its own device time plus its
dispatch; the wall of the call is printed beside their sum. The first call compiles (its wall is
the case's compile share); the next `--steady` calls (3) are the steady state a chunk costs,
printed as their medians. Waiting after each step serialises the verify and the tree, so the
wall is that of a run without overlap: the shares, not the wall, are the result.
"""
from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests"))

CASES = ("random", "saguaro", "neural")


def ssd_config(case: str):
    from ssd_jax.runtime.engine import SSDConfig
    return {"random": SSDConfig(fanout=(2, 1, 1), backup="random"),
            "saguaro": SSDConfig(fanout=(2, 2, 1), saguaro_c=0.5),
            "neural": SSDConfig(fanout=(2, 2, 1))}[case]


class StepClock:
    """`with StepClock() as c:` times each wrapped step (seconds and calls by name)."""

    def __init__(self):
        import jax
        from ssd_jax.algorithm import round_steps, steps
        from ssd_jax.runtime import draft_worker
        self.jax = jax
        names = [(steps, n) for n in ("prefill", "prefill_cache", "prefill_shared",
                                        "prefill_cache_shared", "decode", "verify", "draft_chain")]
        names += [(round_steps, n) for n in ("commit_tokens", "commit_verify", "commit_verify_kept",
                                             "resolve", "round_view", "unpack", "pass_report")]
        names += [(draft_worker, "draft_tree")]
        self.targets = [(m, n) for m, n in names if hasattr(m, n)]
        self.seconds = collections.defaultdict(float)
        self.calls = collections.Counter()

    def _wrap(self, name, fn):
        def timed(*a, **k):
            leaves = self.jax.tree_util.tree_leaves((a, k))
            if any(isinstance(x, self.jax.core.Tracer) for x in leaves):
                return fn(*a, **k)  # traced into another step (resolve's backup chain)
            t0 = time.perf_counter()
            out = fn(*a, **k)
            self.jax.block_until_ready(out)
            self.seconds[name] += time.perf_counter() - t0
            self.calls[name] += 1
            return out
        return timed

    def __enter__(self):
        self._saved = [(m, n, getattr(m, n)) for m, n in self.targets]
        for m, n, fn in self._saved:
            setattr(m, n, self._wrap(n, fn))
        return self

    def __exit__(self, *exc):
        for m, n, fn in self._saved:
            setattr(m, n, fn)
        return False


def run(case: str, mode: str, rows: int, calls: int = 2) -> list[dict]:
    """One dict per call: wall seconds, rounds, and each step's seconds and calls."""
    from _engine_stats import K, MAX_LEN, PROMPT, T10, make_pair
    from ssd_jax.runtime.engine import Engine
    eng = Engine(*make_pair(), max_len=MAX_LEN, compilation_cache=False)
    kw = dict(ssd=ssd_config(case)) if mode == "ssd" else {}
    out = []
    for i in range(calls):
        with StepClock() as clock:
            t0 = time.perf_counter()
            res = eng.generate([list(PROMPT)] * rows, mode=mode, max_new_tokens=8, k=K,
                               sampling=T10, request_ids=range(i * rows, (i + 1) * rows), seed=11,
                               **kw)
            wall = time.perf_counter() - t0
        out.append(dict(call=i, wall_s=round(wall, 3), rounds=int(res.metrics.rounds),
                        steps={n: dict(s=round(s, 3), calls=clock.calls[n])
                               for n, s in sorted(clock.seconds.items(), key=lambda x: -x[1])}))
    return out


def steady_medians(calls: list[dict]) -> dict:
    """The steady calls' median wall and each step's median seconds (one call's wall moves from
    run to run on a shared machine: benchmarks/README.md)."""
    names = {n for r in calls for n in r["steps"]}
    return dict(n=len(calls), walls=[r["wall_s"] for r in calls],
                wall_s=statistics.median(r["wall_s"] for r in calls),
                steps={n: statistics.median(r["steps"].get(n, {"s": 0.0})["s"] for r in calls)
                       for n in names})


def _print_steps(head: str, steps: dict[str, float]) -> None:
    total = sum(steps.values())
    print(f"{head}, steps {total:.2f} s")
    for n, sec in sorted(steps.items(), key=lambda x: -x[1]):
        print(f"  {n:20s} {sec:8.3f} s  {100 * sec / max(total, 1e-9):5.1f}%")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="random", choices=CASES)
    ap.add_argument("--mode", default="ssd", choices=("sd", "ssd"))
    ap.add_argument("--rows", type=int, default=25_000, help="requests in the chunk")
    ap.add_argument("--steady", type=int, default=3, help="steady calls after the first (>= 1)")
    a = ap.parse_args(argv)
    if a.rows < 1 or a.steady < 1:
        ap.error("--rows and --steady must be >= 1")
    first, *steady = run(a.case, a.mode, a.rows, calls=1 + a.steady)
    _print_steps(f"call 0 (compiles): wall {first['wall_s']:.2f} s, {first['rounds']} rounds",
                 {n: v["s"] for n, v in first["steps"].items()})
    m = steady_medians(steady)
    _print_steps(f"steady, median of {m['n']} calls: wall {m['wall_s']:.2f} s (calls: "
                 f"{', '.join(f'{w:.2f}' for w in m['walls'])}), {steady[0]['rounds']} rounds",
                 m["steps"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
