"""The round loop with the call's state on the device: one fetch per round, no per-row Python.

`Engine.generate` runs every call here. The
call's per-row state is a `DecodeState` on the target mesh; the jitted steps advance it
(`ssd_jax.algorithm.round_steps`); the draft's side of a round (lookup, backup, next tree) runs on
the draft mesh from the verify's `Outcome`, moved device to device. The host dispatches each round
and reads one small array, the round's `report`: it says which rows are still running and carries
the round's tokens, which the host needs only for `on_tokens` / `stream()` and stop strings (then a
row's tokens pass through `Batch.emit`, per row that committed).

Timed (`timeline=True`): each round is read before the next is dispatched and the host waits
between its phases, so the timeline has each round's verify, draft and backup seconds (as the host
loop's): what `predicted_speedup` and `fanout="plan"` come from.

Pipelined (unless rows pass through the host, or timed): the host enqueues round T+1 before it
reads round T's report, so the device has a round queued while the host reads and dispatches; the
round enqueued after the last one is void and dropped. The round's last array read is the draft's, so a failure
on the draft's device surfaces at that read; round T+1's verify has then taken the target's KV
cache, so the call rolls back to the state before round T+1 and re-prefills the target's cache
(`recover`) before it falls back to plain decoding (`ssd_jax.runtime.fallback`).

Meshes over several processes (multi-controller JAX on the CPU, `placement.spans_processes`):
every process runs this same loop, each step is waited for where it is dispatched (`serial`: two
computations in flight could meet their gloo collectives in another order on each process), no
round is enqueued ahead, and a read is of the array's global value (`placement.to_host`).

A draft in another process (`ssd_jax.runtime.transport.RemoteDraft`) has the same methods: its
`first`, `propose_from` and `resolve_on_device` send the round's packed `Outcome` (one read) and
return its reply, the next speculation, as host arrays; so its rounds are not pipelined.

One SSD round, as the host dispatches it (nothing waits until the last line):

    verify(T)            target: K+1-token pass + rejection sampling   (steps.verify)
    tree(T)              draft: glue, fork, branch decode from the speculation in flight
    commit_verify(T)     target: tokens into the state, accept counts, the Outcome
    resolve(T)           draft: lookup, backup for the missed rows (lax.cond), counters, report
    fetch report(T-1)    the one device->host read of the round (report(T) unpipelined)

SD: verify(T), commit_verify(T), draft_chain(T+1) from the new state, then the report (made to
wait for that speculation) is read. With the draft on the target's own mesh (and
`Engine.round_chunks`), `sd_chunk` / `ssd_chunk` run up to `round_steps.SD_CHUNK` such rounds
(SSD's four steps above, in that order) in one dispatch and one read
(`ssd_jax.runtime.round_chunks`, whose methods `DeviceLoop` inherits). AR: decode_chunk (up to
16 tokens in one while_loop), read; decode, commit_tokens, read per token when the host needs
each token. The reads themselves (a report applied on the host, the call's state and counters
at its end) are `ssd_jax.runtime.round_reports`', inherited too.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from ssd_jax.algorithm import backups
from ssd_jax.algorithm import decode_state as ds
from ssd_jax.algorithm import round_steps as rs
from ssd_jax.algorithm import steps
from ssd_jax.algorithm.verify import rejection_sample
from ssd_jax.models.protocol import init_cache, is_builtin
from ssd_jax.runtime.auto_backup import AutoBackup
from ssd_jax.runtime.config import CallConfig
from ssd_jax.runtime.draft_worker import DraftWorker, RoundState
from ssd_jax.runtime.metrics import CompileTimer, Metrics
from ssd_jax.runtime.placement import move, to_mesh
from ssd_jax.runtime.proposer import check_rows
from ssd_jax.runtime.request import prefill_once, right_padded
from ssd_jax.runtime.round_chunks import RoundChunks
from ssd_jax.runtime.round_reports import RoundReports
from ssd_jax.runtime.sharding import init_target_cache

_record_committed = jax.jit(backups.record_committed)  # a proposer's history, each round


class DeviceLoop(RoundChunks, RoundReports):
    """One generate call's device state and its rounds (made by `Engine.generate`)."""

    def __init__(self, engine, batch, call: CallConfig, metrics: Metrics, k: int,
                 timer: CompileTimer, timed: bool = False):
        self.e, self.batch, self.call, self.m = engine, batch, call, metrics
        self.timer = timer  # the call's compile seconds: a round that compiled is marked so
        self.timed = timed  # timeline=True: rounds read one by one, their phases timed
        self.phases: dict[str, float] = {}  # a timed round's phase seconds, set by its dispatch
        # SD's drafter is a proposer (not the draft model): it reads the rows' history, kept
        # here on the target mesh from the prompt block and each round's report
        self.remote = getattr(engine.worker, "remote", False)  # a draft in another process
        # meshes over several processes: each step is waited for where it is dispatched, written
        # out as `if self.serial: jax.block_until_ready(...)` rather than `placement.settle`,
        # whose call would be host work every round on every other mesh
        self.serial = engine._serial
        self.proposer = (engine.worker is not None and not self.remote
                         and not isinstance(engine.worker, DraftWorker))
        self.history = None  # [B, cache_len] int32, a proposer's
        self.prompt_block = None  # [B, T] the prompts as prefilled (host), for the history
        self.tgt = engine.placement.target
        self.tcache = None  # the target's KV cache, this call's (`_prefill_target`); donated
        # the call's traced values on the target mesh, placed once (the draft places its own)
        self.rids_t = to_mesh(np.asarray(call.request_ids, np.int32), self.tgt)
        self.seed_t = to_mesh(np.int32(call.seed), self.tgt)
        self.sampling_t = to_mesh(call.target_sampling, self.tgt)
        self.verifier = call.verifier or rejection_sample
        # Tokens pass through the host per round only where the host has work for them.
        self.mirror = batch.on_tokens is not None or bool(batch.stop)
        self.state = to_mesh(ds.initial_state(batch.prompts, batch.max_new, sorted(batch.eos), k,
                                              rows=batch.rows), self.tgt)
        self.active = None  # [B] bool on the target mesh, after the last commit
        self.running = True  # from the last report read
        self.pending = None  # a target-side report not read yet (read if the draft fails)
        self.pending_packed = False  # whether `pending` is a packed Outcome (SD, SSD rounds)
        self.backup = "neural"  # SSD's backup kind (the call's, or auto's of the round read)
        self.auto = None  # SSD's AutoBackup under backup="auto" (set by `ssd`)
        self.lost = False  # pipelined: a draft failure left the target's KV cache lost (`recover`)
        self.count = np.zeros(batch.size, np.int64)  # tokens per row, from the reports read
        self.alive = batch.active  # rows running after the last report read (no padding row)
        self.t1 = None  # AR: the median step of the call's rounds that compiled nothing
        self.uncounted = dict(lookups_by_accept=np.zeros(k + 1, np.int64),
                              hits_by_accept=np.zeros(k + 1, np.int64),
                              backups=np.zeros(len(rs.BACKUP_INDEX), np.int64))

    @property
    def state(self) -> ds.DecodeState:
        """The call's `DecodeState` on the target mesh."""
        return self._state

    @state.setter
    def state(self, new: ds.DecodeState) -> None:
        # A new state voids the bonus kept beside it; a commit step assigns the bonus it returns
        # right after (`self.state, self.active, self._bonus, ... = ...`, left to right).
        self._state, self._bonus = new, None

    @property
    def bonus(self) -> jax.Array:
        """`[B]` the state's bonus tokens: the one a commit step returned, or, after a rollback
        or a chunk, sliced from the state once (on the host that slice is an op of its own, which
        the per-round paths would otherwise dispatch every round)."""
        if self._bonus is None:
            self._bonus = self._state.bonus
        return self._bonus

    # ------------------------------------------------------------------ prefill
    def _prefill_target(self, cache_len: int):
        """The call's target KV cache (`self.tcache`, `cache_len` slots a row) and its prefill,
        dispatched, not waited for: returns the first token `[B]` and its log-prob `[B]` on the
        target mesh, and the prompts right-padded to the prefill bucket `[B, T]` (host), which
        the draft's prefill takes."""
        e, b = self.e, self.batch
        toks = right_padded(b.prompts)  # nothing generated yet: the history's rows
        lens = b.prompt_lens
        prefill, rows = steps.prefill, slice(None)
        if prefill_once(e.tcfg, e.placement.tp, toks, lens):  # one prompt in every row
            prefill, rows = steps.prefill_shared, slice(0, 1)
        first, lp, self.tcache = prefill(
            e.tparams, e.tcfg, self._new_target_cache(b.size, cache_len),
            to_mesh(toks[rows], self.tgt), to_mesh(lens[rows], self.tgt), self.seed_t,
            self.rids_t, self.sampling_t, e.vocab_size, ops=e.tops)
        if self.serial:
            jax.block_until_ready((first, lp, self.tcache))
        return first, lp, toks

    def _refill_target(self, rows, cache_len: int):
        """A fresh target cache holding the KV of `rows` (each row's tokens before its bonus, as
        after any round): a cache-only prefill, dispatched. For a call whose cache was lost."""
        e = self.e
        lens = np.asarray([len(r) for r in rows], np.int32)
        return steps.prefill_cache(e.tparams, e.tcfg, self._new_target_cache(len(rows), cache_len),
                                   to_mesh(right_padded(rows, cache_len), self.tgt),
                                   to_mesh(lens, self.tgt), ops=e.tops)

    def _new_target_cache(self, batch: int, cache_len: int):
        """An empty KV cache for the target, laid out on its mesh."""
        cfg, placement = self.e.tcfg, self.e.placement
        if is_builtin(cfg):
            return init_target_cache(cfg, batch, cache_len, placement.target_mesh)
        return init_cache(cfg, batch, cache_len, placement.target)

    def prefill(self, cache_len: int, draft) -> None:
        """The target's prefill and its first token committed on the device; the draft's
        prefill dispatched. The first token's report is read by the first round (SD / SSD) or
        here (AR)."""
        e, b = self.e, self.batch
        t0 = time.perf_counter()
        first, lp, toks = self._prefill_target(cache_len)
        self.prompt_block, self.cache_len = toks, cache_len
        if draft is not None:
            draft.start(toks, b.prompt_lens, cache_len)
        self.state, self.active, self._bonus, self.pending = rs.commit_tokens(
            self.state, first, lp)
        if self.serial:
            jax.block_until_ready(self.pending)
        try:
            if draft is not None and hasattr(e.worker, "ready"):
                draft.ready()
            if draft is None:
                self.read(self.pending)
        finally:
            self.m.prefill_s = time.perf_counter() - t0

    def warm_round(self, cache_len: int, ssd: bool) -> None:
        """The target's side of a throwaway round 1 (`Engine.warm_up`), each step waited for:
        the prefill and the commit of its token, the rows' view, a verify of K zeros and its
        commit (SSD's with from_backup), as this loop runs them."""
        e, B, k = self.e, self.batch.size, self.call.k
        first, lp, _ = self._prefill_target(cache_len)
        self.state, self.active, self._bonus, report = rs.commit_tokens(self.state, first, lp)
        jax.block_until_ready(rs.round_view(self.state, report))
        V = e.target.cfg.vocab_size
        res, lp = self._verify(np.zeros((B, k), np.int32),
                               np.full((B, k, V), 1.0 / V, jax.numpy.dtype(self.call.row_dtype)))
        jax.block_until_ready(self._commit(res, lp, to_mesh(np.ones(B, bool), self.tgt)
                                           if ssd else None))

    # ------------------------------------------------------------------ loops
    @property
    def pipelined(self) -> bool:
        """Whether rounds are dispatched one ahead of the host's read (module docstring): when
        no row's tokens pass through the host per round (no callback, no stop string), the
        rounds are not timed and the draft is in this process (a remote draft's next
        speculation is its reply to the round's outcome: nothing is left to enqueue)."""
        return not self.mirror and not self.timed and not self.remote and not self.serial

    def ar(self, measure: bool = True) -> None:
        """Plain decoding. Pipelined (no row's tokens pass through the host): chunks of up to
        `round_steps.AR_CHUNK` steps, one dispatch and one read each, chunk c+1 dispatched before
        chunk c's report is read. Otherwise decode + commit per token, one read each (token t+1
        dispatched before token t's report is read)."""
        if self.pending is not None:
            self.read(self._pending_report())
        if self.pipelined:
            self._ar_chunks()
        else:
            self._ar_tokens()
        steady = [r.round_s for r in self.m.timeline if not r.compiled]
        if steady and measure:
            self.t1 = float(np.median(steady))

    def _ar_chunks(self) -> None:
        """AR's chunks (`ar`). A chunk dispatched after the last one (an EOS ended every row)
        runs no step: the state it returns is the one it took."""
        e, N = self.e, rs.AR_CHUNK
        prev = None  # the report of the chunk dispatched and not read yet
        t0, c0 = time.perf_counter(), self.timer.seconds
        while self.running:
            self.tcache, self.state, self.active, rep = rs.decode_chunk(
                e.tparams, e.tcfg, self.tcache, self.state, self.seed_t, self.rids_t,
                self.sampling_t, vocab_size=e.vocab_size, steps_max=N, ops=e.tops)
            if prev is not None:
                self._chunk_read(prev, t0, c0)
                prev = None
                t0, c0 = time.perf_counter(), self.timer.seconds
                if not self.running:
                    break
            if self._ahead(N):
                prev = rep
                continue
            self._chunk_read(rep, t0, c0)
            t0, c0 = time.perf_counter(), self.timer.seconds

    def _chunk_read(self, rep, t0: float, c0: float) -> None:
        """Read a chunk's report; the timeline gets one entry per step it ran (a row ran step i
        iff it kept more than i tokens), the chunk's wall split evenly among them."""
        kept = self.read(rep)[:, ds.R_KEPT]
        ran = int(kept.max()) if kept.size else 0
        self._chunk_rounds([dict(active=int((kept > i).sum()), tokens=int((kept > i).sum()))
                            for i in range(ran)], t0, c0)

    def _ar_tokens(self) -> None:
        """AR one token a dispatch (`ar`), for rows whose tokens pass through the host."""
        e = self.e
        prev = None  # the report of the token dispatched and not read yet
        t0, c0 = time.perf_counter(), self.timer.seconds
        while self.running:
            tok, lp, self.tcache = steps.decode(
                e.tparams, e.tcfg, self.tcache, self.bonus, self.active, self.seed_t,
                self.rids_t, self.sampling_t, e.vocab_size, ops=e.tops)
            if self.serial:
                jax.block_until_ready(tok)
            self.state, self.active, self._bonus, rep = rs.commit_tokens(self.state, tok, lp)
            if self.serial:
                jax.block_until_ready(rep)
            if prev is not None:
                self.read(prev)
                prev = None
                self._round(t0, c0, active=self.last["active"])
                t0, c0 = time.perf_counter(), self.timer.seconds
                if not self.running:
                    break  # the token read late ended the call: the one in flight is void
            if self._ahead(1):
                prev = rep  # the next token is needed whatever this one is: read it later
                continue
            self.read(rep)
            self._round(t0, c0, active=self.last["active"])
            t0, c0 = time.perf_counter(), self.timer.seconds

    def _ahead(self, per_round: int) -> bool:
        """Whether to enqueue the next round before reading the one in flight: pipelined, and
        some row still running needs more than `per_round` tokens (the most one round commits),
        so the next round is needed whatever this one commits (barring an EOS). Near the end of
        the budget the loop reads each round first, so a call ending on its budget runs no void
        round."""
        return self.pipelined and bool(np.any(self.alive & (self.batch.max_new - self.count
                                                            > per_round)))

    def _next_proposal(self, draft, packed):
        """SD's next speculation from a round's packed `Outcome` (round 1: the rows after the
        prefill, `round_steps.round_view`): (spec `[B, K]`, rows `[B, K, V]`, the report the host
        reads, made to wait for the speculation where it is in flight). A proposer's comes from
        the rows' history on the target mesh, brought up to the outcome first."""
        if not self.proposer:
            spec, rows, v = draft.propose_from(packed, self.call)
            if self.serial:
                jax.block_until_ready((spec, rows, v))
            return spec, rows, v.report if self.remote else rs.pass_report(v.report, spec)
        v = rs.unpack(packed)
        if self.history is None:
            self.history = backups.start_history(
                to_mesh(self.prompt_block, self.tgt), v.report, v.n, self.cache_len)
        else:
            self.history = _record_committed(self.history, v.report, v.n)
        if self.serial:
            jax.block_until_ready((v, self.history))
        spec, rows = draft.propose(RoundState.of_outcome(v, self.history), self.call)
        if self.serial:
            jax.block_until_ready((spec, rows))
        check_rows(rows, self.batch.size, self.call.k, self.e.target.cfg.vocab_size)
        return spec, rows, rs.pass_report(v.report, spec)

    def _verify(self, spec, rows):
        """Dispatch the verify of the speculation (spec `[B, K]`, rows `[B, K, V]`, on the draft
        mesh) against the state's bonus: returns (VerifyResult, log-probs), in flight."""
        e = self.e
        tspec = move(spec, self.tgt)
        trows = move(rows, e.placement.target_rows(rows.shape[-1]))
        res, lp, self.tcache = steps.verify(
            e.tparams, e.tcfg, self.tcache, self.bonus, tspec, trows, self.active, self.seed_t,
            self.rids_t, self.sampling_t, e.vocab_size, self.verifier, ops=e.tops)
        if self.serial:
            jax.block_until_ready((res, lp))
        return res, lp

    def _commit(self, res, lp, from_backup=None):
        """The verify's outcome into the state; its packed `Outcome` is the unread report.
        Pipelined, the state before it stays valid (a failure rolls back to it)."""
        commit = rs.commit_verify_kept if self.pipelined else rs.commit_verify
        self.state, self.active, self._bonus, packed = commit(
            self.state, res.num_accepted, res.bonus, res.tokens, lp, from_backup)
        if self.serial:
            jax.block_until_ready(packed)
        self.pending, self.pending_packed = packed, True
        return packed

    def _rounds(self, dispatch, during: str, ssd: bool = False, keep=lambda: None,
                restore=lambda kept: None) -> None:
        """SD's and SSD's rounds: `dispatch()` enqueues one round and returns (its packed Outcome
        on the target mesh, its report on the draft mesh, made to wait for the next speculation).

        Pipelined, round T+1 is enqueued before round T's report is read, so the device works
        while the host reads and dispatches — while some row is sure to need round T+1
        (`_ahead`). A round enqueued after the last one (rows ended by EOS early) is void: it
        commits nothing; its state and the draft's counters are dropped for the ones before it
        (`keep` / `restore`). A draft failure, read late or raised while
        round T+1 was enqueued, rolls the state back to before round T+1, whose verify may have
        taken the target's KV cache with it: `recover` rebuilds that cache."""
        from ssd_jax.runtime.fallback import DraftDown
        prev = None  # (packed, report, state before it, keep()) of a round dispatched, not read
        void = None
        t0, c0 = time.perf_counter(), self.timer.seconds
        while self.running:
            before, kept = self.state, keep()
            try:
                packed, rep = dispatch()
                cur = (packed, rep, before, kept)
                if prev is not None:
                    self.pending = prev[0]  # the target's side of the round read now
                    self._round_read(prev[1], during, t0, c0, ssd)
                    prev = None
                    t0, c0 = time.perf_counter(), self.timer.seconds
                    if not self.running:
                        void = cur
                        break
                if self._ahead(self.call.k + 1):
                    prev = cur
                    continue
                self.pending = packed
                self._round_read(rep, during, t0, c0, ssd)
            except DraftDown:
                if prev is not None:  # a round went in after one not read: back to before it
                    self.state, self.active, self.pending = before, before.active, None
                    self.lost = True
                raise
            t0, c0 = time.perf_counter(), self.timer.seconds
        if void is not None:  # enqueued after the last round: it committed nothing
            self.state, self.pending = void[2], None
            self.active = self.state.active
            restore(void[3])

    def _round_read(self, rep, during: str, t0: float, c0: float, ssd: bool) -> None:
        """Read one SD / SSD round's report and add the round to the timeline (and, under
        backup="auto", to what `AutoBackup` chooses from)."""
        if self.auto is not None:
            self.backup = self.auto.pending_kind  # the kind `read` takes back lookups of
        r = self.read_draft(rep, during)
        phases = self._phases(ssd) if self.timed else {}
        entry = self._round(t0, c0, **self._round_counts(ssd), **phases)
        for name, seconds in phases.items():
            if name != "exchange_s":  # a remote draft's, in the timeline only
                setattr(self.m, name, getattr(self.m, name) + seconds)
        if self.auto is not None:
            self.auto.read(r, entry)

    def _phases(self, ssd: bool) -> dict[str, float]:
        """The timed round's phases as its timeline entry takes them: SSD's resolve counts as
        backup time only in a round whose lookup missed a row."""
        phases = dict(self.phases)
        if ssd and self.last["hit"] == self.last["lookups"]:
            phases["backup_s"] = 0.0
        return phases

    def _wait(self, x) -> float:
        """A timed round's phase end: `x` waited for; the time now."""
        jax.block_until_ready(x)
        return time.perf_counter()

    def _round_counts(self, ssd: bool) -> dict:
        c = dict(active=self.last["active"])
        if ssd:
            c.update(hit=self.last["hit"], lookups=self.last["lookups"])
        return c

    def recover(self, cache_len: int) -> None:
        """After a draft failure read one round late: the target's KV cache went into the verify
        of the round after it, so it is rebuilt from the committed tokens (the state before that
        round): a cache-only prefill of each row's tokens before its bonus, as after any round."""
        if not self.lost:
            return
        b = self.batch
        self.lost = False
        self.sync_host()
        # the host's counts follow the state rolled back to (its last report was never read)
        self.count = np.asarray([len(g) for g in b.generated], np.int64)
        self.alive = np.asarray([f == ds.FINISH_NAMES[ds.RUNNING] for f in b.finish])
        self.running = bool(self.alive.any())
        self.tcache = self._refill_target([h[:-1] for h in b.history], cache_len)
        self.active = self.state.active

    def sd(self, draft) -> None:
        """SD: the draft chain from the committed state, verify, commit; the report read waits
        for the next speculation too."""
        self.m.init_hist(self.call.k)
        view = rs.round_view(self.state, self.pending)  # round 1's: the rows after the prefill
        if self.serial:
            jax.block_until_ready(view)
        spec, rows, rep = self._next_proposal(draft, view)
        self.read_draft(rep, "propose")
        if self._chunked(draft) and self._sd_chunks(draft.worker, spec, rows):
            draft.finish()
            self.counters_into(self.m)
            return

        def dispatch():
            nonlocal spec, rows
            t0 = time.perf_counter() if self.timed else 0.0
            res, lp = self._verify(spec, rows)
            packed = self._commit(res, lp)
            t1 = self._wait(packed) if self.timed else 0.0
            spec, rows, rep = self._next_proposal(draft, packed)  # waited for when timed
            if self.timed:
                self.phases = dict(verify_s=t1 - t0, draft_s=time.perf_counter() - t1)
            return packed, rep

        self._rounds(dispatch, "propose")
        draft.finish()
        self.counters_into(self.m)

    def ssd(self, draft, chooser=None) -> None:
        """SSD: verify and the tree overlap; the lookup and backup run on the draft mesh.
        chooser: backup="auto"'s `BackupChooser` (then each round's or chunk's backup is chosen
        at its dispatch, `AutoBackup`), or None."""
        worker, call = self.e.worker, self.call
        self.backup = "neural" if call.backup == "auto" else call.backup  # auto's round 1
        self.auto = AutoBackup(chooser) if chooser is not None else None
        # round 1 has no speculation cache yet: a backup (`first` zeroes the lookup counters)
        view = rs.round_view(self.state, self.pending)
        if self.serial:
            jax.block_until_ready(view)
        spec, rows, v = draft.first(view, call)
        if self.serial:
            jax.block_until_ready((spec, rows, v))
        self.read_draft(v.report if self.remote else rs.pass_report(v.report, spec), "first")
        ones = np.ones(self.batch.size, bool)
        if self._chunked(draft) and self._ssd_chunks(worker, RoundState.of_outcome(v), spec, rows,
                                                     ones):
            draft.finish()
            self.counters_into(self.m, worker.counters)
            return
        from_backup = to_mesh(ones, self.tgt)
        from_backup_d = ones if self.remote else to_mesh(ones, worker.rows)

        def dispatch():
            nonlocal spec, rows, from_backup, from_backup_d, v
            t0 = time.perf_counter() if self.timed else 0.0
            res, lp = self._verify(spec, rows)
            # overlaps the verify (a remote draft dispatched it after its last reply)
            draft.dispatch_tree(RoundState.of_outcome(v), spec, from_backup_d, call)
            packed = self._commit(res, lp, from_backup)
            if self.timed:  # the outcome, then the tree: T_v and T_p from the round's start
                t1 = self._wait(packed)
                draft.tree_ready()
                t2 = time.perf_counter()
            neural = self.auto.next() if self.auto is not None else None
            spec, rows, from_backup_d, rep, v = draft.resolve_on_device(packed, call, neural)
            if self.serial:
                jax.block_until_ready((spec, rows, from_backup_d, rep, v))
            if self.timed:  # resolve waited for (`Guarded`): the lookup and any backup
                self.phases = dict(verify_s=t1 - t0, draft_s=t2 - t0,
                                   backup_s=time.perf_counter() - t2)
                if self.remote:  # as the draft process timed them
                    t = worker.times
                    self.phases.update(draft_s=t.get("tree_s", 0.0), backup_s=t["resolve_s"],
                                       exchange_s=t["exchange_s"])
            from_backup = move(from_backup_d, self.tgt)
            return packed, rep

        def restore(counters):
            worker.counters = counters

        self._rounds(dispatch, "resolve", ssd=True, keep=lambda: worker.counters, restore=restore)
        draft.finish()
        self.counters_into(self.m, worker.counters)
