"""The chunked steps' loops hold no copy of a weight (`round_steps.decode_chunk`, `sd_chunk`,
`ssd_chunk`: AR, SD and SSD in one `lax.while_loop` a chunk).

XLA:CPU gathers rows of a bf16 embedding through an fp32 convert of the whole table. At top level
that convert fuses into the gather; in a loop body, loop-invariant code motion hoisted it out of
the loop, so every chunk wrote the table again in fp32 (1.4 GB a chunk for the default pair, whose
chunks of rounds ran 1.4-1.55x slower than its rounds one by one). `models.transformer.embed`
keeps the gather inside the loop. Here each chunk program is compiled as the engine calls it
(`ssd_jax.testing.chunk_memory.chunk_temporaries`, which benchmarks/chunk_memory.py reports), for
a bf16 pair whose embedding outweighs everything else the loop holds, and its temporary memory
must stay below one bf16 copy of the table (the hoisted convert alone is two).
"""
from __future__ import annotations

import pytest

from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import random_params
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.testing.chunk_memory import chunk_temporaries

from _compile_level import optimized


@pytest.fixture(scope="module")
def bf16_pair():
    cfg = tiny_config("qwen2", vocab_size=16384, hidden_size=128, intermediate_size=256,
                      num_heads=2, num_kv_heads=1, head_dim=64, num_layers=1, dtype="bfloat16")
    return Model(cfg, random_params(cfg, 1)), Model(cfg, random_params(cfg, 2))


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_chunk_holds_no_copy_of_the_embedding(bf16_pair, mode):
    """The chunk `mode` runs, compiled fully optimized (as outside the suite) with the arguments
    the engine gave it: temporaries below one bf16 copy of the embedding table."""
    target, draft = bf16_pair
    with optimized():
        eng = Engine(target, draft, placement="colocated", max_len=32, compilation_cache=False,
                     round_chunks=True)  # chunks of rounds, which a CPU leaves off by default
        temp, _ = chunk_temporaries(
            eng, mode, [[1, 2, 3], [4, 5]], max_new_tokens=6, k=2, ssd=SSDConfig(fanout=(2, 1, 1)))
    table = target.params.embed.nbytes
    assert temp < table, (f"{mode}'s chunk holds {temp / 2**20:.1f} MiB of temporaries, the bf16 "
                          f"embedding is {table / 2**20:.1f} MiB: a weight copied each chunk?")
