"""backup="auto" on the device loop (ssd_jax.runtime.auto_backup, issue #32).

- `AutoBackup` prices the neural backup from round walls alone: a neural round read before any
  round without a neural backup waits for one; the chooser probes a random round to get it; the
  backup's cost is the wall over that base. An expensive neural backup then loses to the random
  one, a free one with better tokens wins.
- The tokens after each kind's backup and after a hit are read off the reports' kept and hit
  columns, per row of the round before.
- On the engine: rounds whose choices differ run the same compiled steps (the choice is a
  traced flag of `round_steps.resolve`), and the counters say which kind served the misses.
  tests/unit/test_device_loop.py holds the timed rounds' auto to the untimed rounds', choice for
  choice.
"""
from __future__ import annotations

import numpy as np
import pytest

from ssd_jax.algorithm import decode_state as ds
from ssd_jax.algorithm.policy import BackupChooser
from ssd_jax.runtime.auto_backup import AutoBackup
from ssd_jax.runtime.metrics import RoundTimes


def _report(kept, hit, active=None) -> np.ndarray:
    """A round's report [B, 4 + 2] as `decode_state.report` lays it out (one token column)."""
    kept = np.asarray(kept, np.int32)
    rep = np.zeros((len(kept), ds.R_TOKENS + 2), np.int32)
    rep[:, ds.R_ACTIVE] = 1 if active is None else np.asarray(active, np.int32)
    rep[:, ds.R_KEPT] = kept
    rep[:, ds.R_FINISH] = ds.RUNNING
    rep[:, ds.R_HIT] = hit
    return rep


def _read(auto: AutoBackup, kept, hit, wall: float, active=None) -> None:
    """`auto.read` of a round's report and its timeline entry (wall, hits, lookups), as the
    device loop reads one."""
    hit_ = np.asarray(hit)
    entry = RoundTimes(round_s=wall, hit=int((hit_ > 0).sum()), lookups=int((hit_ >= 0).sum()))
    auto.read(_report(kept, hit, active), entry)


def test_the_neural_backup_is_priced_against_a_round_without_one():
    chooser = BackupChooser(batch=2)
    auto = AutoBackup(chooser)
    assert auto.next() is True  # round 1: neural (nothing priced yet)
    _read(auto, [2, 1], [0, 1], 5.0)  # a miss served by neural, no base yet
    assert chooser.tb["neural"] is None and auto.base is None
    assert auto.next() is False  # the probe: a round with no neural backup
    _read(auto, [1, 3], [1, 1], 1.0)
    assert auto.base == 1.0
    assert chooser.tb["neural"] == pytest.approx(4.0)
    # three hits of four lookups, and a neural backup that stalls the batch 4x a round: random
    assert auto.next() is False


def test_a_cheap_neural_backup_with_better_tokens_is_kept():
    chooser = BackupChooser(batch=2)
    auto = AutoBackup(chooser)
    assert auto.next() is True
    _read(auto, [3, 3], [0, 1], 1.0)
    assert auto.next() is False  # the probe
    _read(auto, [3, 1], [0, 1], 1.0)  # row 0 missed again: random serves it
    auto.next()
    _read(auto, [1, 3], [1, 1], 1.0)  # 1 token after random's speculation
    assert chooser.tb["neural"] == pytest.approx(0.0)
    assert auto.next() is True  # no stall, and 3 tokens after neural against 1 after random


def test_tokens_after_each_kind_and_after_a_hit_come_from_the_round_before():
    chooser = BackupChooser(batch=3)
    auto = AutoBackup(chooser)
    auto.next()
    # round 1 verifies the first speculation (the neural backup's) of every active row
    _read(auto, [2, 3, 1], [1, 0, -1], 2.0, active=[1, 1, 1])
    assert list(chooser.tokens_after["neural"]) == [2, 3, 1]
    assert auto.next() is False  # the probe
    # rows verified now: row 0 after its hit, row 1 after neural's backup (round 1's kind);
    # row 2 ended in round 1 and counts nowhere
    _read(auto, [3, 2, 0], [0, 1, -1], 2.0, active=[1, 1, 0])
    assert list(chooser.tokens_after["neural"]) == [2, 3, 1, 2]
    assert (auto.hit_tokens, auto.hit_rows) == (3, 1)
    assert (auto.hits, auto.lookups) == (2, 4)


def test_switching_kinds_compiles_nothing_and_the_counters_say_who_served(monkeypatch):
    from ssd_jax.models.config import tiny_config

    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.runtime import engine as engine_module
    from ssd_jax.runtime.engine import Engine, SSDConfig

    from _tiny import padded_draft, padded_model
    cfg = tiny_config("qwen2", vocab_size=64, hidden_size=32, intermediate_size=64, num_heads=2,
                      num_kv_heads=1, head_dim=16, num_layers=2)
    target = padded_model(cfg, 0)
    eng = Engine(target, padded_draft(target, 1, 0.5),
                 max_len=64, compilation_cache=False, placement="colocated", backend="xla")
    kinds: list[str] = []

    class Pinned(BackupChooser):
        def choose(self, p_hit, tv, tp, e_hit):
            return kinds[0]

    monkeypatch.setattr(engine_module, "BackupChooser", Pinned)
    kw = dict(mode="ssd", max_new_tokens=16, k=2, sampling=SamplingParams(temperature=1.0),
              ssd=SSDConfig(fanout=(1, 1, 1), backup="auto"))
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    served = {}
    for i, kind in enumerate(("neural", "random", "neural")):
        kinds[:] = [kind]
        out = eng.generate(prompts, **kw)
        served[kind] = out.metrics.backups
        if i:
            assert out.metrics.compile_s == 0.0, (kind, out.metrics.compile_s)
    # round 1's misses are always neural's (`AutoBackup.next`); every later one the pinned kind's
    assert served["random"].get("random", 0) > 0, served
    assert set(served["neural"]) == {"neural"}, served
