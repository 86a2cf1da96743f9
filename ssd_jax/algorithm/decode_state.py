"""A generate call's per-row state on the device, and the commit that advances it.

`DecodeState` is a static-shape pytree that lives on the target mesh for a whole call: the
generated-token buffer, each row's count, position, bonus and previous token, its finish code,
the EOS ids and the budget, and the round counters (accept histograms). `commit` is the one rule
that appends tokens to it — what `ssd_jax.runtime.batch.Batch.emit` does on the host, as array
code: an active row keeps its tokens in order until EOS or the budget (the token that meets it is
kept), and an ended row keeps nothing. `report` packs what the host reads of a round into one
small int32 array, so a round costs the host one fetch whatever the batch size.

Positions follow `ssd_jax.algorithm.steps`: a row with `count` generated tokens has its bonus
(the last committed token) at position n = prompt_len + count - 1, not yet in either KV cache.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

# finish codes: 0 while the row runs; the names are GenerationResult.finish_reasons'
RUNNING, EOS, LENGTH, STOP, CANCELLED = range(5)
FINISH_NAMES = ("", "eos", "length", "stop", "cancelled")
ROW_FIELDS = ("count", "n", "bonus", "prev", "finish")  # DecodeState.per_row's columns


def _row_field(name: str, doc: str) -> property:
    """A reader of one of `DecodeState.per_row`'s columns (`ROW_FIELDS`)."""
    j = ROW_FIELDS.index(name)

    def read(self) -> jax.Array:
        return self.per_row[:, j]
    read.__name__, read.__doc__ = name, doc
    return property(read)


@struct.dataclass
class DecodeState:
    """Per-row state of one generate call (a pytree; every leaf a device array).

    tokens `[B, L]` int32: generated ids (L = max_new_tokens; -1 where none yet); logprobs
    `[B, L]` float32: the target's raw log-probability of each; per_row `[B, 5]` int32, read as
    count `[B]`: generated so far; n `[B]`: position of the bonus; bonus `[B]`: the last
    committed token; prev `[B]`: the one before it (the bonus itself for a one-token history);
    finish `[B]`: a finish code (`FINISH_NAMES`); eos `[E]` int32: ids that end a row (-1
    padding); max_new `[]` int32: the budget; accept_hist / accept_hist_after_hit /
    accept_hist_after_miss `[K+1]` int32: sequence-rounds by accepted draft tokens, overall and
    after a cache hit / a backup (SSD).

    The five per-row numbers are one array (`ROW_FIELDS`, set with `with_rows`) because a round
    updates all of them: on a GPU five arrays took five kernels a round, one array takes one.
    """

    tokens: jax.Array
    logprobs: jax.Array
    per_row: jax.Array
    eos: jax.Array
    max_new: jax.Array
    accept_hist: jax.Array
    accept_hist_after_hit: jax.Array
    accept_hist_after_miss: jax.Array

    count = _row_field("count", "`[B]` tokens generated so far.")
    n = _row_field("n", "`[B]` the bonus token's position.")
    bonus = _row_field("bonus", "`[B]` the last committed token.")
    prev = _row_field("prev", "`[B]` the token before the bonus.")
    finish = _row_field("finish", "`[B]` the finish code (`FINISH_NAMES`).")

    def with_rows(self, **fields) -> "DecodeState":
        """The state with some of its per-row numbers (`ROW_FIELDS`, each `[B]`) replaced."""
        unknown = set(fields) - set(ROW_FIELDS)
        if unknown:
            raise TypeError(f"DecodeState.with_rows: no per-row field {sorted(unknown)}")
        cols = [fields[f] if f in fields else self.per_row[:, j]
                for j, f in enumerate(ROW_FIELDS)]
        return self.replace(per_row=jnp.stack([c.astype(jnp.int32) for c in cols], axis=1))

    @property
    def active(self) -> jax.Array:
        """`[B]` bool: rows still generating."""
        return self.finish == RUNNING


def initial_state(prompts, max_new_tokens: int, eos_ids, k: int,
                  rows: int | None = None) -> DecodeState:
    """The state before the prefill's token, as host (numpy) arrays to place on a mesh: prompts is
    B lists of token ids; the bonus is each prompt's last token at position len - 1. rows: the
    first `rows` run (default all); the others are padding, CANCELLED from the start."""
    B, L = len(prompts), int(max_new_tokens)
    eos = np.asarray(sorted(set(int(e) for e in eos_ids)) or [-1], np.int32)
    hist = np.zeros(max(int(k), 0) + 1, np.int32)
    per_row = np.stack([np.zeros(B, np.int32), np.asarray([len(p) - 1 for p in prompts], np.int32),
                        np.asarray([p[-1] for p in prompts], np.int32),
                        np.asarray([p[-2] if len(p) > 1 else p[-1] for p in prompts], np.int32),
                        np.where(np.arange(B) < (B if rows is None else rows), RUNNING,
                                 CANCELLED).astype(np.int32)], axis=1)  # ROW_FIELDS
    return DecodeState(
        tokens=np.full((B, L), -1, np.int32), logprobs=np.zeros((B, L), np.float32),
        per_row=per_row, eos=eos, max_new=np.int32(L),
        accept_hist=hist, accept_hist_after_hit=hist.copy(), accept_hist_after_miss=hist.copy())


