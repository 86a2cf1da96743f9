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


CHUNKS = {"ar": "decode_chunk", "sd": "sd_chunk", "ssd": "ssd_chunk"}


def chunk_temporaries(engine, mode: str, prompts, **generate_kw) -> tuple[int, int]:
    """(temporary bytes, argument bytes) of the chunk `mode` runs (`CHUNKS`), compiled with the
    arguments `engine.generate(prompts, mode=mode, **generate_kw)` gave it on its first call.
    Raises if the call ran no such chunk (streaming, a draft on its own mesh, chunks off)."""
    import jax

    from ssd_jax.algorithm import round_steps

    def abstract(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    name = CHUNKS[mode]
    real, seen = getattr(round_steps, name), []

    def recorded(*args, **kw):
        seen.append((jax.tree.map(abstract, args), jax.tree.map(abstract, kw)))
        return real(*args, **kw)
    setattr(round_steps, name, recorded)
    try:
        engine.generate(prompts, mode=mode, **generate_kw)
    finally:
        setattr(round_steps, name, real)
    if not seen:
        raise RuntimeError(f"{mode}: the engine did not run round_steps.{name}")
    args, kw = seen[0]
    m = real.lower(*args, **kw).compile().memory_analysis()
    return m.temp_size_in_bytes, m.argument_size_in_bytes


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
