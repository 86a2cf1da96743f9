"""The engine checks that are not distribution tests, shared by tests/statistical/test_engine_exactness.py
(run on the correct engine, where they must hold exactly) and tests/statistical/test_planted_bugs.py (run with
a bug planted, where they must fail): SSD emits SD's tokens, a request's tokens do not depend on
its batch row, and every speculated token is drawn from the rows handed to the verifier with it.
All on `_engine_stats.make_pair`'s V = 4 pair, K = 2, from its one prompt."""
from __future__ import annotations

import contextlib

import jax
import jax.numpy as jnp
import numpy as np

import ssd_jax.algorithm.steps
from ssd_jax.algorithm.sampling import STREAM_BACKUP, STREAM_DRAFT, position_keys, sample_from_probs
from ssd_jax.runtime.engine import Engine, SSDConfig

from _engine_stats import K, MAX_LEN, PROMPT, T10, V

FULL_FANOUT = SSDConfig(fanout=(3, 3, 4))  # every outcome (j, c) of K = 2, V = 4 is cached
PLAIN_SSD = SSDConfig(fanout=(2, 2, 1))  # hits and misses, neural backup, C = 1: SSD emits SD's tokens
SAGUARO_SSD = SSDConfig(fanout=(2, 2, 1), saguaro_c=0.5)  # the tree's rows are not SD's
# The deterministic checks run batches of DET_BATCH, and the quick case chunks of it with
# SAGUARO_SSD: the same shapes and static arguments, so the same compiled steps.
DET_BATCH = 2000
QUICK = ("quick-ssd-t1.0-saguaro0.5", "ssd", dict(chunk=DET_BATCH, ssd=SAGUARO_SSD))


def generate_ids(pair, mode, ids, *, sampling=T10, tokens=8, ssd=PLAIN_SSD, engine_kw=None, **kw):
    """(token ids [len(ids), tokens], metrics): one `generate` of the pair's prompt per request
    id, seed 11; no fallback allowed."""
    eng = Engine(*pair, max_len=MAX_LEN, compilation_cache=False, **(engine_kw or {}))
    out = eng.generate([list(PROMPT)] * len(ids), mode=mode, max_new_tokens=tokens, k=K,
                       sampling=sampling, request_ids=list(ids), seed=11, ssd=ssd, **kw)
    assert getattr(out.metrics, "fallback", None) is None, out.metrics.fallback
    return np.asarray(out.token_ids), out.metrics


def ssd_requests_unlike_sd(pair, n=DET_BATCH, ssd=PLAIN_SSD) -> tuple[int, object]:
    """(requests whose 8 SSD tokens differ from SD's, SSD metrics) for request ids 1000.. at T 1.

    With the neural backup, C = 1 and float32 rows, every speculation SSD verifies is the one SD
    would draft from the same outcome (a miss's backup is SD's draft; a hit's tree branch draws
    with the keys a direct draft uses, ALGORITHM.md §3), and verification uses the same keys, so
    the tokens are SD's (up to a near-tie flip between the tree's and the chain's float rounding,
    which 2000 x 8 tokens have not shown here)."""
    ids = range(1000, 1000 + n)
    sd, _ = generate_ids(pair, "sd", ids, ssd=ssd)
    got, m = generate_ids(pair, "ssd", ids, ssd=ssd)
    return int(np.sum(np.any(got != sd, axis=1))), m


def requests_moved_by_batch_order(pair, n=DET_BATCH, ssd=PLAIN_SSD) -> tuple[int, object]:
    """(request ids whose SSD tokens change when the batch is reversed, metrics): every id sits
    in another row (n even), with the same seed and ids."""
    ids = np.arange(1000, 1000 + n)
    a, m = generate_ids(pair, "ssd", ids, ssd=ssd)
    b, _ = generate_ids(pair, "ssd", ids[::-1], ssd=ssd)
    return int(np.sum(np.any(a != b[::-1], axis=1))), m


@contextlib.contextmanager
def recorded_verifies(monkeypatch):
    """Records every verify the engine makes: (n [B], spec [B, K], rows [B, K, V], active [B],
    request ids [B], seed) per round; instrumentation only (the real verify runs)."""
    log, real = [], ssd_jax.algorithm.steps.verify

    def recording(params, cfg, cache, bonus, spec, rows, active, seed, request_ids, *a, **kw):
        log.append((np.asarray(cache.lengths), np.asarray(spec), np.asarray(rows),
                    np.asarray(active), np.asarray(request_ids), int(seed)))
        return real(params, cfg, cache, bonus, spec, rows, active, seed, request_ids, *a, **kw)

    monkeypatch.setattr(ssd_jax.algorithm.steps, "verify", recording)
    yield log
    monkeypatch.setattr(ssd_jax.algorithm.steps, "verify", real)


def draws_not_from_their_rows(log, vocab: int = V, kinds=None) -> tuple[int, int]:
    """(speculated tokens not drawn from the rows handed to the verifier with them, tokens
    checked), over the active rows of a `recorded_verifies` log. What "drawn from" means depends
    on the row, so every proposal source is checked (ALGORITHM.md §3, §5): a one-hot row (an
    n-gram match, a greedy draft) must be one-hot at its token; a row uniform over the `vocab`
    real ids (the random backup, an n-gram miss) must hold the uniform draw of key (request id,
    position, STREAM_BACKUP); any other row (the neural draft, the tree, Saguaro, a cut head,
    quantized or bf16 rows) the exponential-race winner of that very row under key (request id,
    position, STREAM_DRAFT). `kinds`, a Counter if given, counts the checked tokens by the rule
    their row took ("one-hot", "uniform", "raced")."""
    bad = checked = 0
    for n, spec, rows, active, rids, seed in log:
        pos = n[:, None] + 1 + np.arange(spec.shape[1])[None, :]
        r = np.asarray(jnp.asarray(rows).astype(jnp.float32))
        raced = np.asarray(sample_from_probs(jnp.asarray(r), position_keys(seed, rids, pos, STREAM_DRAFT)))
        backup_keys = position_keys(seed, rids, pos, STREAM_BACKUP)
        uniform_draw = np.asarray(jax.vmap(jax.vmap(
            lambda key: jax.random.randint(key, (), 0, vocab)))(backup_keys))
        support = (r > 0).sum(-1)
        one_hot = support == 1
        uniform = (support == vocab) & np.all(r[..., :vocab] == r[..., :1], -1)
        want = np.where(one_hot, r.argmax(-1), np.where(uniform, uniform_draw, raced))
        bad += int(np.sum((want != spec) & active[:, None]))
        checked += int(np.sum(active)) * spec.shape[1]
        if kinds is not None:
            on = np.broadcast_to(active[:, None], spec.shape)
            kinds.update({"one-hot": int(np.sum(one_hot & on)),
                          "uniform": int(np.sum(uniform & ~one_hot & on)),
                          "raced": int(np.sum(~one_hot & ~uniform & on))})
    return bad, checked