def commit(state: DecodeState, tokens: jax.Array, logprobs: jax.Array, num: jax.Array):
    """Append each active row's first `num[b]` of `tokens` `[B, M]` (log-probs `[B, M]`), in
    order, stopping after the first that is an EOS id or fills the budget (EOS wins when both).
    Returns (the new state, kept `[B]`: tokens appended per row, 0 for ended rows)."""
    B, M = tokens.shape
    L = state.tokens.shape[1]
    j = jnp.arange(M, dtype=jnp.int32)[None, :]
    active = state.active
    valid = (j < num[:, None]) & active[:, None]
    is_eos = jnp.any(tokens[:, :, None] == state.eos[None, None, :], axis=-1)
    at_budget = state.count[:, None] + j + 1 >= state.max_new
    ends = valid & (is_eos | at_budget)
    ended = jnp.any(ends, axis=1)
    first_end = jnp.argmax(ends, axis=1).astype(jnp.int32)
    kept = jnp.where(active, jnp.where(ended, first_end + 1, jnp.minimum(num, M)), 0)
    keep = j < kept[:, None]
    at = jnp.where(keep, state.count[:, None] + j, L)  # L: past the buffer, dropped
    rows = jnp.arange(B)[:, None]
    last = jnp.take_along_axis(tokens, jnp.maximum(kept - 1, 0)[:, None], axis=1)[:, 0]
    before_last = jnp.take_along_axis(tokens, jnp.maximum(kept - 2, 0)[:, None], axis=1)[:, 0]
    eos_end = jnp.take_along_axis(is_eos, first_end[:, None], axis=1)[:, 0]
    new = state.replace(
        tokens=state.tokens.at[rows, at].set(tokens.astype(jnp.int32), mode="drop"),
        logprobs=state.logprobs.at[rows, at].set(logprobs.astype(jnp.float32), mode="drop"),
    ).with_rows(
        count=state.count + kept, n=state.n + kept,
        bonus=jnp.where(kept > 0, last, state.bonus),
        prev=jnp.where(kept >= 2, before_last, jnp.where(kept == 1, state.bonus, state.prev)),
        finish=jnp.where(active & ended, jnp.where(eos_end, EOS, LENGTH), state.finish))
    return new, kept


def since(state: DecodeState, count0: jax.Array, width: int, kept: jax.Array):
    """Each row's tokens and log-probs generated since it had `count0` `[B]`: `[B, width]` int32
    (-1 past the row's `kept` `[B]`) and float32 (0 past it)."""
    j = jnp.arange(width, dtype=jnp.int32)[None, :]
    at = jnp.minimum(count0[:, None] + j, state.tokens.shape[1] - 1)
    new = j < kept[:, None]
    return (jnp.where(new, jnp.take_along_axis(state.tokens, at, axis=1), -1),
            jnp.where(new, jnp.take_along_axis(state.logprobs, at, axis=1), 0.0))


def count_accepts(state: DecodeState, num_accepted: jax.Array, active: jax.Array,
                  from_backup: jax.Array | None) -> DecodeState:
    """Add a verify's outcome to the accept histograms: num_accepted `[B]` for the rows that were
    active `[B]`; from_backup `[B]` bool (SSD): whether each row's speculation came from a backup
    (after-miss histogram) or the speculation cache (after-hit); None for SD."""
    K1 = state.accept_hist.shape[0]
    onehot = jax.nn.one_hot(num_accepted, K1, dtype=jnp.int32) * active[:, None].astype(jnp.int32)
    new = state.replace(accept_hist=state.accept_hist + onehot.sum(0))
    if from_backup is None:
        return new
    miss = from_backup[:, None].astype(jnp.int32)
    return new.replace(accept_hist_after_hit=new.accept_hist_after_hit + (onehot * (1 - miss)).sum(0),
                       accept_hist_after_miss=new.accept_hist_after_miss + (onehot * miss).sum(0))


def end_rows(state: DecodeState, rows: jax.Array, code: int) -> DecodeState:
    """Rows `[B]` bool that the host ended (a stop string, a closed stream) get finish `code`."""
    return state.with_rows(finish=jnp.where(rows & state.active, code, state.finish))


# report columns: active before the round, kept, finish after, hit (-1: no lookup), then the
# round's tokens [M] and their log-probs [M] (float32 bits)
R_ACTIVE, R_KEPT, R_FINISH, R_HIT, R_TOKENS = range(5)


def report(active_before: jax.Array, kept: jax.Array, state: DecodeState, tokens: jax.Array,
           logprobs: jax.Array, hit: jax.Array | None = None) -> jax.Array:
    """One round as `[B, 4 + 2M]` int32 (columns above): what the host reads of a round in one
    fetch — termination, the timeline's counts, and the tokens for streaming and stop strings."""
    B, M = tokens.shape
    hit = jnp.full((B,), -1, jnp.int32) if hit is None else hit.astype(jnp.int32)
    cols = [active_before.astype(jnp.int32)[:, None], kept[:, None], state.finish[:, None],
            hit[:, None], tokens.astype(jnp.int32),
            jax.lax.bitcast_convert_type(logprobs.astype(jnp.float32), jnp.int32)]
    return jnp.concatenate(cols, axis=1)


def with_hits(rep: jax.Array, hit: jax.Array, looked_up: jax.Array) -> jax.Array:
    """A report with its hit column set: hit `[B]` bool where `looked_up` `[B]`, else -1."""
    col = jnp.where(looked_up, hit.astype(jnp.int32), -1)
    return rep.at[:, R_HIT].set(col)


def read_report(rep: np.ndarray):
    """Host side: a fetched report -> (active [B] bool, kept [B], finish [B], hit [B] (-1: no
    lookup), tokens [B, M], logprobs [B, M] float32)."""
    M = (rep.shape[1] - R_TOKENS) // 2
    toks = rep[:, R_TOKENS:R_TOKENS + M]
    lps = np.ascontiguousarray(rep[:, R_TOKENS + M:]).view(np.float32)
    return (rep[:, R_ACTIVE] > 0, rep[:, R_KEPT], rep[:, R_FINISH], rep[:, R_HIT], toks, lps)
