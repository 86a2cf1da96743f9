"""Shared pieces of the engine's statistical exactness tests (tests/test_engine_*.py).

A tiny target / draft pair over vocabulary V = 4, the exact window distribution enumerated from
the target's forward, and `sample_windows`: N independent requests (distinct request ids, so
independent keys) through a real `Engine`, their first `window` generated tokens [N, window].
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.models.transformer import forward
from ssd_jax.runtime.engine import Engine
from ssd_jax.testing import distribution_test, enumerate_window_distribution, window_counts

V = 4
K = 2
WINDOW = K + 2
N = 100_000
CHUNK = 25_000
PROMPT = [1, 3, 0]
CFG = tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_heads=2,
                  num_kv_heads=1, head_dim=16, num_layers=2)
T07 = SamplingParams(temperature=0.7)
T10 = SamplingParams(temperature=1.0)


def make_pair() -> tuple[Model, Model]:
    """(target, draft): random tiny transformers, the draft a perturbed copy of the target."""
    target = Model(CFG, random_params(CFG, 3, scale=2.0))
    draft = Model(CFG, perturb(target.params, jax.random.key(5), 0.6))
    return target, draft


@functools.lru_cache(maxsize=None)
def exact(sampling: SamplingParams, window: int = WINDOW, prompt: tuple = tuple(PROMPT)) -> np.ndarray:
    """The exact distribution [V ** window] of the next `window` tokens under plain sampling."""
    target = make_pair()[0]

    @jax.jit
    def logits_fn(tokens):
        return forward(target.params, CFG, tokens, init_cache(CFG, tokens.shape[0], tokens.shape[1]))[0]

    return enumerate_window_distribution(logits_fn, list(prompt), window, sampling, V)


def sample_windows(pair, mode, sampling, *, n: int = N, chunk: int = CHUNK, window: int = WINDOW,
                   prompt=PROMPT, engine_kw=None, **kw):
    """n requests through one Engine; returns (tokens [n, window], [Metrics per chunk])."""
    eng = Engine(*pair, max_len=16, compilation_cache=False, **(engine_kw or {}))
    windows, metrics = [], []
    for c in range(n // chunk):
        out = eng.generate([list(prompt)] * chunk, mode=mode, max_new_tokens=window, k=K,
                           sampling=sampling, request_ids=range(c * chunk, (c + 1) * chunk),
                           seed=11, **kw)
        windows.append(np.asarray(out.token_ids)[:, :window])
        metrics.append(out.metrics)
    return np.concatenate(windows), metrics


def verdict(pair, mode, sampling, *, n: int = N, **kw):
    """(DistributionTestResult, metrics) of `sample_windows` against `exact(sampling)`."""
    toks, metrics = sample_windows(pair, mode, sampling, n=n, **kw)
    return distribution_test(window_counts(toks, V), exact(sampling)), metrics
