"""The n-gram (prompt lookup) backup's device form against its plain reference.

The reference looks each row's history up in Python (`backups.ngram_guess` over a list); the
round loop keeps every row's tokens by position on the draft mesh (`record_committed`, fed by each
round's report) and matches them as array code (`ngram_match`). Both must give the same guesses,
tokens and rows (the end-to-end run with the n-gram backup, timed and untimed, is
tests/unit/test_device_loop.py's `test_timed_rounds_agree_with_untimed_ones`)."""
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm import backups
from ssd_jax.algorithm import decode_state as ds


@pytest.mark.parametrize("seed", range(4))
def test_ngram_match_is_ngram_guess_for_every_row(seed):
    rng = np.random.default_rng(seed)
    for _ in range(40):
        B, H = 16, 24
        V, k, ngram = int(rng.integers(2, 6)), int(rng.integers(1, 5)), int(rng.integers(1, 4))
        hist = rng.integers(0, V, (B, H)).astype(np.int32)
        length = rng.integers(1, H + 1, B).astype(np.int32)
        guess, matched = backups.ngram_match(jnp.asarray(hist), jnp.asarray(length), k=k,
                                             ngram=ngram)
        for b in range(B):
            want = backups.ngram_guess(hist[b, :length[b]].tolist(), k, ngram)
            assert bool(matched[b]) == (want is not None), (hist[b, :length[b]], k, ngram)
            if want is not None:
                assert np.asarray(guess[b]).tolist() == want, (hist[b, :length[b]], k, ngram)


def test_record_committed_writes_each_rows_kept_tokens_at_their_positions():
    rng = np.random.default_rng(0)
    B, H, M = 6, 20, 3
    hist = rng.integers(0, 50, (B, H)).astype(np.int32)
    toks = rng.integers(50, 99, (B, M)).astype(np.int32)
    kept = np.asarray([0, 1, 2, 3, 3, 1], np.int32)
    n = np.asarray([4, 5, 9, 7, 19, 0], np.int32)  # the bonus after the round: the last kept
    state = ds.initial_state([[1, 2]] * B, 8, [], 2)
    rep = ds.report(jnp.ones(B, bool), jnp.asarray(kept), state, jnp.asarray(toks),
                    jnp.zeros((B, M), jnp.float32))
    got = np.asarray(backups.record_committed(jnp.asarray(hist), rep, jnp.asarray(n)))
    want = hist.copy()
    for b in range(B):
        for j in range(kept[b]):
            want[b, n[b] - kept[b] + 1 + j] = toks[b, j]
    np.testing.assert_array_equal(got, want)


def _reference_speculation(histories, seed, rids, n, *, k, vocab_size, row_vocab, ngram=2):
    """The plain reference of `backups.ngram_speculation_on_device`: per row, `ngram_guess` over
    its token list with one-hot rows, or the random backup's tokens with rows uniform over the
    ids where nothing matches."""
    rand, _ = backups.random_speculation(seed, rids, n, k=k, vocab_size=vocab_size,
                                         row_vocab=row_vocab)
    rand = np.asarray(rand)
    toks = np.zeros((len(histories), k), np.int32)
    rows = np.zeros((len(histories), k, row_vocab), np.float32)
    for b, h in enumerate(histories):
        guess = backups.ngram_guess(h, k, ngram)
        if guess is None:
            toks[b], rows[b, :, :vocab_size] = rand[b], 1.0 / vocab_size
        else:
            toks[b], rows[b, np.arange(k), guess] = guess, 1.0
    return toks, rows


def test_device_speculation_equals_the_reference():
    rng = np.random.default_rng(1)
    B, H, k, V = 12, 16, 3, 5
    lens = rng.integers(1, H + 1, B)
    histories = [rng.integers(0, V, int(L)).tolist() for L in lens]
    hist = np.zeros((B, H), np.int32)
    for b, h in enumerate(histories):
        hist[b, :len(h)] = h
    n = jnp.asarray(lens - 1, jnp.int32)
    rids = jnp.arange(B, dtype=jnp.int32) + 7
    kw = dict(k=k, vocab_size=V, row_vocab=V + 3)
    want_t, want_r = _reference_speculation(histories, 3, rids, n, **kw)
    got_t, got_r = backups.ngram_speculation_on_device(jnp.asarray(hist), 3, rids, n, **kw)
    matched = [backups.ngram_guess(h, k) is not None for h in histories]
    assert any(matched) and not all(matched)  # both the lookup and its uniform fallback
    np.testing.assert_array_equal(np.asarray(got_t), np.asarray(want_t))
    np.testing.assert_array_equal(np.asarray(got_r), np.asarray(want_r))
