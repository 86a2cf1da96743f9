"""Compile once per shape: sampling values are traced, so a sweep of temperature / top-k / top-p
(SD) or Saguaro C (SSD) on one Engine compiles nothing after its first call; only the switch
between greedy and sampled parameters, a static structure, compiles anew. Per-request parameters
(one SamplingParams per prompt) apply to their own row only."""
import contextlib

import jax
import numpy as np
import pytest

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.runtime.engine import Engine, SSDConfig

CFG = tiny_config("llama", vocab_size=40)
PROMPT = [3, 1, 4, 1, 5]
# four points of a sweep, each with other values (top-k below and above small_topk.SMALL_K)
SWEEP = [SamplingParams(0.7), SamplingParams(1.0, top_p=0.9), SamplingParams(0.8, top_k=20),
         SamplingParams(1.2, top_k=5, top_p=0.95)]
_COMPILE_EVENTS = ("/jax/core/compile/jaxpr_trace_duration",
                   "/jax/core/compile/backend_compile_duration")


class _Compiles:
    """Counts JAX's trace and backend-compile events (one listener for the module) while open.
    Traces count too: a persistent compilation cache could serve a backend compile from disk, but
    a new trace still shows that a jitted function missed its cache."""

    def __init__(self):
        self.n = 0
        self._on = False
        jax.monitoring.register_event_duration_secs_listener(self._listen)

    def _listen(self, event, duration, **_):
        if self._on and event in _COMPILE_EVENTS:
            self.n += 1

    @contextlib.contextmanager
    def count(self):
        self.n, self._on = 0, True
        try:
            yield self
        finally:
            self._on = False


@pytest.fixture(scope="module")
def compiles():
    return _Compiles()


@pytest.fixture(scope="module")
def engine():
    t = Model(CFG, random_params(CFG, 0, scale=1.0))
    d = Model(CFG, perturb(t.params, jax.random.key(2), 0.3))
    return Engine(t, d, max_len=64, compilation_cache=False)


def _run(engine, compiles, **kw):
    with compiles.count() as c:
        out = engine.generate([PROMPT, PROMPT[:3]], max_new_tokens=12, k=3, seed=1, **kw)
    return c.n, out


def test_sd_sampling_sweep_compiles_once(engine, compiles):
    counts, texts = [], []
    for sp in SWEEP:
        n, out = _run(engine, compiles, mode="sd", sampling=sp)
        counts.append(n)
        texts.append(out.token_ids)
        if len(counts) > 1:
            assert out.metrics.compile_s == 0.0, (sp, out.metrics.compile_s)
    assert counts[0] > 0, "the first call must compile (else this counter counts nothing)"
    assert counts[1:] == [0, 0, 0], counts
    assert len({str(t) for t in texts}) > 1  # the values did reach the steps
    # greedy is the one static structure: it compiles its own steps, once
    n, _ = _run(engine, compiles, mode="sd", sampling=SamplingParams(0.0))
    assert n > 0
    n, _ = _run(engine, compiles, mode="sd", sampling=SamplingParams(0.0, top_k=3))
    assert n == 0


def test_ssd_saguaro_sweep_compiles_once(engine, compiles):
    counts, hits = [], []
    for i, c in enumerate((1.0, 0.75, 0.5, 0.25)):
        n, out = _run(engine, compiles, mode="ssd", sampling=SWEEP[i],
                      ssd=SSDConfig(fanout=(2, 2, 1, 1), saguaro_c=c))
        counts.append(n)
        hits.append(out.token_ids)
    assert counts[0] > 0
    assert counts[1:] == [0, 0, 0], counts
    assert len({str(t) for t in hits}) > 1


def test_ar_sweep_compiles_once(engine, compiles):
    counts = [_run(engine, compiles, mode="ar", sampling=sp)[0] for sp in SWEEP]
    assert counts[0] > 0 and counts[1:] == [0, 0, 0], counts


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_per_request_sampling_is_per_row(engine, mode):
    """Row 0 with its own parameters gives the same tokens whatever row 1 asks for: one batch
    with [a, b], one with [a, a] (same shapes, same request ids); row 1 follows its own."""
    a, b = SamplingParams(0.9, top_k=7), SamplingParams(0.0)
    kw = dict(mode=mode, max_new_tokens=10, k=2, seed=3, request_ids=[5, 6],
              ssd=SSDConfig(fanout=(2, 1, 1), saguaro_c=0.5))
    mixed = engine.generate([PROMPT, PROMPT], sampling=[a, b], **kw).token_ids
    same_a = engine.generate([PROMPT, PROMPT], sampling=[a, a], **kw).token_ids
    same_b = engine.generate([PROMPT, PROMPT], sampling=[b, b], **kw).token_ids
    assert mixed[0] == same_a[0]
    assert mixed[1] == same_b[1]
    assert same_a[1] != same_b[1]  # the rows' parameters really differ in effect


