"""Which rounds made a statistical case's tokens (tests/_engine_stats.py's cases): `Rounds`, per
verify round and row, how many tokens it kept, how many draft tokens it accepted and whether its
speculation came from a speculation-cache hit or a miss's backup; `recording_rounds` records them
from what the round loop already reads on the host; `generate_recorded` is one generate call with
its rounds recorded and their histograms attached to its Metrics."""
from __future__ import annotations

import contextlib

import numpy as np

from ssd_jax.runtime.engine import Engine


def generate_recorded(eng: Engine, prompts, *, skip: int, window: int, k: int, **kw):
    """`eng.generate(prompts, max_new_tokens=skip + window, k=k, **kw)` with its rounds recorded:
    its Metrics' extra["window_hist"] is `Rounds.window_hist(skip, window, k)`, what
    `assert_every_path_ran` reads, and extra["first_lookup"] `Rounds.lookup_hist(0, k)` (SSD:
    round 1's outcomes by whether their lookup hit)."""
    with recording_rounds() as rounds:
        out = eng.generate(prompts, max_new_tokens=skip + window, k=k, **kw)
    out.metrics.extra["window_hist"] = rounds.window_hist(skip, window, k)
    if len(rounds.rounds) > 1:
        out.metrics.extra["first_lookup"] = rounds.lookup_hist(0, k)
    return out


class Rounds:
    """Per verify round of one generate call, per row: `start` (tokens the row had before it),
    `kept` (tokens it kept), `accepted` (draft tokens accepted, before any cut at the budget or
    EOS) and `after` (how the round's speculation was made: 1 from a speculation-cache hit, 0 from
    a miss's backup, -1 no lookup: SD, or SSD's first round), each `[B]`. Recorded by
    `recording_rounds` from what the round loop already reads: its per-round
    report (`DeviceLoop.read`: its kept column, its tokens' -1 padding after accepted + 1, and
    its hit column, the lookup of that round's outcome, which made the next round's
    speculation)."""

    def __init__(self):
        self.rounds: list[dict[str, np.ndarray]] = []
        self._count = None  # tokens per row from the reports read so far
        self._hit = None    # the last report's hit column

    def _report(self, act, kept, hit, toks) -> None:
        if self._count is None:  # the prefill's report: its one token, no verify
            self._count, self._hit = kept.astype(np.int64), hit.copy()
            return
        accepted = (toks >= 0).sum(1) - 1  # a verify's tokens: accepted + bonus, then -1
        self.rounds.append(dict(start=self._count.copy(), kept=kept.copy(), accepted=accepted,
                                after=np.where(act, self._hit, -1)))
        self._count += kept
        self._hit = hit.copy()

    def window_hist(self, skip: int, window: int, k: int) -> np.ndarray:
        """`[2, k + 1]`: rounds (per row) that kept a token of the window (generated tokens
        skip + 1 .. skip + window) by how their speculation was made (row 0: a miss's backup,
        row 1: a hit) and accepted count."""
        hist = np.zeros((2, k + 1), np.int64)
        for r in self.rounds:
            inside = ((r["kept"] > 0) & (r["start"] < skip + window)
                      & (r["start"] + r["kept"] > skip) & (r["after"] >= 0))
            np.add.at(hist, (r["after"][inside], r["accepted"][inside]), 1)
        return hist

    def lookup_hist(self, r: int, k: int) -> np.ndarray:
        """`[2, k + 1]`: the rows that went on past round r (0-based) by how the next round's
        speculation was made from round r's outcome (row 0: a miss's backup, row 1: a hit) and
        round r's accepted count."""
        hist = np.zeros((2, k + 1), np.int64)
        after, accepted = self.rounds[r + 1]["after"], self.rounds[r]["accepted"]
        went_on = after >= 0
        np.add.at(hist, (after[went_on], accepted[went_on]), 1)
        return hist


@contextlib.contextmanager
def recording_rounds():
    """Record the `Rounds` of the generate call made inside by wrapping the round loop's one
    read of a round (`DeviceLoop.read`); the engine runs as it would otherwise."""
    from ssd_jax.algorithm import decode_state
    from ssd_jax.runtime.device_loop import DeviceLoop

    rec = Rounds()
    read = DeviceLoop.read

    def spy_read(self, rep):  # the loop's one read of a round (auto's chooser reads it too)
        r = read(self, rep)
        act, kept, _, hit, toks, _ = decode_state.read_report(r)
        rec._report(act, kept, hit, toks)
        return r

    DeviceLoop.read = spy_read
    try:
        yield rec
    finally:
        DeviceLoop.read = read
