"""What a chunk of decode steps or rounds holds besides its inputs: `chunk_temporaries` compiles
the chunk an engine's call runs (`round_steps.decode_chunk` / `sd_chunk` / `ssd_chunk`) with the
arguments that call gave it and reads its `memory_analysis()`. A chunk whose temporaries reach the
size of a weight rewrites that weight every dispatch (a conversion or layout copy hoisted out of its
loop): tests/unit/test_chunk_memory.py bounds it, benchmarks/chunk_memory.py and
benchmarks/gpu_session.py report it."""
from __future__ import annotations

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


__all__ = ["CHUNKS", "chunk_temporaries"]
