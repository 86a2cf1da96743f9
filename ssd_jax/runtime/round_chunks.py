"""SD and SSD in chunks of rounds on one mesh: the device loop's `RoundChunks` part.

With the draft on the target's own mesh (one device, or a colocated placement), nothing
streaming, and `Engine.round_chunks` on (by default off a CPU), `round_steps.sd_chunk` /
`ssd_chunk` run up to `round_steps.SD_CHUNK` rounds in one `lax.while_loop`: one dispatch and one
report read for up to 8 rounds, chunk c+1 enqueued before chunk c is read. `DeviceLoop`
(`ssd_jax.runtime.device_loop`) inherits these methods; they use its state, reads and rollback.
"""
from __future__ import annotations

import functools
import time

import jax
import numpy as np

from ssd_jax.algorithm import decode_state as ds
from ssd_jax.algorithm import round_steps as rs
from ssd_jax.runtime.draft_worker import DraftWorker, RoundState
from ssd_jax.runtime.metrics import RoundTimes
from ssd_jax.runtime.placement import to_mesh


class RoundChunks:
    """The chunked rounds of a `DeviceLoop` (module docstring)."""

    def _chunk_rounds(self, rounds, t0: float, c0: float) -> list[RoundTimes]:
        """The timeline's entries for a chunk read: one per dict of `RoundTimes` counts (active,
        tokens; SSD's hit, lookups) in `rounds`, the chunk's wall since t0 split evenly among
        them. Returns the entries."""
        wall, compiled = time.perf_counter() - t0, self.timer.seconds > c0
        added = [RoundTimes(**counts, round_s=wall / len(rounds), compiled=compiled)
                 for counts in rounds]
        for r in added:
            self.m.add_round(r)
        return added

    def _chunked(self, draft) -> bool:
        """Whether SD / SSD run in chunks of rounds (`round_steps.sd_chunk` / `ssd_chunk`): the
        engine's `round_chunks` (None: not on a CPU), pipelined, and the draft (`draft.worker`,
        behind the call's `fallback.Guarded`) is this process's `DraftWorker` on the target's own
        mesh (one device: colocated, or split on a single device)."""
        p, w = self.e.placement, getattr(draft, "worker", None)
        want = self.e.round_chunks
        if want is None:
            want = not p.on_cpu
        return (want and self.pipelined and type(w) is DraftWorker and w.cache is not None
                and p.target_mesh is p.draft_mesh and jax.process_count() == 1)

    def _chunk_loop(self, dispatch, read, tokens_max: int) -> bool:
        """Chunks of rounds, one dispatch and one read each, chunk c+1 dispatched before chunk
        c's report is read (as AR's `_ar_chunks`) while some row needs more than `tokens_max`
        tokens (a chunk's most). `dispatch()` enqueues one chunk (it sets the state and the
        caches) and returns its report; `read(rep, t0, c0)` reads one. A chunk dispatched after
        the last round runs none. Returns False, having run nothing, when the first chunk fails
        to compile (the rounds then go one by one, where a failure is the draft's or the
        target's by its step). The state is not donated: a failure read late (either model's:
        one computation here) is contained as the draft's, and rolls back to the state before
        the chunk in flight, whose verify took the target's KV cache (`recover`); a target that
        really failed fails again in the fallback's plain decoding."""
        from ssd_jax.runtime.fallback import DraftDown
        prev = None  # (report, state before it) of the chunk dispatched and not read yet
        t0, c0 = time.perf_counter(), self.timer.seconds
        first = True
        while self.running:
            before = self.state
            try:
                try:
                    rep = dispatch()
                except Exception:  # noqa: BLE001 - raised before anything ran: nothing donated
                    if not first:
                        raise
                    return False
                first = False
                if prev is not None:
                    read(prev[0], t0, c0)
                    prev = None
                    t0, c0 = time.perf_counter(), self.timer.seconds
                    if not self.running:
                        break
                if self._ahead(tokens_max):
                    prev = (rep, before)
                    continue
                read(rep, t0, c0)
            except DraftDown:
                back = prev[1] if prev is not None else before
                self.state, self.active, self.pending = back, back.active, None
                self.lost = True  # the chunk's verify took the target's KV cache with it
                raise
            t0, c0 = time.perf_counter(), self.timer.seconds
        return True

    def _chunk_inputs(self, draft: DraftWorker, spec, rows) -> tuple:
        """What every chunk of the call takes besides the state and caches: the draft's seed and
        sampling on its mesh, and the first speculation (spec `[B, K]`, rows `[B, K, V]`) on the
        target's."""
        dseed, _ = draft._call_values(self.call)
        return (dseed, draft._placed_sampling(self.call.draft_sampling), to_mesh(spec, self.tgt),
                to_mesh(rows, self.e.placement.target_rows(rows.shape[-1])))

    def _sd_chunks(self, draft: DraftWorker, spec, rows) -> bool:
        """SD's rounds in chunks of up to `round_steps.SD_CHUNK` (`_chunk_loop`)."""
        e, call, N = self.e, self.call, rs.SD_CHUNK
        dseed, dsampling, tspec, trows = self._chunk_inputs(draft, spec, rows)

        def dispatch():
            nonlocal tspec, trows
            out = rs.sd_chunk(
                e.tparams, e.tcfg, self.tcache, draft.params, draft.cfg, draft.cache, self.state,
                tspec, trows, self.seed_t, dseed, self.rids_t, self.sampling_t, dsampling,
                vocab_size=e.vocab_size, draft_vocab_size=draft.vocab_size,
                row_vocab=draft.row_vocab, k=call.k, verifier=self.verifier,
                row_dtype=call.row_dtype, tops=e.tops, dops=draft.ops, rounds_max=N)
            self.tcache, draft.cache, self.state, self.active, tspec, trows, rep = out
            return rep

        return self._chunk_loop(dispatch, functools.partial(self._rounds_read, ssd=False),
                                N * (call.k + 1))

    def _rounds_read(self, rep, t0: float, c0: float, *, ssd: bool) -> None:
        """Read a chunk's report (a failed chunk raises here: DraftDown, the fallback); the
        timeline gets one entry per round it ran (the rows that kept tokens in it, and for SSD
        its hits and lookups from the report's last columns, `round_steps.ssd_chunk`), the
        chunk's wall split evenly among them."""
        r = self.read_draft(rep, "resolve" if ssd else "propose")
        N = rs.SD_CHUNK
        per_round = r[:, ds.R_TOKENS:ds.R_TOKENS + N]
        ran = int((per_round > 0).any(axis=0).sum())
        rounds = [dict(active=int((per_round[:, i] > 0).sum()), tokens=int(per_round[:, i].sum()))
                  for i in range(ran)]
        if ssd:
            hits = r[:, ds.R_TOKENS + N:]
            for i, counts in enumerate(rounds):
                counts.update(hit=int((hits[:, i] > 0).sum()), lookups=int((hits[:, i] >= 0).sum()))
        added = self._chunk_rounds(rounds, t0, c0)
        if ssd and self.auto is not None and ran:
            self.auto.read_chunk(per_round[:, :ran], hits[:, :ran], added)

    def _ssd_chunks(self, draft: DraftWorker, v: RoundState, spec, rows, from_backup) -> bool:
        """SSD's rounds in chunks of up to `round_steps.SD_CHUNK` (`round_steps.ssd_chunk`,
        `_chunk_loop`) from the first speculation (spec, rows) and the rows' round state `v`;
        the draft's counters and n-gram history stay on the device. backup="auto" chooses one
        kind a chunk (`AutoBackup.read_chunk` prices it from the chunk's wall)."""
        e, call, N = self.e, self.call, rs.SD_CHUNK
        dseed, dsampling, tspec, trows = self._chunk_inputs(draft, spec, rows)
        saguaro_c = np.float32(call.saguaro_c)
        fb = to_mesh(from_backup, self.tgt)
        draft.note_tree_layout(v, spec, fb, call)  # memory_of: the tree's bytes

        def dispatch():
            nonlocal tspec, trows, fb
            neural = None if self.auto is None else self.auto.next()
            try:
                out = rs.ssd_chunk(
                    e.tparams, e.tcfg, self.tcache, draft.params, draft.cfg, draft.cache, self.state,
                    tspec, trows, fb, draft.counters,
                    draft.history if call.backup == "ngram" else None, self.seed_t, dseed,
                    self.rids_t, self.sampling_t, dsampling, saguaro_c, neural,
                    vocab_size=e.vocab_size, draft_vocab_size=draft.vocab_size,
                    row_vocab=draft.row_vocab, k=call.k, verifier=self.verifier,
                    backup=call.backup,
                    fanout_hit=call.fanout_hit, fanout_backup=call.fanout_backup,
                    row_dtype=call.row_dtype, tops=e.tops,
                    dops=draft.ops, rounds_max=N)
            except Exception:  # noqa: BLE001 - it never ran: its choice is taken back
                if self.auto is not None:
                    self.auto.take_back()
                raise
            (self.tcache, draft.cache, self.state, self.active, tspec, trows, fb, draft.counters,
             history, rep) = out
            if history is not None:
                draft.history = history
            return rep

        return self._chunk_loop(dispatch, functools.partial(self._rounds_read, ssd=True),
                                N * (call.k + 1))
