"""The round loop on the device (ssd_jax.runtime.device_loop, issue #32).

- `decode_state.commit`, the array form of `Batch.emit`, against `Batch.emit` itself on random
  rounds (EOS ids, budgets, rows already ended, counts that run past the budget).
- The host's work per round, counted (deterministic, unlike time): Python calls per round and
  device->host reads per round at batch 1 and 8, for AR / SD / SSD, within the bounds the issue
  set (AR <= 400 a token, SD / SSD <= 1,000 a round, one read a round plus a few per call) and
  not growing with the batch. The counters are `ssd_jax.testing.host_work`'s, which
  benchmarks/host_overhead.py reports.
- The round loop and its timed rounds (`timeline=True`, each read before the next is dispatched)
  give the same tokens and counters; only the timed rounds time a round's phases.
  tests/unit/test_golden_ids.py holds the loop to the ids of the engine before the rewrite. SD
  and SSD
  on one mesh run in chunks of rounds (`round_steps.sd_chunk` / `ssd_chunk`): the same as their
  rounds one by one.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm import decode_state as ds
from ssd_jax.runtime.batch import Batch
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.testing.host_work import call_work



@pytest.mark.parametrize("seed", range(6))
def test_commit_is_batch_emit_as_array_code(seed):
    rng = np.random.default_rng(seed)
    B, V, max_new, M = 7, 6, int(rng.integers(1, 9)), int(rng.integers(1, 5))
    eos = [int(x) for x in rng.choice(V, size=int(rng.integers(0, 3)), replace=False)]
    prompts = [list(rng.integers(0, V, size=int(rng.integers(1, 4)))) for _ in range(B)]
    batch = Batch(prompts, max_new, eos)
    state = jax.device_put(ds.initial_state(batch.history, max_new, eos, k=2))
    for _ in range(6):
        toks = rng.integers(0, V, size=(B, M)).astype(np.int32)
        lps = rng.normal(size=(B, M)).astype(np.float32)
        num = rng.integers(0, M + 1, size=B).astype(np.int32)
        want = [batch.emit(b, toks[b, :num[b]], lps[b, :num[b]]) if batch.active[b] else 0
                for b in range(B)]
        state, kept = ds.commit(state, jnp.asarray(toks), jnp.asarray(lps), jnp.asarray(num))
        assert np.asarray(kept).tolist() == want
    st = jax.device_get(state)
    for b in range(B):
        c = int(st.count[b])
        assert st.tokens[b, :c].tolist() == batch.generated[b]
        np.testing.assert_array_equal(st.logprobs[b, :c], np.float32(batch.logprobs[b]))
        assert ds.FINISH_NAMES[int(st.finish[b])] == batch.finish[b]
        h = batch.history[b]  # prompt + generated: the bonus last, at position n
        assert int(st.n[b]) == len(h) - 1 and int(st.bonus[b]) == h[-1]
        assert int(st.prev[b]) == (h[-2] if len(h) > 1 else h[-1])


def test_report_round_trips_tokens_and_logprobs():
    state = jax.device_put(ds.initial_state([[1, 2], [3]], 4, [], k=1))
    toks = jnp.asarray([[5, 6], [7, -1]], jnp.int32)
    lps = jnp.asarray([[-0.5, -1.25], [-2.0, 0.0]], jnp.float32)
    active = state.active
    new, kept = ds.commit(state, toks, lps, jnp.asarray([2, 1], jnp.int32))
    act, k, fin, hit, t, lp = ds.read_report(np.asarray(ds.report(active, kept, new, toks, lps)))
    assert act.tolist() == [True, True] and k.tolist() == [2, 1] and hit.tolist() == [-1, -1]
    assert t.tolist() == [[5, 6], [7, -1]] and lp.tolist() == [[-0.5, -1.25], [-2.0, 0.0]]
    assert fin.tolist() == [0, 0]


@pytest.fixture(scope="module")
def tiny():
    """(target, engine): a random one-layer target over 64 ids and its draft, the target's weights
    perturbed by 10%; SD / SSD in chunks of rounds, which a CPU leaves off."""
    from ssd_jax.models.config import tiny_config
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import perturb, random_params
    cfg = tiny_config("qwen2", vocab_size=64, num_layers=1)
    target = Model(cfg, random_params(cfg, 0))
    draft = Model(cfg, perturb(target.params, jax.random.key(1), 0.1))
    eng = Engine(target, draft, placement="colocated", backend="xla", compilation_cache=False,
                 max_len=64, round_chunks=True)
    return target, eng


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_host_work_per_round_is_bounded_and_flat_in_the_batch(tiny, mode):
    _, eng = tiny
    rows = {}
    for b in (1, 8):
        rng = np.random.default_rng(0)
        prompts = [[int(t) for t in rng.integers(0, 64, 4)] for _ in range(b)]
        rows[b] = call_work(lambda: eng.generate(prompts, mode=mode, max_new_tokens=24, k=2), mode)
    bound = 400 if mode == "ar" else 1000
    for b, row in rows.items():
        assert row["same_tokens_every_call"]
        assert row["py_calls_per_round"] <= bound, (b, row["py_calls_per_round"])
        # one read a round, plus the call's own: the draft's prefill, SD / SSD's first
        # speculation, the results, the counters
        assert row["syncs"] <= row["rounds"] + 4, (b, row["syncs"], row["rounds"])
    per_call = {b: r["py_calls_per_round"] for b, r in rows.items()}
    # the calls a round costs do not grow with B (a few per call may: prompts, results; the
    # call's fixed cost, the pipelined loop's void round among it, spreads over its rounds, and
    # b = 1 may run fewer rounds than b = 8)
    assert rows[8]["py_calls_per_round"] <= 1.15 * rows[1]["py_calls_per_round"], per_call


@pytest.mark.parametrize("mode,backup", [("sd", None), ("ssd", "random"), ("ssd", "ngram"),
                                         ("ssd", "auto")])
def test_timed_rounds_agree_with_untimed_ones(tiny, monkeypatch, mode, backup):
    """The loop's rounds untimed (pipelined, in chunks where `tiny` runs them) and timed (one by
    one) give the same tokens and counters, and the timed ones each round's verify and draft
    seconds (SSD's backup seconds in rounds that missed). The n-gram backup with prompts that
    repeat, so some missed rows match an n-gram and others fall back to random tokens
    (tests/unit/test_ngram_backup.py holds its device form to the Python reference).
    backup="auto" with its chooser alternating random, neural, ... (tests/_golden_cases.py's
    `deterministic_auto`): both runs ask it once a round from the second, so the same kind
    serves each round's misses, chosen as a traced flag of the round's resolve (in rounds one by
    one: `tiny` runs chunks of rounds, where auto asks once a chunk)."""
    import contextlib
    from _golden_cases import deterministic_auto
    _, eng = tiny
    if backup == "auto":
        _one_round_at_a_time(monkeypatch)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    if backup == "ngram":
        prompts = [[1, 2, 3, 1, 2, 3, 1], [4, 5, 4, 5], [6, 7, 8, 9], [9, 9, 9, 9, 9], [5]]
    kw = dict(mode=mode, max_new_tokens=12, k=2, sampling=SamplingParams(temperature=0.9),
              seed=4, eos_ids=[3], ssd=SSDConfig(fanout=(2, 1, 1), backup=backup or "neural"))
    with deterministic_auto() if backup == "auto" else contextlib.nullcontext():
        b = eng.generate(prompts, **kw)
        c = eng.generate(prompts, timeline=True, **kw)
    for kind in ("neural", "random") if backup == "auto" else (backup,) if backup else ():
        assert b.metrics.backups.get(kind, 0) > 0, b.metrics.backups
    assert c.token_ids == b.token_ids and c.finish_reasons == b.finish_reasons
    for key in ("accept_hist", "accept_hist_after_hit", "accept_hist_after_miss", "hits",
                "lookups", "hits_by_accept", "lookups_by_accept", "backups", "rounds"):
        assert getattr(c.metrics, key) == getattr(b.metrics, key), key
    assert [r.active for r in c.metrics.timeline] == [r.active for r in b.metrics.timeline]
    assert b.metrics.verify_s == 0  # untimed rounds: walls and counts only
    m = c.metrics
    assert all(r.verify_s > 0 and r.draft_s > 0 for r in m.timeline), m.timeline
    assert m.verify_s == pytest.approx(sum(r.verify_s for r in m.timeline))
    assert m.draft_s == pytest.approx(sum(r.draft_s for r in m.timeline))
    if mode == "ssd":  # backup time only in the rounds whose lookup missed a row
        assert all((r.backup_s > 0) == (r.hit < r.lookups) for r in m.timeline), m.timeline
        assert m.backup_s > 0


def _one_round_at_a_time(monkeypatch):
    """SD's rounds dispatched one by one, as for a draft on a mesh of its own, on the colocated
    `tiny` engine (which otherwise runs SD in chunks of rounds, `round_steps.sd_chunk`)."""
    from ssd_jax.runtime.device_loop import DeviceLoop
    monkeypatch.setattr(DeviceLoop, "_chunked", lambda self, draft: False)


class _FailsOnRead:
    """A report whose read fails, as a device failure surfaces at the host's fetch."""

    def __array__(self, *a, **k):
        raise RuntimeError("INTERNAL: planted device failure")


@pytest.mark.parametrize("mode,armed", [("ssd", 3), ("sd", None), ("sd-chunks", 2),
                                        ("ssd-chunks", 2)])
def test_a_draft_failure_read_a_round_late_rolls_back_and_refills_the_target(tiny, tmp_path,
                                                                            monkeypatch, mode, armed):
    """Pipelined, the round after a failing draft round is already enqueued (its verify took the
    target's KV cache): the call rolls back to the state before it, re-prefills the target, and
    finishes with plain decoding exactly as the target alone (greedy: the same ids). SD and SSD
    in chunks of rounds (one computation for both models): a chunk whose read fails rolls back
    to the state before it the same way."""
    import _two_process_faults as faults
    from ssd_jax.algorithm import round_steps
    from ssd_jax.runtime.device_loop import DeviceLoop
    from ssd_jax.runtime.draft_worker import DraftWorker
    from ssd_jax.runtime.fallback import DraftFallbackWarning
    _, eng = tiny
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    kw = dict(max_new_tokens=24, k=2, eos_ids=[])
    lost = []
    real = DeviceLoop.recover
    monkeypatch.setattr(DeviceLoop, "recover", lambda self, n: (lost.append(self.lost), real(self, n))[1])
    chunked = mode.endswith("-chunks")
    if chunked:  # the second chunk (of 2 rounds) fails at its read
        mode = mode[:-len("-chunks")]
        name = f"{mode}_chunk"
        calls, chunk = [0], getattr(round_steps, name)
        monkeypatch.setattr(round_steps, "SD_CHUNK", 2)

        def failing_chunk(*a, **k):
            calls[0] += 1
            out = chunk(*a, **k)
            return out[:-1] + (_FailsOnRead(),) if calls[0] == armed else out
        monkeypatch.setattr(round_steps, name, failing_chunk)
        undo = lambda: None  # noqa: E731
    elif armed:  # the tree raises on the device: read late, with the next round in flight
        _one_round_at_a_time(monkeypatch)
        path = str(tmp_path / "armed")
        undo = faults.install_tree_fault(path)
        faults.arm(path, "raise", armed)
    else:  # SD's draft raises as the next round is dispatched
        _one_round_at_a_time(monkeypatch)
        calls = [0]
        propose = DraftWorker.propose

        def failing(self, *a, **k):
            calls[0] += 1
            if calls[0] == 4:
                raise MemoryError("RESOURCE_EXHAUSTED: planted")
            return propose(self, *a, **k)
        monkeypatch.setattr(DraftWorker, "propose", failing)
        undo = lambda: None  # noqa: E731
    try:
        with pytest.warns(DraftFallbackWarning):
            out = eng.generate(prompts, mode=mode, ssd=SSDConfig(fanout=(2, 1, 1)), **kw)
    finally:
        undo()
    ar = eng.generate(prompts, mode="ar", **kw)
    assert lost == [True], lost
    assert out.metrics.fallback is not None and out.metrics.fallback["tokens_before"] > len(prompts)
    assert out.token_ids == ar.token_ids
    if chunked:  # the failing chunk, and the one enqueued before its read
        assert calls[0] in (armed, armed + 1)
        assert out.metrics.fallback["during"] == ("propose" if mode == "sd" else "resolve")


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_rounds_are_enqueued_one_ahead_and_a_budget_end_runs_no_void_round(tiny, monkeypatch, mode):
    """The verify of round T+1 is dispatched before round T's report is read while the budget
    leaves room, and a call that ends on its budget dispatches exactly its rounds; one that ends
    on an EOS early may dispatch one void round more, which changes nothing it returns."""
    from ssd_jax.algorithm import steps
    from ssd_jax.runtime.device_loop import DeviceLoop
    _, eng = tiny
    _one_round_at_a_time(monkeypatch)
    events = []
    verify, read = steps.verify, DeviceLoop.read_draft
    monkeypatch.setattr(steps, "verify", lambda *a, **k: (events.append("V"), verify(*a, **k))[1])
    monkeypatch.setattr(DeviceLoop, "read_draft",
                        lambda self, *a: (events.append("R"), read(self, *a))[1])
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    kw = dict(mode=mode, max_new_tokens=24, k=2, ssd=SSDConfig(fanout=(2, 1, 1)))
    out = eng.generate(prompts, eos_ids=[], **kw)
    seq = "".join(events)
    assert "VV" in seq, seq  # a verify went in with the previous round unread
    assert seq.count("V") == out.metrics.rounds, seq
    assert all(len(t) == 24 for t in out.token_ids)
    events.clear()
    eos = out.token_ids[0][5]  # every row ends at or before this token's first occurrence
    ended = eng.generate(prompts, eos_ids=[eos], **kw)
    assert "".join(events).count("V") - ended.metrics.rounds in (0, 1)
    unpiped = eng.generate(prompts, eos_ids=[eos], timeline=True, **kw)
    assert ended.token_ids == unpiped.token_ids and ended.finish_reasons == unpiped.finish_reasons
    assert ended.metrics.accept_hist == unpiped.metrics.accept_hist
    if mode == "ssd":
        assert (ended.metrics.lookups, ended.metrics.hits) == (unpiped.metrics.lookups,
                                                               unpiped.metrics.hits)


def _count_chunks(monkeypatch, mode: str) -> list[int]:
    """Counts `round_steps.sd_chunk` / `ssd_chunk` (by `mode`) dispatches in the returned list's
    one entry."""
    from ssd_jax.algorithm import round_steps
    name = f"{mode}_chunk"
    calls, chunk = [0], getattr(round_steps, name)

    def counted(*a, **k):
        calls[0] += 1
        return chunk(*a, **k)
    monkeypatch.setattr(round_steps, name, counted)
    return calls


CHUNK_SSD = SSDConfig(fanout=(2, 2, 1))


def test_round_chunks_default_follows_the_platform(tiny, monkeypatch):
    """`Engine(round_chunks=None)`: off on a CPU (the default pair's chunks compile 5-8 s longer
    for a 2-6% faster call), on elsewhere; True / False force it; anything else is a TypeError."""
    target, eng = tiny
    for mode in ("sd", "ssd"):
        calls = _count_chunks(monkeypatch, mode)
        kw = dict(mode=mode, max_new_tokens=12, k=2, ssd=CHUNK_SSD)
        monkeypatch.setattr(eng, "round_chunks", None)
        off = eng.generate([[1, 2, 3]], **kw)
        assert calls[0] == 0
        monkeypatch.setattr(eng, "round_chunks", True)
        on = eng.generate([[1, 2, 3]], **kw)
        assert calls[0] > 0 and on.token_ids == off.token_ids
    with pytest.raises(TypeError, match="round_chunks must be"):
        Engine(target, round_chunks="yes")


# greedy and sampled SD; SSD with each backup (the neural one sampled under Saguaro)
@pytest.mark.parametrize("mode,backup,temperature,eos,saguaro_c",
                         [("sd", "neural", 0.0, [], 1.0), ("sd", "neural", 0.7, [5, 9], 1.0),
                          ("ssd", "neural", 0.7, [5, 9], 0.6), ("ssd", "random", 1.0, [9], 1.0),
                          ("ssd", "ngram", 1.0, [3], 1.0)])
def test_round_chunks_equal_rounds_one_by_one(tiny, monkeypatch, mode, backup, temperature, eos,
                                              saguaro_c):
    """SD and SSD on one mesh run chunks of up to SD_CHUNK rounds (`round_steps.sd_chunk` /
    `ssd_chunk`): the same ids, log-probs, finish reasons, accept histograms, SSD's lookup, hit
    and backup counters (each backup; Saguaro) and per-round timeline counts as the rounds
    dispatched one by one, with one dispatch and one read a chunk."""
    from ssd_jax.algorithm import round_steps
    _, eng = tiny
    calls = _count_chunks(monkeypatch, mode)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2], [7, 7, 7, 1, 2]]
    kw = dict(mode=mode, max_new_tokens=40, k=2, seed=3, eos_ids=eos,
              sampling=SamplingParams(temperature=temperature),
              ssd=SSDConfig(fanout=(2, 2, 1), backup=backup, saguaro_c=saguaro_c))
    a = eng.generate(prompts, **kw)
    most = -(-a.metrics.rounds // round_steps.SD_CHUNK) + 1  # + a void chunk after an EOS
    assert 0 < calls[0] <= most, (calls, a.metrics.rounds)
    _one_round_at_a_time(monkeypatch)
    b = eng.generate(prompts, **kw)
    assert a.token_ids == b.token_ids and a.finish_reasons == b.finish_reasons
    assert a.logprobs == b.logprobs
    for key in ("rounds", "accept_hist", "accept_hist_after_hit", "accept_hist_after_miss",
                "hits", "lookups", "hits_by_accept", "lookups_by_accept", "backups"):
        assert getattr(a.metrics, key) == getattr(b.metrics, key), key
    assert [(r.active, r.tokens, r.hit, r.lookups) for r in a.metrics.timeline] == \
        [(r.active, r.tokens, r.hit, r.lookups) for r in b.metrics.timeline]
    if mode == "ssd":
        assert 0 < a.metrics.hits < a.metrics.lookups and a.metrics.backups.get(backup, 0) > 0
    if eos:
        assert "eos" in a.finish_reasons


def test_auto_backup_in_chunks_chooses_once_a_chunk(tiny, monkeypatch):
    """backup="auto" in chunks of rounds asks its chooser once a chunk, the chunk's kind a traced
    flag of `ssd_chunk`: a chooser that says random from the second chunk on gives the ids,
    log-probs and counters of the rounds one by one whose chooser says neural for rounds 2 to
    SD_CHUNK and random after (round 1's backup, so the first chunk's, is neural by rule)."""
    from ssd_jax.algorithm import round_steps
    from ssd_jax.algorithm.policy import BackupChooser
    from ssd_jax.runtime import engine as engine_module
    _, eng = tiny
    N = round_steps.SD_CHUNK

    class Chooser(BackupChooser):
        per_round = False

        def choose(self, p_hit, tv, tp, e_hit):
            self.calls = getattr(self, "calls", 0) + 1
            return "neural" if self.per_round and self.calls < N else "random"

    monkeypatch.setattr(engine_module, "BackupChooser", Chooser)
    calls = _count_chunks(monkeypatch, "ssd")
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9], [2], [7, 7, 7, 1, 2]]
    kw = dict(mode="ssd", max_new_tokens=40, k=2, seed=3, sampling=SamplingParams(temperature=1.0),
              ssd=SSDConfig(fanout=(2, 2, 1), backup="auto"))
    a = eng.generate(prompts, **kw)
    assert calls[0] > 1 and a.metrics.rounds > N, (calls, a.metrics.rounds)
    Chooser.per_round = True
    _one_round_at_a_time(monkeypatch)
    b = eng.generate(prompts, **kw)
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    for key in ("rounds", "accept_hist", "hits", "lookups", "hits_by_accept", "backups"):
        assert getattr(a.metrics, key) == getattr(b.metrics, key), key
    assert a.metrics.backups.get("neural", 0) > 0 and a.metrics.backups.get("random", 0) > 0


