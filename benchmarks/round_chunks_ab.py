"""The default pair on this machine, rounds one by one against chunks of rounds, interleaved in
one process (`Engine.round_chunks` False / True): per-call walls and whether the ids agree.

    python benchmarks/round_chunks_ab.py ssd      # or sd

The CLI's formats (`defaults.choose`), one prompt, 64 new tokens, K = 4, greedy; call 0 of each
compiles and is left out of the medians.
"""
import time, statistics, sys
import ssd_jax
from ssd_jax import Engine
from ssd_jax.runtime.defaults import choose, describe
from ssd_jax.models import registry
fast = choose()
print(describe(), fast, flush=True)
target = ssd_jax.load_model(registry.DEFAULT_TARGET, fast["dtype"])
draft = ssd_jax.load_draft(registry.DEFAULT_DRAFT, fast["dtype"], quant=fast["draft_quant"])
eng = Engine(target, draft)
prompt = [target.tokenizer.encode("def fibonacci(n):\n")]
mode = sys.argv[1] if len(sys.argv) > 1 else "ssd"
res = {True: [], False: []}; ids = {}
for rep in range(4):
    for on in (False, True):
        eng.round_chunks = on
        t = time.perf_counter()
        out = eng.generate(prompt, mode=mode, max_new_tokens=64, k=4)
        dt = time.perf_counter() - t
        if rep > 0: res[on].append(dt)
        ids.setdefault(on, out.token_ids)
        print(mode, "chunks" if on else "rounds", rep, f"{dt:.2f}s", out.metrics.rounds, flush=True)
print("same ids:", ids[True] == ids[False])
for on in (False, True):
    print(mode, "chunks" if on else "rounds", "median", f"{statistics.median(res[on]):.2f}s", [f"{x:.2f}" for x in res[on]])
