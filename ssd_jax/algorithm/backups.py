"""Backup speculators for a cache miss (ALGORITHM.md §5), each carrying its true proposal distribution.

- neural ("jit"): the draft drafts K tokens from the real outcome, as plain SD would
  (`ssd_jax.algorithm.steps.draft_chain`); accurate, costs about one SD drafting time.
- random: K uniform tokens over the tokenizer's vocabulary; rows are that uniform distribution.
- ngram (prompt lookup): the K tokens that followed the latest earlier occurrence of the sequence's
  last `n` tokens; deterministic, so rows are one-hot. Where nothing matches, uniform as `random`.
A one-hot proposal is accepted with probability p(s), and its residual is p with s removed, so
every backup keeps the output exactly the target's.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from ssd_jax.algorithm import sampling as smp

BACKUPS = ("neural", "random", "ngram")  # the backup speculators a round can run


@functools.partial(jax.jit, static_argnames=("k", "vocab_size", "row_vocab", "row_dtype"))
def random_speculation(seed, request_ids, n, *, k: int, vocab_size: int, row_vocab: int,
                       row_dtype: str = "float32"):
    """Uniform tokens at positions n+1..n+k: n `[B]` int32, request_ids `[B]`, seed a scalar int or
    key -> tokens `[B, K]` int32, rows `[B, K, V]` (V = row_vocab) in `row_dtype`, uniform over the
    first `vocab_size` rows and 0 on padded ones. Draws are keyed (request, position, STREAM_BACKUP).

    Static: `k` (K, tokens per speculation), `vocab_size` (tokens drawn from [0, vocab_size)),
    `row_vocab` (V, the rows' length: the target's embedding rows), `row_dtype` (the rows' dtype name).
    """
    B = n.shape[0]
    pos = n[:, None] + 1 + jnp.arange(k, dtype=jnp.int32)[None]
    keys = smp.position_keys(seed, request_ids, pos, smp.STREAM_BACKUP)
    toks = jax.vmap(jax.vmap(lambda key: jax.random.randint(key, (), 0, vocab_size)))(keys)
    row = jnp.where(jnp.arange(row_vocab) < vocab_size, 1.0 / vocab_size, 0.0)
    rows = jnp.broadcast_to(row, (B, k, row_vocab)).astype(row_dtype)
    return toks.astype(jnp.int32), rows


def ngram_guess(history: list[int], k: int, n: int = 2) -> list[int] | None:
    """Prompt lookup: the k tokens after the latest earlier occurrence of history's last n tokens
    (shorter suffixes are tried down to 1), padded to k by repeating the last one. None when nothing
    matches. Plain Python on the host: history is a list of token ids, the result k of them."""
    h = np.asarray(history)
    for m in range(min(n, len(h) - 1), 0, -1):
        tail = h[-m:]
        for start in range(len(h) - m - 1, -1, -1):
            if np.array_equal(h[start:start + m], tail):
                nxt = h[start + m:start + m + k].tolist()
                if nxt:
                    return (nxt + [nxt[-1]] * k)[:k]
    return None


@functools.partial(jax.jit, static_argnames=("row_vocab", "vocab_size", "row_dtype"))
def _ngram_rows(guess, matched, *, row_vocab: int, vocab_size: int, row_dtype: str):
    onehot = jax.nn.one_hot(guess, row_vocab, dtype=jnp.float32)
    uniform = jnp.where(jnp.arange(row_vocab) < vocab_size, 1.0 / vocab_size, 0.0)
    return jnp.where(matched[:, None, None], onehot, uniform).astype(row_dtype)


def ngram_match(history: jax.Array, length: jax.Array, *, k: int, ngram: int = 2):
    """`ngram_guess` as array code, for every row at once: history `[B, H]` int32 (the row's
    tokens at positions 0..length-1; later slots are never read), length `[B]` int32 ->
    (guess `[B, K]` int32, matched `[B]` bool). The same rule: the longest suffix of at most
    `ngram` tokens (and at most length - 1) that occurs earlier, its latest occurrence, the k
    tokens after it padded by repeating the last; guess is 0 where nothing matches. Static: k,
    ngram. Jittable; a row costs O(H * ngram) compares, nothing per row on the host."""
    B, H = history.shape
    s = jnp.arange(H, dtype=jnp.int32)[None]
    guess = jnp.zeros((B, k), jnp.int32)
    found = jnp.zeros(B, bool)
    for m in range(ngram, 0, -1):  # longest suffix first, as ngram_guess
        tail = jnp.take_along_axis(
            history, jnp.clip(length[:, None] - m + jnp.arange(m)[None], 0, H - 1), axis=1)
        eq = jnp.ones((B, H), bool)
        for i in range(m):  # window starting at s equals the tail, token by token
            shifted = jnp.pad(history[:, i:], ((0, 0), (0, i)))
            eq &= shifted == tail[:, i:i + 1]
        # starts that end before the tail's last token, so at least one token follows
        ok = eq & (s <= length[:, None] - m - 1) & (m <= length[:, None] - 1)
        start = jnp.max(jnp.where(ok, s, -1), axis=1)
        take = (start >= 0) & ~found
        base = start + m
        idx = base[:, None] + jnp.minimum(jnp.arange(k)[None], (length - base)[:, None] - 1)
        g = jnp.take_along_axis(history, jnp.clip(idx, 0, H - 1), axis=1)
        guess = jnp.where(take[:, None], g, guess)
        found = found | take
    return guess.astype(jnp.int32), found


def record_committed(history: jax.Array, report: jax.Array, n: jax.Array) -> jax.Array:
    """history `[B, H]` with a round's committed tokens written at their positions: report a
    `decode_state.report` `[B, 4 + 2M]` (its kept count and tokens), n `[B]` the bonus's
    position after the round (the last token kept sits there). Rows that kept nothing are
    unchanged. The device loop's n-gram backup reads the history this keeps. Each row writes its
    own (vmapped), so on a data-parallel draft the write stays on the row's shard."""
    from ssd_jax.algorithm import decode_state as ds
    H = history.shape[1]
    kept = report[:, ds.R_KEPT]
    M = (report.shape[1] - ds.R_TOKENS) // 2
    toks = report[:, ds.R_TOKENS:ds.R_TOKENS + M]
    j = jnp.arange(M, dtype=jnp.int32)[None]
    at = jnp.where(j < kept[:, None], n[:, None] - kept[:, None] + 1 + j, H)  # H: dropped
    return jax.vmap(lambda h, a, t: h.at[a].set(t, mode="drop"))(history, at, toks)


@functools.partial(jax.jit, static_argnames=("length",))
def start_history(prompt_tokens, report, n, length: int) -> jax.Array:
    """The rows' history `[B, length]` int32 at a call's first round: prompt_tokens `[B, T]`
    (padded, or cut: the prefill's bucket may be wider than the cache, no row's history is), the
    prefill's token (report, n: the first round's) written at its position. `record_committed`
    then adds each round's tokens (the n-gram backup's and a proposer's history)."""
    toks = prompt_tokens[:, :length].astype(jnp.int32)
    hist = jnp.pad(toks, ((0, 0), (0, length - toks.shape[1])))
    return record_committed(hist, report, n)


@functools.partial(jax.jit, static_argnames=("k", "vocab_size", "row_vocab", "row_dtype", "ngram"))
def ngram_speculation_on_device(history, seed, request_ids, n, *, k: int, vocab_size: int,
                                row_vocab: int, row_dtype: str = "float32", ngram: int = 2):
    """Per row: an n-gram guess with one-hot rows, or uniform tokens and rows where none
    matches. history `[B, H]` int32 holding each row's tokens at positions 0..n (n `[B]`, the
    bonus's position), seed, request_ids `[B]` as for `random_speculation` (the uniform fallback
    where nothing matches); `ngram`, the longest suffix matched (`ngram_guess`, the plain Python
    reference per row, which tests/unit/test_ngram_backup.py holds this to). Returns tokens
    `[B, K]` int32 and rows `[B, K, V]` (V = row_vocab) in `row_dtype`."""
    rand, _ = random_speculation(seed, request_ids, n, k=k, vocab_size=vocab_size,
                                 row_vocab=row_vocab, row_dtype=row_dtype)
    guess, matched = ngram_match(history, n + 1, k=k, ngram=ngram)
    guess = jnp.where(matched[:, None], guess, rand)
    return guess, _ngram_rows(guess, matched, row_vocab=row_vocab, vocab_size=vocab_size,
                              row_dtype=row_dtype)


