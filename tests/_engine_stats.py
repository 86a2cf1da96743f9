"""Shared pieces of the engine's statistical exactness tests (tests/test_engine_*.py).

A tiny target / draft pair over vocabulary V = 4, the exact window distribution enumerated from
the target's forward, and `sample_windows`: N independent requests (distinct request ids, so
independent keys) through a real `Engine`, their generated tokens `skip .. skip + window - 1`
[N, window]. `verdict` tests them with the calibrated chi-square of `ssd_jax.testing`, cells of
probability below POOL pooled (`min_expected`; why: tests/test_engine_exactness.py's docstring).
"""
from __future__ import annotations

import functools

import jax
import numpy as np

from _compile_level import optimized
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
CHUNK = 2_500  # rows per generate call: 2,500 took ~15% less CPU a case than 25,000 (same tokens)
PROMPT = [1, 3, 0]
MAX_LEN = 16  # one cache length for every window here (prompt 3 + up to 9 tokens + K + 2), one compile
POOL = 0.01   # cells of exact probability below 1% are pooled into groups of >= 1%
CFG = tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64, num_heads=2,
                  num_kv_heads=1, head_dim=16, num_layers=2)
T07 = SamplingParams(temperature=0.7)
T10 = SamplingParams(temperature=1.0)


def make_pair() -> tuple[Model, Model]:
    """(target, draft): random tiny transformers, the draft a perturbed copy of the target."""
    target = Model(CFG, random_params(CFG, 3, scale=2.0))
    draft = Model(CFG, perturb(target.params, jax.random.key(5), 0.6))
    return target, draft


def min_expected(n: int) -> float:
    """The pooling bar for n samples: cells expected fewer than POOL * n times are pooled."""
    return max(5.0, POOL * n)


@functools.lru_cache(maxsize=None)
def exact(sampling: SamplingParams, window: int = WINDOW, prompt: tuple = tuple(PROMPT),
          skip: int = 0) -> np.ndarray:
    """The exact distribution [V ** window] of generated tokens skip .. skip + window - 1 under
    plain sampling (the marginal of the first skip + window tokens)."""
    target = make_pair()[0]

    @jax.jit
    def logits_fn(tokens):
        return forward(target.params, CFG, tokens, init_cache(CFG, tokens.shape[0], tokens.shape[1]))[0]

    full = enumerate_window_distribution(logits_fn, list(prompt), skip + window, sampling, V)
    return full.reshape(V ** skip, V ** window).sum(axis=0)


def sample_windows(pair, mode, sampling, *, n: int = N, chunk: int = CHUNK, window: int = WINDOW,
                   prompt=PROMPT, engine_kw=None, skip: int = 0, first_id: int = 0, **kw):
    """n requests (ids first_id ..) through one Engine, each generating skip + window tokens;
    returns (tokens skip .. skip + window - 1 of each [n, window], [Metrics per chunk])."""
    windows, metrics = [], []
    with optimized():  # one program over n requests: the runs, not the compile, are its time
        eng = Engine(*pair, max_len=MAX_LEN, compilation_cache=False, **(engine_kw or {}))
        for c in range(-(-n // chunk)):
            lo, hi = first_id + c * chunk, first_id + min(n, (c + 1) * chunk)
            out = eng.generate([list(prompt)] * (hi - lo), mode=mode, max_new_tokens=skip + window,
                               k=K, sampling=sampling, request_ids=range(lo, hi), seed=11, **kw)
            windows.append(np.asarray(out.token_ids)[:, skip:skip + window])
            metrics.append(out.metrics)
    return np.concatenate(windows), metrics


def check_windows(toks, sampling, *, window: int = WINDOW, prompt=PROMPT, skip: int = 0,
                  false_alarm: float = 1e-3):
    """The DistributionTestResult of windows `toks` [n, window] against `exact`, pooled at POOL."""
    ex = exact(sampling, window, tuple(prompt), skip)
    return distribution_test(window_counts(toks, V), ex, false_alarm=false_alarm,
                             min_expected=min_expected(len(toks)))


def verdict(pair, mode, sampling, *, n: int = N, false_alarm: float = 1e-3, **kw):
    """(DistributionTestResult, metrics) of `sample_windows` against `exact(sampling)` (the same
    window, prompt and skip)."""
    toks, metrics = sample_windows(pair, mode, sampling, n=n, **kw)
    where = {k: kw[k] for k in ("window", "prompt", "skip") if k in kw}
    return check_windows(toks, sampling, false_alarm=false_alarm, **where), metrics
