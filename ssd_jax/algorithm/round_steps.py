"""The jitted steps of a round on the device: commit on the target mesh, resolve on the draft mesh.

They sit between `ssd_jax.algorithm.steps` (prefill, decode, verify, draft_chain, the model
passes) and the engine's device loop (`ssd_jax.runtime.device_loop`): each takes the call's
`DecodeState` or the draft's side of a round and returns the next, so the host dispatches a round
without reading anything but one `report` (docs/ARCHITECTURE.md, "The round on the device").

- `commit_tokens` (target): the prefill's or a decode step's token into the state.
- `decode_chunk` (target): up to N plain decode steps and their commits in one `lax.while_loop`
  (AR when no row's tokens pass through the host), one report for the chunk. It is a model step
  like `steps.decode`, so it goes through the step store (`aot.stored_jit`): a second process
  reads it back instead of tracing the model.
- `commit_verify` (target): a verify's outcome into the state and the accept histograms; returns
  what the draft needs of it (`Outcome`).
- `sd_chunk` (one mesh): up to N SD rounds (verify, commit, the next draft chain) in one
  `lax.while_loop`, one report for the chunk, for a draft on the target's mesh.
- `ssd_chunk` (one mesh): up to N SSD rounds (verify, tree, commit, resolve) in one
  `lax.while_loop`, one report for the chunk, for a draft on the target's mesh.
- `resolve` (draft): the speculation-cache lookup for the outcome, the backup for the rows that
  missed (a neural draft chain under `lax.cond`, only when a row missed, or the random backup),
  the hit counters (per row: `LookupCounters`), and the report with its hit column.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct

from ssd_jax.models.ops import XLA, Ops
from ssd_jax.algorithm import backups, steps
from ssd_jax.algorithm.aot import inside_step, step_jit, stored_jit
from ssd_jax.algorithm import decode_state as ds
from ssd_jax.algorithm.lookup_counters import BACKUP_INDEX, LookupCounters
from ssd_jax.algorithm.speculation_cache import SpeculationCache, lookup


# The packed Outcome's per-row columns, in order; its report's columns follow from REPORT_START.
# `Outcome.pack` / `unpack` and the host code that builds one (`packed_on_host`, the warm-ups) or
# checks one (the draft process) all read the order from here.
OUTCOME_FIELDS = ("num_accepted", "bonus_out", "n", "prev", "bonus", "active")
OUTCOME_COLUMN = {name: i for i, name in enumerate(OUTCOME_FIELDS)}
REPORT_START = len(OUTCOME_FIELDS)


@struct.dataclass
class Outcome:
    """What the draft mesh needs of a verified round.

    num_accepted `[B]`, bonus_out `[B]` (the verify's bonus: the outcome looked up); n, prev,
    bonus `[B]` and active `[B]` bool: the rows after the commit (where a backup drafts from, and
    the next tree's round state); report: the round's `decode_state.report`. It crosses meshes
    packed as one int32 array `[B, 6 + R]` (`pack` / `unpack`): one transfer, not seven."""
    num_accepted: jax.Array
    bonus_out: jax.Array
    n: jax.Array
    prev: jax.Array
    bonus: jax.Array
    active: jax.Array
    report: jax.Array

    def pack(self) -> jax.Array:
        """`[B, 6 + R]` int32: the six per-row fields (OUTCOME_FIELDS), then the report's
        columns."""
        cols = [getattr(self, name).astype(jnp.int32) for name in OUTCOME_FIELDS]
        return jnp.concatenate([jnp.stack(cols, 1), self.report], axis=1)

    @classmethod
    def unpack(cls, packed: jax.Array) -> "Outcome":
        """The inverse of `pack`."""
        c = {name: packed[:, i] for i, name in enumerate(OUTCOME_FIELDS)}
        return cls(**dict(c, active=c["active"] > 0), report=packed[:, REPORT_START:])


def packed_on_host(tokens: int, **fields) -> np.ndarray:
    """A packed `Outcome` `[B, 6 + R]` of host values (each of OUTCOME_FIELDS a `[B]` array) with
    an empty report of `tokens` token columns (`decode_state.report`'s width): the shapes a
    warm-up's steps meet."""
    cols = np.stack([np.asarray(fields[name]) for name in OUTCOME_FIELDS], 1).astype(np.int32)
    report = np.zeros((cols.shape[0], ds.R_TOKENS + 2 * tokens), np.int32)
    report[:, ds.R_HIT] = -1
    return np.concatenate([cols, report], 1)


@functools.partial(jax.jit, donate_argnames=("state",))
def commit_tokens(state: ds.DecodeState, tokens: jax.Array, logprobs: jax.Array):
    """One token per row (`[B]`, log-probs `[B]`: the prefill's or a decode step's) into `state`
    (donated). Returns (state, active `[B]` and bonus `[B]` after it, report): the next step's
    inputs as outputs of this one, so the host does not slice them out of the state (an op of
    its own, every round)."""
    active = state.active
    tokens, logprobs = tokens[:, None], logprobs[:, None]
    new, kept = ds.commit(state, tokens, logprobs, jnp.ones(tokens.shape[0], jnp.int32))
    return new, new.active, new.bonus, ds.report(active, kept, new, tokens, logprobs)


AR_CHUNK = 16  # plain decode steps per dispatch (and per report read) when nothing streams

# The chunks return their donated caches first, in their arguments' order: jit pairs each donated
# input with the first output of the same shape and dtype, so a state field returned before the
# cache would take the cache's `lengths` buffer and shift every [B] int32 pairing after it, and
# XLA would copy each of those arrays into and out of the loop on every dispatch.


@stored_jit(static_argnames=("cfg", "vocab_size", "steps_max", "ops"),
            donate_argnames=("state", "cache"))
def decode_chunk(params, cfg, cache, state: ds.DecodeState, seed, request_ids, sampling, *,
                 vocab_size: int, steps_max: int = AR_CHUNK, ops: Ops = XLA):
    """Up to `steps_max` plain decode steps (`steps.decode`, then `decode_state.commit` of its
    token, as `commit_tokens`) in one `lax.while_loop`, which stops once no row runs: the same
    tokens as that many separate steps, one dispatch. state and cache (the target's) are
    donated. Returns (cache, state, active `[B]` after it, the chunk's report `[B, 4 + 2N]`
    (N = steps_max): a row's kept tokens are its first `kept` columns, one per step it ran).
    Static: the target's `cfg`, `vocab_size`, `steps_max`, `ops`; seed, request_ids `[B]` and
    sampling are traced."""
    B = state.bonus.shape[0]
    active0, count0 = state.active, state.count

    # The loop carries whether to go on, computed at the end of a step, so the condition is a
    # read; the report's tokens are read from the state's buffer once, after the loop (a row
    # keeps one token a step until it ends, so its chunk's tokens are contiguous there).
    def step(c):
        i, _, st, cache = c
        with inside_step():  # traced into this step, not a call of its own
            tok, lp, cache = steps.decode(params, cfg, cache, st.bonus, st.active, seed,
                                          request_ids, sampling, vocab_size, ops=ops)
        st, _ = ds.commit(st, tok[:, None], lp[:, None], jnp.ones(B, jnp.int32))
        return i + 1, (i + 1 < steps_max) & jnp.any(st.active), st, cache

    init = (jnp.int32(0), jnp.any(active0), state, cache)
    _, _, state, cache = jax.lax.while_loop(lambda c: c[1], step, init)
    kept = state.count - count0
    toks, lps = ds.since(state, count0, steps_max, kept)
    return cache, state, state.active, ds.report(active0, kept, state, toks, lps)


SD_CHUNK = 8  # SD / SSD rounds per dispatch and report read, the draft on the target's mesh


@stored_jit(static_argnames=("tcfg", "dcfg", "vocab_size", "draft_vocab_size", "row_vocab", "k",
                             "verifier", "row_dtype", "tops", "dops", "rounds_max"),
            donate_argnames=("tcache", "dcache"))
def sd_chunk(tparams, tcfg, tcache, dparams, dcfg, dcache, state: ds.DecodeState, spec, rows,
             seed, draft_seed, request_ids, sampling, draft_sampling, *, vocab_size: int,
             draft_vocab_size: int, row_vocab: int, k: int, verifier, row_dtype: str = "float32",
             tops: Ops = XLA, dops: Ops = XLA, rounds_max: int = SD_CHUNK):
    """Up to `rounds_max` SD rounds in one `lax.while_loop`, which stops once no row runs: each
    round verifies the speculation (spec `[B, K]`, rows `[B, K, V]` with V = row_vocab) with
    `steps.verify`, commits its outcome (`commit_verify`'s rule and histograms) and drafts the
    next speculation from the new state with `steps.draft_chain` — the same calls, keys and
    tokens as that many rounds dispatched one by one, one dispatch. For a draft on the target's
    mesh (one device, or a colocated placement).

    tcache / dcache (the target's and the draft's KV caches) are donated; `state` is not, so a
    failure read late can roll back to it. Returns (tcache, dcache, state, active `[B]` after it,
    the next speculation (spec, rows), the chunk's report `[B, 4 + 2R]` (R = rounds_max): its
    kept column is the chunk's tokens per row and its token columns hold each round's kept count
    (a row ran round i iff that is > 0), log-prob columns 0). Static: both configs, the target's
    and the draft's `vocab_size`, `row_vocab`, `k`, `verifier`, `row_dtype`, both op tables and
    `rounds_max`; the verify's `seed` and the draft's `draft_seed` (each as its step takes it),
    request_ids `[B]`, `sampling` and `draft_sampling` are traced.
    """
    B = state.bonus.shape[0]
    active0, count0 = state.active, state.count

    def one_round(c):  # as decode_chunk's step: whether to go on is carried, the condition reads it
        i, _, st, tc, dc, spec, rows, per_round = c
        with inside_step():  # traced into this step, not calls of their own
            res, lp, tc = steps.verify(tparams, tcfg, tc, st.bonus, spec, rows, st.active, seed,
                                       request_ids, sampling, vocab_size, verifier, ops=tops)
            st = ds.count_accepts(st, res.num_accepted, st.active, None)  # commit_verify's rule
            st, k1 = ds.commit(st, res.tokens, lp, res.num_accepted + 1)
            nspec, nrows, dc = steps.draft_chain(
                dparams, dcfg, dc, st.prev, st.bonus, st.n, draft_seed, request_ids, draft_sampling,
                draft_vocab_size, k, (), 1.0, row_dtype, ops=dops)
        nrows = fit_rows(nrows, row_vocab).astype(rows.dtype)
        return (i + 1, (i + 1 < rounds_max) & jnp.any(st.active), st, tc, dc, nspec, nrows,
                jax.lax.dynamic_update_index_in_dim(per_round, k1, i, axis=1))

    init = (jnp.int32(0), jnp.any(active0), state, tcache, dcache, spec, rows,
            jnp.zeros((B, rounds_max), jnp.int32))
    _, _, state, tcache, dcache, spec, rows, per_round = jax.lax.while_loop(
        lambda c: c[1], one_round, init)
    rep = ds.report(active0, state.count - count0, state, per_round,
                    jnp.zeros((B, rounds_max), jnp.float32))
    return tcache, dcache, state, state.active, spec, rows, rep


@stored_jit(static_argnames=("tcfg", "dcfg", "vocab_size", "draft_vocab_size", "row_vocab", "k",
                             "verifier", "backup", "fanout_hit", "fanout_backup", "row_dtype",
                             "tops", "dops", "rounds_max"),
            donate_argnames=("tcache", "dcache"))
def ssd_chunk(tparams, tcfg, tcache, dparams, dcfg, dcache, state: ds.DecodeState, spec, rows,
              from_backup, counters: "LookupCounters", history, seed, draft_seed, request_ids,
              sampling, draft_sampling, saguaro_c, neural=None, *, vocab_size: int,
              draft_vocab_size: int,
              row_vocab: int, k: int, verifier, backup: str, fanout_hit: tuple[int, ...],
              fanout_backup: tuple[int, ...], row_dtype: str = "float32", tops: Ops = XLA,
              dops: Ops = XLA, rounds_max: int = SD_CHUNK):
    """Up to `rounds_max` SSD rounds in one `lax.while_loop`, which stops once no row runs. Each
    round is the four steps the device loop dispatches one by one, in their order and with their
    arguments: `steps.verify` of the speculation in flight (spec `[B, K]`, rows `[B, K, V]`, V =
    row_vocab), `tree.draft_tree` from the same speculation (from_backup `[B]` bool picks each
    row's fan-out), `commit_verify`'s commit, and `resolve` (lookup, backup for the rows that
    missed, counters, the n-gram history) — so the same keys, tokens and counters as those rounds,
    one dispatch. For a draft on the target's mesh (one device, or a colocated placement).

    tcache / dcache are donated; `state` is not (a failure read late rolls back to it). counters:
    `LookupCounters`; history `[B, H]` for the "ngram" backup, else None; neural: backup "auto"'s
    choice for every round of the chunk (a traced bool, `resolve`), else None. Returns (tcache,
    dcache, state, active `[B]`, the next speculation (spec, rows), from_backup, counters, history, the
    chunk's report `[B, 4 + 2R]` (R = rounds_max)): its kept column is the chunk's tokens per row,
    token column i the tokens a row kept in round i (> 0 iff it ran round i) and the last R
    columns, as int32, round i's hit code (-1: no lookup, 0: a miss, 1: a hit; not log-probs).
    Static: both configs, the target's and the draft's `vocab_size`, `row_vocab`, `k`,
    `verifier`, `backup`, both fan-out lists, `row_dtype`, both op tables and `rounds_max`; the
    seeds, request_ids `[B]`, both SamplingParams, Saguaro's `saguaro_c` and `neural` are traced.
    """
    from ssd_jax.algorithm.tree import draft_tree
    B = state.bonus.shape[0]
    active0, count0 = state.active, state.count
    top_hit = tuple(f + 1 for f in fanout_hit[:-1])
    top_backup = tuple(f + 1 for f in fanout_backup[:-1])

    def one_round(c):  # as sd_chunk's: whether to go on carried; each round's kept and hit in one
        i, _, st, tc, dc, spec, rows, fb, counters, history, per_round = c
        with inside_step():  # traced into this step, not calls of their own
            res, lp, tc = steps.verify(tparams, tcfg, tc, st.bonus, spec, rows, st.active, seed,
                                       request_ids, sampling, vocab_size, verifier, ops=tops)
            tree, dc = draft_tree(dparams, dcfg, dc, st.bonus, spec, st.n, st.active, fb,
                                  draft_seed, request_ids, draft_sampling, draft_vocab_size,
                                  fanout_hit, fanout_backup, top_hit, saguaro_c, row_dtype,
                                  ops=dops)
        st, _, _, packed = _commit_verify(st, res.num_accepted, res.bonus, res.tokens, lp, fb)
        k1 = packed[:, REPORT_START + ds.R_KEPT]
        spec, rows, fb, dc, counters, rep, _, history = resolve(
            dparams, dcfg, dc, tree, packed, counters, draft_seed, request_ids, draft_sampling,
            saguaro_c, history, neural, vocab_size=draft_vocab_size, row_vocab=row_vocab, k=k,
            backup=backup, saguaro_top_n=top_backup, row_dtype=row_dtype, ops=dops)
        per_round = jax.lax.dynamic_update_index_in_dim(
            per_round, jnp.stack([k1, rep[:, ds.R_HIT]], axis=1), i, axis=2)
        return (i + 1, (i + 1 < rounds_max) & jnp.any(st.active), st, tc, dc, spec, rows, fb,
                counters, history, per_round)

    # [B, 2, R]: each round's kept tokens (0: the row did not run it) and hit code (-1: none)
    per_round = jnp.stack([jnp.zeros((B, rounds_max), jnp.int32),
                           jnp.full((B, rounds_max), -1, jnp.int32)], axis=1)
    init = (jnp.int32(0), jnp.any(active0), state, tcache, dcache, spec, rows, from_backup,
            counters, history, per_round)
    (_, _, state, tcache, dcache, spec, rows, from_backup, counters, history,
     per_round) = jax.lax.while_loop(lambda c: c[1], one_round, init)
    rep = ds.report(active0, state.count - count0, state, per_round[:, 0],
                    jnp.zeros((B, rounds_max), jnp.float32))
    rep = rep.at[:, ds.R_TOKENS + rounds_max:].set(per_round[:, 1])
    return (tcache, dcache, state, state.active, spec, rows, from_backup, counters, history, rep)


@jax.jit
def round_view(state: ds.DecodeState, report: jax.Array) -> jax.Array:
    """The rows' round state and a report packed as an `Outcome` (no outcome: zeros), to move
    to the draft mesh in one transfer (the prefill's first round)."""
    z = jnp.zeros_like(state.n)
    return Outcome(num_accepted=z, bonus_out=z, n=state.n, prev=state.prev, bonus=state.bonus,
                   active=state.active, report=report).pack()


@jax.jit
def unpack(packed: jax.Array) -> Outcome:
    """`Outcome.unpack` as a step, on the mesh `packed` is on (the draft's)."""
    return Outcome.unpack(packed)


def _commit_verify(state: ds.DecodeState, num_accepted: jax.Array, bonus_out: jax.Array,
                   tokens: jax.Array, logprobs: jax.Array, from_backup: jax.Array | None = None):
    """A verify's outcome into `state` (donated): num_accepted `[B]`, bonus_out `[B]`, tokens
    `[B, K+1]` (accepted run, bonus, -1 padding), their log-probs `[B, K+1]`; from_backup `[B]`
    bool for SSD's after-hit / after-miss histograms (None: SD). Returns (state, active `[B]` and
    bonus `[B]` after it (as `commit_tokens`), the `Outcome` for the draft mesh, packed).
    `commit_verify_kept` leaves `state` valid: the pipelined loop keeps the state before a round
    it has not read yet."""
    active = state.active
    new = ds.count_accepts(state, num_accepted, active, from_backup)
    new, kept = ds.commit(new, tokens, logprobs, num_accepted + 1)
    rep = ds.report(active, kept, new, tokens, logprobs)
    out = Outcome(num_accepted=num_accepted, bonus_out=bonus_out, n=new.n, prev=new.prev,
                  bonus=new.bonus, active=new.active, report=rep)
    return new, new.active, new.bonus, out.pack()


commit_verify = jax.jit(_commit_verify, donate_argnames=("state",))
commit_verify_kept = jax.jit(_commit_verify)


@functools.partial(jax.jit, static_argnames=("code",), donate_argnames=("state",))
def end_rows(state: ds.DecodeState, rows: jax.Array, code: int):
    """`decode_state.end_rows` as a step: rows `[B]` bool the host ended get finish `code`."""
    return ds.end_rows(state, rows, code)


def fit_rows(rows: jax.Array, row_vocab: int) -> jax.Array:
    """Proposal rows `[..., V]` padded or cut to the target's `row_vocab` entries."""
    V = rows.shape[-1]
    if V == row_vocab:
        return rows
    if V > row_vocab:
        return rows[..., :row_vocab]
    return jnp.pad(rows, [(0, 0)] * (rows.ndim - 1) + [(0, row_vocab - V)])


@step_jit(static_argnames=("cfg", "vocab_size", "row_vocab", "k", "backup", "saguaro_top_n",
                           "row_dtype", "ops", "local_rows"),
          donate_argnames=("cache",))
def resolve(params, cfg, cache, tree: SpeculationCache, outcome: jax.Array,
            counters: LookupCounters, seed, request_ids, sampling, saguaro_c, history=None,
            neural=None, *, vocab_size: int, row_vocab: int, k: int, backup: str,
            saguaro_top_n: tuple[int, ...] = (), row_dtype: str = "float32", ops: Ops = XLA,
            local_rows: bool = False):
    """The next round's speculation from the realised outcome (docs/ALGORITHM.md §2, step 3).

    Looks `outcome` up in `tree` (the speculation cache drafted during the verify); rows that are
    still active and missed get a backup: `backup` "neural" drafts them with
    `steps.draft_chain(draft_rows=missed)` from their committed bonus — under `lax.cond`, so a
    round where every row hit drafts nothing —, "random" draws uniform tokens
    (`backups.random_speculation`) and "ngram" looks each row's history up
    (`backups.ngram_speculation_on_device`): history `[B, H]` int32, each row's tokens by
    position up to the last round's bonus, to which this round's committed tokens are added
    (`backups.record_committed`; None for the other backups). "auto" (`SSDConfig(backup="auto")`)
    runs the neural or the random backup as the traced scalar bool `neural` says (`lax.cond`: one
    compile serves both, and only the chosen one runs), so the host switches kinds between rounds
    without a recompile. Returns (spec `[B, K]`, rows
    `[B, K, V]` with V = row_vocab, missed `[B]` bool (the next round's from_backup), the draft
    cache (donated), counters, the round's report with its hit column, the outcome unpacked on
    the draft mesh (its n, prev, bonus, active: the next tree's round state), the history (None
    when none was given)). outcome: an `Outcome`, packed. Static: the draft's `cfg`, `vocab_size` (its real
    rows), `row_vocab` (the target's), `k`, `backup`, Saguaro's per-step `saguaro_top_n` for the
    backup, `row_dtype` and the draft's op table `ops`; seed, request_ids `[B]`, the draft's
    `sampling`, `saguaro_c` and `neural` are traced. `local_rows` (static): the rows are sharded
    over a data-parallel draft mesh, so nothing may reduce across them: the neural backup then
    drafts every round, not only a round where some row missed (`any` over the rows would be a
    collective between the shards), for the same tokens.
    """
    o = Outcome.unpack(outcome)
    if history is not None:
        history = backups.record_committed(history, o.report, o.n)
    hit, spec, rows = lookup(tree, o.num_accepted, o.bonus_out, ops=ops)
    rows = fit_rows(rows, row_vocab)
    missed = ~hit & o.active

    def chain(c):
        with inside_step():  # traced into this step, not a call of its own
            bspec, brows, c = steps.draft_chain(
                params, cfg, c, o.prev, o.bonus, o.n, seed, request_ids, sampling, vocab_size,
                k, saguaro_top_n, saguaro_c, row_dtype, ops=ops, draft_rows=missed)
        return bspec, fit_rows(brows, row_vocab).astype(rows.dtype), c

    def neural_backup(c):  # a round where every row hit drafts nothing (unless local_rows)
        if local_rows:  # whether any row missed is a reduction across the shards
            return chain(c)
        return jax.lax.cond(jnp.any(missed), chain, lambda c: (spec, rows, c), c)

    def uniform(c):
        bspec, brows = backups.random_speculation(seed, request_ids, o.n, k=k,
                                                  vocab_size=vocab_size, row_vocab=row_vocab,
                                                  row_dtype=row_dtype)
        return bspec, brows.astype(rows.dtype), c

    kind = BACKUP_INDEX.get(backup, 0)
    if backup == "neural":
        bspec, brows, cache = neural_backup(cache)
    elif backup == "random":
        bspec, brows, cache = uniform(cache)
    elif backup == "auto":
        if neural is None:
            raise ValueError("backup 'auto' on the device needs the round's choice (neural)")
        neural = jnp.asarray(neural, bool)
        bspec, brows, cache = jax.lax.cond(neural, neural_backup, uniform, cache)
        kind = jnp.where(neural, BACKUP_INDEX["neural"], BACKUP_INDEX["random"])
    elif backup == "ngram":
        if history is None:
            raise ValueError("backup 'ngram' on the device needs the rows' history")
        bspec, brows = backups.ngram_speculation_on_device(
            history, seed, request_ids, o.n, k=k, vocab_size=vocab_size, row_vocab=row_vocab,
            row_dtype=row_dtype)
    else:
        raise ValueError(f"backup {backup!r} has no device form (neural, random, ngram, auto)")
    spec = jnp.where(missed[:, None], bspec, spec)
    rows = jnp.where(missed[:, None, None], brows.astype(rows.dtype), rows)
    looked = jax.nn.one_hot(o.num_accepted, k + 1, dtype=jnp.int32) * o.active[:, None]
    served = jax.nn.one_hot(kind, len(BACKUP_INDEX), dtype=jnp.int32) * missed[:, None]
    counters = LookupCounters(
        lookups_by_accept=counters.lookups_by_accept + looked,
        hits_by_accept=counters.hits_by_accept + looked * hit[:, None],
        backups=counters.backups + served)
    return (spec, rows, missed, cache, counters, ds.with_hits(o.report, hit, o.active),
            o.replace(report=jnp.zeros((), jnp.int32)), history)


@jax.jit
def pass_report(report: jax.Array, spec: jax.Array) -> jax.Array:
    """SD: the round's report, made to wait for the next speculation `spec` `[B, K]` (drafted on
    the draft mesh), so the host's one fetch of a round also surfaces a draft failure before the
    next verify is dispatched. spec is never negative; the select keeps the dependency, row by
    row (no reduction across rows: on a data-parallel draft that would be a collective)."""
    return jnp.where(jnp.any(spec < -1, axis=1, keepdims=True), -1, report)
