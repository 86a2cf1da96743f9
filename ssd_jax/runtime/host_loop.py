"""The timed host loop: AR, SD and SSD rounds driven from the host, the `Engine`'s `HostLoop` part.

A call runs here when it cannot run on the device loop (`Engine._on_device`: a mesh over several
processes; issue #57 folds it into the device loop).
Each round waits for its outcome, emits the rows' tokens in Python and times its phases (verify,
draft, backup) for the timeline, the §6 prediction and `backup="auto"` (which the device loop
prices from round walls instead, `ssd_jax.runtime.auto_backup`; its `timeline=True` times the
same phases).
`Engine` (`ssd_jax.runtime.engine`) inherits these methods; they use its models, caches,
placement and compile timer.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ssd_jax.algorithm import steps
from ssd_jax.runtime.batch import Batch
from ssd_jax.runtime.draft_worker import DraftRun, RoundState
from ssd_jax.runtime.metrics import Metrics, RoundTimes, mean_tokens
from ssd_jax.runtime.placement import settle, to_mesh
from ssd_jax.runtime.proposer import check_rows


class HostLoop:
    """The host-driven rounds of an `Engine` (module docstring)."""

    def _run_ar(self, batch: Batch, rids, run, m: Metrics, measure: bool = True):
        tgt, cfg = self.placement.target, self.tcfg
        rids_t = to_mesh(rids, tgt)
        while batch.active.any():
            t0, c0, n0 = self._round_start(batch)
            active = batch.active
            tok, lp, self.tcache = steps.decode(
                self.tparams, cfg, self.tcache, to_mesh(batch.bonus, tgt), to_mesh(active, tgt),
                run["seed"], rids_t, run["sampling"], self.vocab_size, ops=self.tops)
            tok, lp = np.asarray(tok), np.asarray(lp)
            for b in np.flatnonzero(active):
                batch.emit(b, [tok[b]], [lp[b]])
            m.add_round(self._round_end(batch, RoundTimes(active=int(active.sum())), t0, c0, n0))
        steady = [r.round_s for r in m.timeline if not r.compiled]
        if steady and measure:  # T_1 for the §6 prediction (not from a fallback's rounds)
            self._t1 = float(np.median(steady))

    def _round_start(self, batch: Batch):
        return time.perf_counter(), self._timer.seconds, sum(len(g) for g in batch.generated)

    def _round_end(self, batch: Batch, r: RoundTimes, t0, c0, n0) -> RoundTimes:
        r.round_s = time.perf_counter() - t0
        r.tokens = sum(len(g) for g in batch.generated) - n0
        r.compiled = self._timer.seconds > c0
        return r

    def _verify(self, batch: Batch, spec, rows, rids_t, run):
        tgt, cfg = self.placement.target, self.tcfg
        res, lp, self.tcache = settle(steps.verify(
            self.tparams, cfg, self.tcache, to_mesh(batch.bonus, tgt), to_mesh(spec, tgt),
            to_mesh(rows, self.placement.target_rows(rows.shape[-1])), to_mesh(batch.active, tgt),
            run["seed"], rids_t, run["sampling"],
            self.vocab_size, run["verifier"], ops=self.tops), self._serial)
        return res, lp

    def _commit(self, batch: Batch, res, lp, m: Metrics, from_backup=None) -> np.ndarray:
        """Block on the outcome, emit accepted tokens + bonus; returns accepted counts [B].
        from_backup [B] (SSD): whether each row's speculation came from a backup or a cache hit."""
        k_acc, toks, lps = np.asarray(res.num_accepted), np.asarray(res.tokens), np.asarray(lp)
        for b in np.flatnonzero(batch.active):
            m.accept_hist[k_acc[b]] += 1  # per active sequence and round
            if from_backup is not None:
                hist = m.accept_hist_after_miss if from_backup[b] else m.accept_hist_after_hit
                hist[k_acc[b]] += 1
            batch.emit(b, toks[b, : k_acc[b] + 1], lps[b, : k_acc[b] + 1])
        return k_acc

    def _run_sd(self, batch: Batch, rids, run, m: Metrics, draft):
        m.init_hist(run["k"])
        rids_t = to_mesh(rids, self.placement.target)
        drun = DraftRun.of_call(rids, run)
        while batch.active.any():
            t0, c0, n0 = self._round_start(batch)
            active = int(batch.active.sum())
            spec, rows = draft.propose(RoundState.of(batch), drun)
            check_rows(rows, batch.size, run["k"], self.target.cfg.vocab_size)
            jax.block_until_ready(rows)
            t1 = time.perf_counter()
            res, lp = self._verify(batch, spec, rows, rids_t, run)
            self._commit(batch, res, lp, m)
            t2 = time.perf_counter()
            m.draft_s += t1 - t0
            m.verify_s += t2 - t1
            m.add_round(self._round_end(batch, RoundTimes(verify_s=t2 - t1, draft_s=t1 - t0,
                                                          active=active), t0, c0, n0))
        draft.finish()

    def _run_ssd(self, batch: Batch, rids, m: Metrics, draft, run, drun: DraftRun, chooser):
        """SSD's rounds; run, drun, chooser: `Engine._ssd_setup`'s."""
        kind = drun.backup
        rids_t = to_mesh(rids, self.placement.target)
        # Round 1 has no cache: its speculation comes from the backup.
        spec, rows = draft.backup(RoundState.of(batch), drun)
        from_backup = np.ones(batch.size, bool)
        while batch.active.any():
            t0, c0, n0 = self._round_start(batch)
            before = RoundState.of(batch)
            res, lp = self._verify(batch, spec, rows, rids_t, run)  # async on the target mesh
            draft.dispatch_tree(before, spec, from_backup, drun)  # async on the draft mesh
            k_acc = self._commit(batch, res, lp, m, from_backup=from_backup)  # blocks on the outcome
            t1 = time.perf_counter()
            if chooser is not None:
                chooser.record(drun.backup, tokens=(k_acc + 1)[from_backup & before.active])
                if m.lookups:
                    kind = chooser.choose(m.hit_rate, m.verify_s / m.rounds, m.draft_s / m.rounds,
                                          mean_tokens(m.accept_hist_after_hit))
                drun = dataclasses.replace(drun, backup=kind)
            spec, rows, hit, times = draft.resolve(k_acc, np.asarray(res.bonus), RoundState.of(batch),
                                                   drun)
            # This lookup decides the next round's speculation: it counts for the rows that have a
            # next round (still active after this commit), from the first loop iteration on.
            nxt = batch.active
            missed = ~hit & nxt
            m.hits += int((hit & nxt).sum())
            m.lookups += int(nxt.sum())
            for b in np.flatnonzero(nxt):
                m.lookups_by_accept[k_acc[b]] += 1
                m.hits_by_accept[k_acc[b]] += int(hit[b])
            if missed.any():
                m.backups[drun.backup] = m.backups.get(drun.backup, 0) + int(missed.sum())
                if chooser is not None:
                    chooser.record(drun.backup, backup_s=times["backup_s"])
            from_backup = missed
            # T_p: measured by a draft process itself; in-process, dispatch -> ready as seen here
            tree_s = times.get("tree_s", t1 - t0 + times["tree_wait_s"])
            m.verify_s += t1 - t0
            m.draft_s += tree_s
            m.backup_s += times["backup_s"]
            m.add_round(self._round_end(batch, RoundTimes(
                verify_s=t1 - t0, draft_s=tree_s,
                backup_s=times["backup_s"], exchange_s=times.get("exchange_s", 0.0),
                hit=int((hit & nxt).sum()), lookups=int(nxt.sum()),
                active=int(before.active.sum())), t0, c0, n0))
        draft.finish()
