"""What a chunk of decode steps or rounds holds besides its inputs: the temporary memory of
`round_steps.decode_chunk` / `sd_chunk` / `ssd_chunk` as the engine compiles them for the default
pair, beside the size of each model's embedding table.

    python benchmarks/chunk_memory.py                  # the CLI's formats on this machine
    python benchmarks/chunk_memory.py --modes sd --tokens 8

A chunk whose temporaries reach the size of a weight rewrites that weight every dispatch (a
conversion or layout copy hoisted out of its loop). The CLI's pair and formats
(`defaults.choose`), `Engine(round_chunks=True)` on this process's default device, one prompt,
greedy, K = 4; each chunk's arguments are taken from the engine's own first call of it and the
program is compiled again with them for `memory_analysis()`. Prints one line per mode.
"""
from __future__ import annotations

import argparse
import time

# chunk_temporaries is imported from here by gpu_session.py
from ssd_jax.testing.chunk_memory import CHUNKS, chunk_temporaries


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="ar,sd,ssd", help="comma-separated, of ar, sd, ssd")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per call")
    a = ap.parse_args(argv)
    modes = a.modes.split(",")
    if not modes or any(m not in CHUNKS for m in modes) or a.tokens < 1:
        ap.error(f"--modes takes a comma-separated subset of {sorted(CHUNKS)}; --tokens >= 1")

    import ssd_jax
    from ssd_jax import Engine
    from ssd_jax.models import registry
    from ssd_jax.runtime.defaults import choose, describe

    fast = choose()
    print(describe(), fast, flush=True)
    target = ssd_jax.load_model(registry.DEFAULT_TARGET, fast["dtype"])
    draft = ssd_jax.load_draft(registry.DEFAULT_DRAFT, fast["dtype"], quant=fast["draft_quant"])
    eng = Engine(target, draft, round_chunks=True)
    prompt = [target.tokenizer.encode("def fibonacci(n):\n")]
    mib = 2 ** 20
    print("embedding tables:", ", ".join(f"{name} {m.params.embed.nbytes / mib:.0f} MiB "
                                          f"{m.params.embed.dtype}"
                                          for name, m in (("target", target), ("draft", draft))))

    for mode in modes:
        t = time.perf_counter()
        temp, arg = chunk_temporaries(eng, mode, prompt, max_new_tokens=a.tokens, k=4)
        print(f"{mode}: round_steps.{CHUNKS[mode]} temporaries {temp / mib:.1f} MiB "
              f"(arguments {arg / mib:.0f} MiB; call and compile {time.perf_counter() - t:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main()
