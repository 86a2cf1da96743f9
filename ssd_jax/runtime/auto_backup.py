"""backup="auto" in the round loop: `BackupChooser` (`ssd_jax.algorithm.policy`), fed without a sync.

The loop reads one report a round and, untimed, knows only the wall between two reads (timed
rounds wait between phases; they are priced the same way), so `AutoBackup` prices the neural
backup from those walls: a round that ran no neural backup (no row missed, or the random backup
served the misses) is a base round, max(T_v, T_p); a round whose misses the neural backup
drafted costs T_b more. The walls, hits and lookups are the timeline's entries for the rounds;
the report's hit and kept columns give the tokens after a hit and after each kind's backup, as
vector sums (no per-row Python). Each round's choice goes
to `round_steps.resolve` as a traced bool, so switching kinds compiles nothing. Nothing here is
fetched that the round did not already read.
"""
from __future__ import annotations

import collections

import numpy as np

from ssd_jax.algorithm import decode_state as ds
from ssd_jax.algorithm.policy import BackupChooser
from ssd_jax.runtime.metrics import RoundTimes


class AutoBackup:
    """One call's backup choices (`next`, at each round's dispatch) and what its reports say
    (`read`, at each round's read), in dispatch order: a pipelined loop reads round T after it
    has dispatched round T+1."""

    def __init__(self, chooser: BackupChooser):
        self.chooser = chooser
        self.kinds: collections.deque[str] = collections.deque()  # dispatched, not read yet
        self.dispatched = 0
        self.base: float | None = None  # smoothed wall of a round without a neural backup
        self.unpriced: list[tuple] = []  # (wall, rounds, missed) of neural rounds before a base
        self.hits = self.lookups = 0
        self.hit_tokens = self.hit_rows = 0
        self.prev_hit: np.ndarray | None = None  # the last report's hit codes [B]
        self.prev_kind = "neural"  # the first speculation is the neural backup's

    @property
    def pending_kind(self) -> str:
        """The kind of the oldest round dispatched and not read (the next `read`'s)."""
        return self.kinds[0]

    def next(self) -> bool:
        """The backup for the round being dispatched; True for neural. The first round uses
        neural (no lookup has been priced yet); every later one asks the chooser, with the base
        round's wall as T_v and T_p (None until a base round was read)."""
        self.dispatched += 1
        kind = "neural"
        if self.dispatched > 1:
            p_hit = self.hits / self.lookups if self.lookups else 0.0
            e_hit = self.hit_tokens / self.hit_rows if self.hit_rows else 1.0
            kind = self.chooser.choose(p_hit, self.base, self.base, e_hit)
        self.kinds.append(kind)
        return kind == "neural"

    def take_back(self) -> None:
        """Forget the last `next`: what it was for never ran (a chunk that failed to compile)."""
        self.kinds.pop()
        self.dispatched -= 1

    def read(self, report: np.ndarray, entry: RoundTimes) -> None:
        """One round's report `[B, 4 + 2M]` and its timeline entry (wall, hits, lookups)."""
        act, kept, _, hit, _, _ = ds.read_report(report)
        missed = self._count(act, kept, hit, entry)
        self._price(self.kinds.popleft(), entry.round_s, 1, int(missed))

    def read_chunk(self, kept: np.ndarray, hit: np.ndarray, entries: list[RoundTimes]) -> None:
        """A chunk of rounds (`round_steps.ssd_chunk`, one kind for all of them): kept and hit
        `[B, R]` for the R rounds it ran and their timeline entries. Its neural backup's cost is
        the chunk's wall over R base rounds, spread over the rounds that missed."""
        kind = self.kinds.popleft()
        missed = 0
        for i, entry in enumerate(entries):
            missed += self._count(kept[:, i] > 0, kept[:, i], hit[:, i], entry)
            self.prev_kind = kind  # the chunk's later rounds verify its own backups
        self._price(kind, sum(e.round_s for e in entries), len(entries), missed)

    def _count(self, act, kept, hit, entry: RoundTimes) -> bool:
        """One round's rows: active `[B]` bool, kept and hit codes `[B]`, and its entry; whether
        any row missed."""
        before_miss = np.ones_like(act) if self.prev_hit is None else self.prev_hit == 0
        before_hit = np.zeros_like(act) if self.prev_hit is None else self.prev_hit > 0
        self.chooser.record(self.prev_kind, tokens=kept[act & before_miss])
        self.hit_tokens += int(kept[act & before_hit].sum())
        self.hit_rows += int((act & before_hit).sum())
        self.hits += entry.hit
        self.lookups += entry.lookups
        self.prev_hit = hit
        return bool((hit == 0).any())

    def _price(self, kind: str, wall: float, rounds: int, missed: int) -> None:
        """`rounds` rounds of `kind` took `wall` seconds, `missed` of them with a miss: a base
        wall, or the neural backup's cost over it (kept until a base is known)."""
        if kind == "neural" and missed:
            if self.base is None:
                self.unpriced.append((wall, rounds, missed))
            else:
                self.chooser.record("neural", backup_s=self._over_base(wall, rounds, missed))
        else:
            per_round = wall / rounds
            self.base = per_round if self.base is None else 0.7 * self.base + 0.3 * per_round
            for w in self.unpriced:
                self.chooser.record("neural", backup_s=self._over_base(*w))
            self.unpriced = []
            if missed:  # the random backup: its cost is inside every base round
                self.chooser.record("random", backup_s=0.0)
        self.prev_kind = kind

    def _over_base(self, wall: float, rounds: int, missed: int) -> float:
        return max(0.0, wall - rounds * self.base) / missed