@pytest.mark.parametrize("mode", ["sd", "ssd"])
def test_round_chunks_are_enqueued_one_ahead_and_one_that_fails_to_compile_runs_rounds(
        tiny, monkeypatch, mode):
    """Chunk c+1 is dispatched before chunk c's report is read while some row needs more than a
    chunk can commit; and a first chunk that raises at dispatch (a compile error, before
    anything ran) leaves the call to the rounds one by one, with the same ids."""
    from ssd_jax.algorithm import round_steps
    from ssd_jax.runtime.device_loop import DeviceLoop
    _, eng = tiny
    events = []
    name = f"{mode}_chunk"
    chunk, read = getattr(round_steps, name), DeviceLoop._rounds_read
    monkeypatch.setattr(round_steps, name,
                        lambda *a, **k: (events.append("C"), chunk(*a, **k))[1])
    monkeypatch.setattr(DeviceLoop, "_rounds_read",
                        lambda self, *a, **k: (events.append("R"), read(self, *a, **k))[1])
    prompts = [[1, 2, 3], [4, 5]]
    kw = dict(mode=mode, max_new_tokens=48, k=2, eos_ids=[],  # a chunk commits <= 8 x 3 tokens
              ssd=CHUNK_SSD)
    out = eng.generate(prompts, **kw)
    seq = "".join(events)
    assert seq.startswith("CC"), seq  # the second chunk went in with the first unread
    assert seq.count("C") == seq.count("R"), seq  # a budget end dispatches no void chunk
    assert all(len(t) == 48 for t in out.token_ids)

    def broken(*a, **k):
        raise RuntimeError("planted: the chunk does not compile")
    monkeypatch.setattr(round_steps, name, broken)
    again = eng.generate(prompts, **kw)
    assert again.token_ids == out.token_ids and again.metrics.fallback is None
    assert again.metrics.rounds == out.metrics.rounds


def test_memory_reports_the_last_calls_speculation_cache(tiny):
    """`metrics.memory_of`'s spec_cache is the last call's tree (dropped each round once looked
    up): per-row, so twice the rows hold twice the bytes; an SD call holds none."""
    from ssd_jax.runtime.metrics import memory_of
    _, eng = tiny
    kw = dict(max_new_tokens=8, k=2, ssd=SSDConfig(fanout=(2, 1, 1)))
    total = lambda: sum(memory_of(eng)["spec_cache"].values())  # noqa: E731
    eng.generate([[1, 2, 3]] * 2, mode="ssd", **kw)
    two = total()
    eng.generate([[1, 2, 3]] * 4, mode="ssd", **kw)
    assert two > 0 and total() == 2 * two
    eng.generate([[1, 2, 3]] * 2, mode="sd", **kw)
    assert total() == 0
