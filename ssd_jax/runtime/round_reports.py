"""The host's side of the device loop's one read per round: a `DeviceLoop`'s report reads.

A round (or a chunk of rounds) leaves one small report on the target mesh (`decode_state.report`);
`read` fetches it and applies it on the host: which rows still run, their token counts, and, where
the host has work for the tokens (`on_tokens`, `stream()`, stop strings), each committing row's
tokens through `Batch.emit`. `sync_host` and `counters_into` fetch the call's state and counters
once, at its end. `DeviceLoop` (`ssd_jax.runtime.device_loop`) inherits these methods, as it does
`RoundChunks`'; they use its state.
"""
from __future__ import annotations

import time

import jax
import numpy as np

from ssd_jax.algorithm import decode_state as ds
from ssd_jax.algorithm import round_steps as rs
from ssd_jax.runtime.metrics import Metrics, RoundTimes
from ssd_jax.runtime.placement import fetch, to_host, to_mesh


class RoundReports:
    """The report reads of a `DeviceLoop` (module docstring)."""

    def read(self, rep) -> np.ndarray:
        """Fetch one report (the round's one device->host read) and apply it on the host."""
        r = to_host(rep) if self.serial else np.asarray(rep)  # several processes: the global value
        self.pending, self.pending_packed = None, False
        act, kept, fin, hit, toks, lps = ds.read_report(r)
        tokens = int(kept.sum())
        if self.mirror:
            was = self.batch.active
            tokens = self._emit(kept, fin, toks, lps)
            # A row the host ended this round (a stop string, a closed stream) was still running
            # on the device when the draft looked its outcome up: that lookup decided no
            # speculation the row will verify, so it is not counted.
            ended = was & ~self.batch.active & (fin == ds.RUNNING) & (hit >= 0)
            if ended.any():
                self._uncount(ended, kept, hit)
                hit = np.where(ended, -1, hit)
        self.count += kept
        self.alive = fin == ds.RUNNING
        self.running = bool(self.alive.any()) if not self.mirror else bool(self.batch.active.any())
        self.last = dict(active=int(act.sum()), tokens=tokens, hit=int((hit > 0).sum()),
                         lookups=int((hit >= 0).sum()))
        return r

    def _pending_report(self):
        """The unread report: SD and SSD keep the round's packed `Outcome` (its report after the
        six outcome columns), AR and the prefill the report itself."""
        p = self.pending
        return p[:, rs.REPORT_START:] if self.pending_packed else p

    def _uncount(self, rows, kept, hit) -> None:
        """Take back the lookups of `rows` [B] bool (their accepted count is kept - 1: the device
        kept the whole round for a row only the host ended) from the call's counters."""
        c = self.uncounted
        for row in np.flatnonzero(rows):
            j = int(kept[row]) - 1
            c["lookups_by_accept"][j] += 1
            c["hits_by_accept"][j] += int(hit[row] > 0)
            if hit[row] == 0:
                c["backups"][rs.BACKUP_INDEX[self.backup]] += 1

    def read_draft(self, rep, during: str) -> np.ndarray:
        """`read` of an array the draft's work of the round feeds: an error raised by it is the
        draft's (DraftDown, the call falls back) unless the target's own report of the round
        fails too (then it is the target's, raised as is)."""
        from ssd_jax.runtime.fallback import DraftDown
        try:
            return self.read(rep)
        except Exception as e:  # noqa: BLE001 - any failure of the draft's device work
            if self.pending is not None:
                try:
                    jax.block_until_ready(self.pending)
                except Exception:  # noqa: BLE001 - the target failed: not the draft's to contain
                    raise e from None
            down = DraftDown(during, e)
            down.__cause__ = e
            raise down from e

    def _emit(self, kept, fin, toks, lps) -> int:
        """Mirror mode: each committing row's tokens through `Batch.emit` (stop strings,
        callbacks); rows it ended that the device still runs are ended on the device."""
        b = self.batch
        n = 0
        for row in np.flatnonzero(kept):
            n += b.emit(int(row), toks[row, :kept[row]], lps[row, :kept[row]])
        host_active = b.active
        for code in (ds.STOP, ds.CANCELLED):
            name = ds.FINISH_NAMES[code]
            ended = (fin == ds.RUNNING) & ~host_active & \
                np.asarray([f == name for f in b.finish])
            if ended.any():
                self.state = rs.end_rows(self.state, to_mesh(ended, self.tgt), code)
                if self.serial:
                    jax.block_until_ready(self.state)
                self.active = self.state.active
        return n

    def sync_host(self) -> None:
        """Bring the host's Batch up to the device state (the call's end, or a draft failure):
        one fetch of the state; a report still unread is read first."""
        if self.pending is not None:
            self.read(self._pending_report())
        if self.mirror:
            return
        st = fetch(self.state)
        b = self.batch
        # whole arrays to lists at once, then each row cut to its count: a batch of thousands of
        # rows spent longer converting row by row than the rounds' reads
        counts, L = st.count.tolist(), st.tokens.shape[1]
        b.generated = [t if c == L else t[:c] for t, c in zip(st.tokens.tolist(), counts)]
        b.logprobs = [x if c == L else x[:c]
                      for x, c in zip(st.logprobs.astype(np.float64).tolist(), counts)]
        b.history = None  # made from the prompts and these tokens if read (a draft that failed)
        b.finish = [ds.FINISH_NAMES[f] for f in st.finish.tolist()]

    def counters_into(self, m: Metrics, lookups=None) -> None:
        """The device counters of the call into `m` (one fetch; a draft that failed has lost
        its lookup counters, and only the target's histograms are read)."""
        st = self.state
        hists = (st.accept_hist, st.accept_hist_after_hit, st.accept_hist_after_miss)
        try:
            hists, c = fetch((hists, lookups))
        except Exception:  # noqa: BLE001 - the draft failed: its counters are lost with it
            hists, c = fetch(hists), None
        if m.k:
            m.accept_hist = [int(x) for x in hists[0]]
            if m.mode == "ssd":
                m.accept_hist_after_hit = [int(x) for x in hists[1]]
                m.accept_hist_after_miss = [int(x) for x in hists[2]]
        if c is not None:
            c, u = c.totals(), self.uncounted
            m.lookups_by_accept = [int(x - y) for x, y in zip(c.lookups_by_accept, u["lookups_by_accept"])]
            m.hits_by_accept = [int(x - y) for x, y in zip(c.hits_by_accept, u["hits_by_accept"])]
            m.lookups, m.hits = sum(m.lookups_by_accept), sum(m.hits_by_accept)
            for kind, i in rs.BACKUP_INDEX.items():
                if int(c.backups[i] - u["backups"][i]):
                    m.backups[kind] = int(c.backups[i] - u["backups"][i])

    def _round(self, t0, c0, **kw) -> RoundTimes:
        """Add a round read now to the timeline (its wall since t0); returns its entry."""
        r = RoundTimes(**kw)
        r.round_s = time.perf_counter() - t0
        r.tokens = self.last["tokens"]
        r.compiled = self.timer.seconds > c0
        self.m.add_round(r)
        return r
