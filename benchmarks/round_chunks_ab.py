"""The default pair on this machine, rounds one by one against chunks of rounds, interleaved in
one process (`Engine.round_chunks` False / True): per-call walls and whether the ids agree.

    python benchmarks/round_chunks_ab.py ssd      # or sd; --reps 4 --tokens 64

The CLI's formats (`defaults.choose`), one prompt, greedy, K = 4; call 0 of each setting compiles
and is left out of the medians.
"""
from __future__ import annotations

import argparse
import statistics
import time


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", nargs="?", default="ssd", choices=("sd", "ssd"))
    ap.add_argument("--reps", type=int, default=4, help="calls per setting, the first compiles")
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per call")
    a = ap.parse_args(argv)
    if a.reps < 2 or a.tokens < 1:
        ap.error("--reps must be >= 2 (the first call compiles) and --tokens >= 1")

    import ssd_jax
    from ssd_jax import Engine
    from ssd_jax.models import registry
    from ssd_jax.runtime.defaults import choose, describe

    fast = choose()
    print(describe(), fast, flush=True)
    target = ssd_jax.load_model(registry.DEFAULT_TARGET, fast["dtype"])
    draft = ssd_jax.load_draft(registry.DEFAULT_DRAFT, fast["dtype"], quant=fast["draft_quant"])
    eng = Engine(target, draft)
    prompt = [target.tokenizer.encode("def fibonacci(n):\n")]
    walls, ids = {False: [], True: []}, {}
    for rep in range(a.reps):
        for on in (False, True):
            eng.round_chunks = on
            t = time.perf_counter()
            out = eng.generate(prompt, mode=a.mode, max_new_tokens=a.tokens, k=4)
            dt = time.perf_counter() - t
            if rep > 0:
                walls[on].append(dt)
            ids.setdefault(on, out.token_ids)
            print(a.mode, "chunks" if on else "rounds", rep, f"{dt:.2f}s", out.metrics.rounds,
                  flush=True)
    print("same ids:", ids[True] == ids[False])
    for on in (False, True):
        print(a.mode, "chunks" if on else "rounds", "median",
              f"{statistics.median(walls[on]):.2f}s", [f"{x:.2f}" for x in walls[on]])


if __name__ == "__main__":
    main()