def test_per_request_sampling_checks_its_length(engine):
    with pytest.raises(ValueError, match="one SamplingParams per request"):
        engine.generate([PROMPT, PROMPT], mode="ar", max_new_tokens=2,
                        sampling=[SamplingParams(1.0)])
    with pytest.raises(ValueError, match="sampling must be a ssd_jax.SamplingParams"):
        engine.generate([PROMPT], mode="ar", max_new_tokens=2, sampling=[0.7])


def test_per_request_sampling_crosses_the_wire():
    """The two-process transport carries the draft's per-request values (one per request): the
    draft process rebuilds the same [B] arrays, and the wire refuses what it cannot check."""
    import socket

    from ssd_jax.runtime import wire
    from ssd_jax.runtime.config import CallConfig

    sp = SamplingParams.per_request([SamplingParams(0.7, top_k=3), SamplingParams(0.0),
                                     SamplingParams(1.3, top_p=0.9)], 3)
    run = CallConfig(k=2, seed=4, request_ids=(7, 8, 9), draft_sampling=sp, fanout_hit=(1, 1, 1),
                     fanout_backup=(1, 1, 1), saguaro_c=0.5, backup="ngram",
                     row_dtype="bfloat16")
    a, b = socket.socketpair()
    try:
        send, recv = wire.Channel(a, max_bytes=1 << 20), wire.Channel(b, max_bytes=1 << 20)
        outcome = {"outcome": np.zeros((3, 12), np.int32)}  # a packed round_steps.Outcome
        send.send(wire.Message("propose", run.draft_fields(), outcome))
        got = recv.recv(wire.REQUESTS, timeout=5)
        back = CallConfig.of_draft_fields(got.fields, 3)
        for f in ("temperature", "top_k", "top_p"):
            assert getattr(back.draft_sampling, f).dtype == getattr(sp, f).dtype
            np.testing.assert_array_equal(getattr(back.draft_sampling, f), getattr(sp, f))
        # every other field the draft reads arrives as sent; the target's own do not cross
        for f in ("k", "seed", "request_ids", "fanout_hit", "fanout_backup", "saguaro_c",
                  "backup", "row_dtype"):
            assert getattr(back, f) == getattr(run, f), f
        assert back.target_sampling is None and back.verifier is None
        # a scalar SamplingParams goes as one value per request
        fields = CallConfig(k=2, seed=0, request_ids=(1, 2),
                            draft_sampling=SamplingParams(0.5)).draft_fields()
        assert fields["temperature"] == [0.5, 0.5] and fields["top_k"] == [0, 0]
        with pytest.raises(ValueError, match="sampling values for 3 / 3 / 2 requests"):
            CallConfig.of_draft_fields(dict(run.draft_fields(), top_p=[1.0, 1.0]), 3)
        with pytest.raises(ValueError, match="temperature"):  # checked again on arrival
            CallConfig.of_draft_fields(dict(run.draft_fields(), temperature=[0.5, -1, 1]), 3)
        with pytest.raises(ValueError, match="K = 9 outside"):
            CallConfig.of_draft_fields(dict(run.draft_fields(), k=9), 3)
        with pytest.raises(ValueError, match="backup 'nearest'"):
            CallConfig.of_draft_fields(dict(run.draft_fields(), backup="nearest"), 3)
    finally:
        a.close()
        b.close()


