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


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--modes", default="ar,sd,ssd", help="comma-separated, of ar, sd, ssd")
    ap.add_argument("--tokens", type=int, default=16, help="new tokens per call")
    a = ap.parse_args(argv)
    chunks = {"ar": "decode_chunk", "sd": "sd_chunk", "ssd": "ssd_chunk"}
    modes = a.modes.split(",")
    if not modes or any(m not in chunks for m in modes) or a.tokens < 1:
        ap.error(f"--modes takes a comma-separated subset of {sorted(chunks)}; --tokens >= 1")

    import jax

    import ssd_jax
    from ssd_jax import Engine
    from ssd_jax.algorithm import round_steps
    from ssd_jax.models import registry
    from ssd_jax.runtime.defaults import choose, describe

    fast = choose()
    print(describe(), fast, flush=True)
    target = ssd_jax.load_model(registry.DEFAULT_TARGET, fast["dtype"])
    draft = ssd_jax.load_draft(registry.DEFAULT_DRAFT, fast["dtype"], quant=fast["draft_quant"])
    eng = Engine(target, draft, round_chunks=True)
    prompt = [target.tokenizer.encode("def fibonacci(n):\n")]
    mib = 2 ** 20
    tables = {"target": target.params.embed.nbytes, "draft": draft.params.embed.nbytes}
    print("embedding tables:", ", ".join(f"{k} {v / mib:.0f} MiB {getattr(m.params.embed, 'dtype')}"
                                          for (k, v), m in zip(tables.items(), (target, draft))))

    def abstract(x):
        if isinstance(x, jax.Array):
            return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
        return x

    for mode in modes:
        name = chunks[mode]
        real, seen = getattr(round_steps, name), []

        def recorded(*args, _real=real, **kw):
            seen.append((jax.tree.map(abstract, args), jax.tree.map(abstract, kw)))
            return _real(*args, **kw)
        setattr(round_steps, name, recorded)
        try:
            t = time.perf_counter()
            eng.generate(prompt, mode=mode, max_new_tokens=a.tokens, k=4)
            wall = time.perf_counter() - t
        finally:
            setattr(round_steps, name, real)
        if not seen:
            raise SystemExit(f"{mode}: the engine did not run round_steps.{name}")
        args, kw = seen[0]
        m = real.lower(*args, **kw).compile().memory_analysis()
        print(f"{mode}: round_steps.{name} temporaries {m.temp_size_in_bytes / mib:.1f} MiB "
              f"(arguments {m.argument_size_in_bytes / mib:.0f} MiB; first call {wall:.1f} s)",
              flush=True)


if __name__ == "__main__":
    main()
