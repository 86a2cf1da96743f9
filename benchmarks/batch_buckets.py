"""What a batch bucket's padding rows cost: B prompts run as `request.batch_bucket(B)` rows
(`Engine(batch_buckets=True)`) against exactly B rows, interleaved in one process on one engine;
tokens/s of each (compile excluded, the medians of --reps calls) and their ratio.

    python benchmarks/batch_buckets.py              # --model qwen2.5-coder-0.5b --rows 3 --mode ar

The model is loaded as the CLI loads it (`dtype="auto"`, the backend's default); the prompts are
short code openings; each setting's first call compiles and is not counted.
"""
from __future__ import annotations

import argparse
import statistics

PROMPTS = ["def fib(n):", "import numpy as np\n", "class Stack:", "SELECT name FROM",
           "fn main() {", "#include <stdio.h>\n", "async function load(", "public class Main {"]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen2.5-coder-0.5b", help="a default model name")
    ap.add_argument("--rows", type=int, default=3, help="prompts in the batch (1-8)")
    ap.add_argument("--mode", default="ar", choices=("ar",), help="plain decoding (no draft)")
    ap.add_argument("--tokens", type=int, default=48, help="new tokens per row")
    ap.add_argument("--reps", type=int, default=3, help="timed calls per setting")
    a = ap.parse_args(argv)
    if not 1 <= a.rows <= len(PROMPTS) or a.tokens < 1 or a.reps < 1:
        ap.error(f"--rows must be in [1, {len(PROMPTS)}], --tokens and --reps >= 1")

    from ssd_jax.models import registry
    from ssd_jax.models.load import load_model
    from ssd_jax.runtime.defaults import describe
    from ssd_jax.runtime.engine import Engine
    from ssd_jax.runtime.request import batch_bucket

    eng = Engine(load_model(str(registry.fetch(a.model, progress=False))),
                 compilation_cache=False)
    prompts, kw = PROMPTS[:a.rows], dict(mode=a.mode, max_new_tokens=a.tokens)
    speed = {True: [], False: []}
    for rep in range(a.reps + 1):
        for padded in (True, False):
            eng.batch_buckets = padded
            out = eng.generate(prompts, **kw)
            if rep:  # call 0 of each setting compiles
                speed[padded].append(out.metrics.tokens_per_s)
    med = {k: statistics.median(v) for k, v in speed.items()}
    print(f"{a.model}, {a.mode}, {a.rows} prompts, backend {eng.backend['target']}; {describe()}")
    print(f"padded to {batch_bucket(a.rows)} rows: {med[True]:.1f} tokens/s; exactly {a.rows} "
          f"rows: {med[False]:.1f} tokens/s; padded / exact {med[True] / med[False]:.3f}")


if __name__ == "__main__":
    main()