def test_the_first_call_reports_each_program_it_compiled():
    """out.metrics.compiles is what compile_s is made of, per program, with its source; a call
    that compiles nothing reports none. (A vocabulary no other test uses: shapes nothing in this
    process compiled before.)"""
    cfg = tiny_config("llama", vocab_size=44)
    target = Model(cfg, random_params(cfg, 0, scale=1.0))
    eng = Engine(target, Model(cfg, perturb(target.params, jax.random.key(2), 0.3)), max_len=48,
                 compilation_cache=False)
    kw = dict(mode="sd", max_new_tokens=6, k=2, sampling=SamplingParams(0.9))
    first = eng.generate([PROMPT], **kw).metrics
    assert first.compile_s > 0 and first.compiles
    assert abs(sum(p["seconds"] for p in first.compiles.values()) - first.compile_s) < 1e-6
    for name, p in first.compiles.items():
        assert abs(p["trace_s"] + p["lower_s"] + p["compile_s"] - p["seconds"]) < 1e-9, name
        assert p["source"] == ("compiled" if p["count"] else "traced"), (name, p)
    compiled = {n for n, p in first.compiles.items() if p["count"]}
    assert "jit(verify)" in compiled or "jit(sd_chunk)" in compiled, sorted(compiled)
    assert first.to_dict()["compiles"] == first.compiles
    again = eng.generate([PROMPT], **kw).metrics
    assert again.compile_s == 0 and again.compiles == {}


def test_compile_sources_follow_the_cache_events():
    """The attribution rule on JAX's own events: a persistent-cache hit reported inside a
    compile makes that compile's source the cache; a stored step's program is the step store's."""
    from ssd_jax.algorithm.aot import STORE_PROGRAMS
    from ssd_jax.runtime.metrics import CompileTimer
    t = CompileTimer()
    trace, backend = ("/jax/core/compile/jaxpr_trace_duration",
                      "/jax/core/compile/backend_compile_duration")
    STORE_PROGRAMS.add("jit(stored_probe)")
    try:
        with t.measure():
            CompileTimer._listener(trace, 0.5, fun_name="plain")
            CompileTimer._listener(backend, 1.0, fun_name="jit(plain)")
            CompileTimer._event("/jax/compilation_cache/cache_hits")
            CompileTimer._listener(backend, 0.25, fun_name="jit(cached)")
            CompileTimer._listener(backend, 0.5, fun_name="jit(after)")  # the hit was used up
            CompileTimer._event("/jax/compilation_cache/cache_hits")
            CompileTimer._listener(backend, 0.125, fun_name="jit(stored_probe)")
            CompileTimer._listener(backend, 0.125, fun_name="jit(stored_probe)")
    finally:
        STORE_PROGRAMS.discard("jit(stored_probe)")
    got = {n: (p["seconds"], p["count"], p["source"]) for n, p in t.programs.items()}
    assert got == {"jit(plain)": (1.5, 1, "compiled"), "jit(cached)": (0.25, 1, "persistent cache"),
                   "jit(after)": (0.5, 1, "compiled"), "jit(stored_probe)": (0.25, 2, "step store")}
    assert t.seconds == 2.5


@pytest.mark.parametrize("mode", ["ar", "sd", "ssd"])
def test_a_new_batch_size_within_its_bucket_compiles_nothing(engine, compiles, mode):
    """Batches of 5 and of 7 prompts both run as 8 rows (`request.batch_bucket`): the second call
    compiles nothing, and the first returns what the call run at its own size returns
    (`batch_buckets=False`): tokens, log-probs and finish reasons per prompt, accept counts,
    hits and lookups (the padding rows never run, so they count nowhere)."""
    prompts = [PROMPT, PROMPT[:3], [2, 7], PROMPT[::-1], [9, 9, 9], [1], [6, 5, 4, 3]]
    kw = dict(mode=mode, max_new_tokens=10, k=2, seed=4, sampling=SamplingParams(0.9),
              ssd=SSDConfig(fanout=(2, 1, 1)))
    assert not engine._buckets()  # the default on a CPU (Engine's docstring says why)
    try:
        engine.batch_buckets = True
        five = engine.generate(prompts[:5], **kw)
        with compiles.count() as c:
            seven = engine.generate(prompts, **kw)
        assert c.n == 0 and seven.metrics.compile_s == 0, (c.n, seven.metrics.compiles)
        engine.batch_buckets = False
        exact = engine.generate(prompts[:5], **kw)
    finally:
        engine.batch_buckets = None
    assert len(seven.token_ids) == 7 and all(seven.token_ids)
    assert len(five.token_ids) == len(exact.token_ids) == 5
    assert five.token_ids == exact.token_ids and five.finish_reasons == exact.finish_reasons
    for g, w in zip(five.logprobs, exact.logprobs):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6)
    for key in ("accept_hist", "hits", "lookups", "new_tokens"):
        assert getattr(five.metrics, key) == getattr(exact.metrics, key), key
