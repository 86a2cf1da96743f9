"""n samples of one prompt on the default pair: the prefill shared (the engine's default for a
batch that is one prompt repeated) against prefilling every row, interleaved in one process;
the prefill's seconds side by side, their ratio, and whether the ids agree.

    python benchmarks/shared_prefill.py              # --rows 8 --reps 2 --mode sd --tokens 8

The CLI's formats (`defaults.choose`); the prompt is the first 1,200 characters of
ssd_jax/runtime/request.py (~290 tokens), T = 0.8, K = 4. The off setting patches
`request.one_prompt`, the rule both sides' `request.prefill_once` reads, to False. Call 0 of each
setting compiles (its prefill time includes the compile); the medians are of the rest.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=8, help="samples of the prompt (the batch)")
    ap.add_argument("--reps", type=int, default=2, help="calls per setting after the compiling one")
    ap.add_argument("--mode", default="sd", choices=("ar", "sd", "ssd"))
    ap.add_argument("--tokens", type=int, default=8, help="new tokens per row")
    a = ap.parse_args(argv)
    if a.rows < 2 or a.reps < 1 or a.tokens < 1:
        ap.error("--rows must be >= 2, --reps and --tokens >= 1")

    import ssd_jax
    from ssd_jax.models import registry
    from ssd_jax.runtime import request
    from ssd_jax.runtime.defaults import choose, describe

    one_prompt = request.one_prompt
    fast = choose()
    print(describe(), fast, flush=True)
    target = ssd_jax.load_model(registry.DEFAULT_TARGET, fast["dtype"])
    draft = ssd_jax.load_draft(registry.DEFAULT_DRAFT, fast["dtype"], quant=fast["draft_quant"])
    eng = ssd_jax.Engine(target, draft)
    with open(os.path.join(ROOT, "ssd_jax", "runtime", "request.py"), encoding="utf-8") as f:
        prompt = f.read()[:1200]
    print(f"{a.rows} rows of one {len(target.tokenizer.encode(prompt))}-token prompt, "
          f"mode {a.mode}, {a.tokens} new tokens; backend {eng.backend}", flush=True)
    call = dict(mode=a.mode, max_new_tokens=a.tokens, k=4,
                sampling=ssd_jax.SamplingParams(temperature=0.8), seed=1)
    prefill, ids = {True: [], False: []}, {}
    try:
        for rep in range(1 + a.reps):
            for shared in (True, False):
                request.one_prompt = one_prompt if shared else (lambda *args: False)
                t0 = time.perf_counter()
                out = eng.generate([prompt] * a.rows, **call)
                wall = time.perf_counter() - t0
                if rep > 0:
                    prefill[shared].append(out.metrics.prefill_s)
                ids.setdefault(shared, out.token_ids)
                print(f"{'shared' if shared else 'each row'} call {rep}: prefill "
                      f"{out.metrics.prefill_s:.2f} s, compile {out.metrics.compile_s:.2f} s, "
                      f"wall {wall:.2f} s", flush=True)
    finally:
        request.one_prompt = one_prompt
    each, once = statistics.median(prefill[False]), statistics.median(prefill[True])
    print(f"prefill median: every row {each:.2f} s, shared {once:.2f} s: {each / once:.1f}x; "
          f"same ids: {ids[True] == ids[False]}")


if __name__ == "__main__":
    main()
