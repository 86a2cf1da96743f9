"""Fault injection into the draft (issue 22): its process killed mid-generate, hung past the reply
timeout, raising on its device (in its process and in the in-process split placement), sending a
malformed frame; a peer without the secret. Each time the target's process (this one) survives,
the call loses no token (greedy: the output is plain decoding's; T = 1: the committed tokens are
the clean run's and the rest is plain decoding's from them, draw for draw), one
DraftFallbackWarning says so and `metrics.fallback` records it; strict=True raises DraftFailure
with the tokens so far; a restart (or, after an error in the draft's computation, the next call)
returns to SSD with the clean run's hits. Times are recorded in a table (printed with -s, written
to $SSD_JAX_FAULT_TABLE if set).

Tiny random models (tests/faults/test_transport.py's pair): the draft processes start in seconds.
"""
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import pytest
from safetensors.numpy import save_file

import ssd_jax
import ssd_jax.runtime.engine as engine_module
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import params_from_hf, perturb_hf_tensors, random_hf_tensors
from ssd_jax.runtime.draft_worker import DraftWorker
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.runtime.fallback import DraftFailure, DraftFallbackWarning
from ssd_jax.runtime.transport import TransportWarning, start_two_process
from ssd_jax.runtime.wire import SECRET_ENV, SECRET_FILE_ENV

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, its helpers
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import _two_process_faults as faults  # noqa: E402

CFG = tiny_config("qwen2", vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
N, K = 24, 3
CALL = dict(mode="ssd", max_new_tokens=N, k=K, ssd=SSDConfig(fanout=(2, 2, 1, 1)))
T1 = SamplingParams(temperature=1.0)
TABLE: list[dict] = []


@pytest.fixture(scope="module", autouse=True)
def table():
    yield TABLE
    if TABLE:
        lines = ["| fault | what the user saw | tokens lost | time to recover |", "|---|---|---|---|"]
        lines += [f"| {r['fault']} | {r['saw']} | {r['lost']} | {r['recover']} |" for r in TABLE]
        print("\n" + "\n".join(lines))
        if os.environ.get("SSD_JAX_FAULT_TABLE"):
            with open(os.environ["SSD_JAX_FAULT_TABLE"], "w") as fh:
                json.dump(TABLE, fh, indent=1)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("faults")
    t = random_hf_tensors(CFG, 0, scale=1.0)
    d = perturb_hf_tensors(t, 0.05, seed=1)
    for name, tensors in (("target", t), ("draft", d)):
        os.makedirs(root / name)
        save_file(tensors, str(root / name / "model.safetensors"))
        with open(root / name / "config.json", "w") as f:
            json.dump(CFG.to_hf(), f)
    return root, Model(CFG, params_from_hf(t, CFG)), Model(CFG, params_from_hf(d, CFG))


@pytest.fixture(scope="module")
def reference(pair):
    """Plain decoding's tokens (greedy and T = 1) and the clean in-process SSD run."""
    _, target, draft = pair
    ar = Engine(target, None, compilation_cache=False)
    local = Engine(target, draft, compilation_cache=False)
    ssd = local.generate(PROMPTS, **CALL)
    ref = dict(ar=ar.generate(PROMPTS, mode="ar", max_new_tokens=N).token_ids, ssd=ssd,
               ssd_t1=local.generate(PROMPTS, sampling=T1, seed=5, **CALL), ar_engine=ar,
               local=local)
    # greedy SSD is plain decoding for this pair, so "equals plain decoding" is exact here
    assert ssd.token_ids == ref["ar"] and 0 < ssd.metrics.hits < ssd.metrics.lookups
    return ref


@pytest.fixture(scope="module")
def remote(pair, tmp_path_factory):
    """One draft process with planted faults (armed per test), restarted when a test leaves it
    down; its engine warmed up (compiled) so a short reply timeout means a hang, not a compile."""
    root, target, _ = pair
    fault_file = str(tmp_path_factory.mktemp("fault") / "armed")
    os.environ["SSD_JAX_TEST_FAULT_FILE"] = fault_file
    rd = start_two_process(str(root / "draft"), cores=None, reply_timeout=120,
                           draft_main=os.path.join(HERE, "_two_process_faulty_draft.py"))
    eng = Engine(target, remote_draft=rd, compilation_cache=False)
    eng.generate(PROMPTS, **CALL)
    eng.generate(PROMPTS, sampling=T1, **CALL)
    yield eng, fault_file
    rd.close()
    del os.environ["SSD_JAX_TEST_FAULT_FILE"]


@pytest.fixture
def clock(monkeypatch):
    """Times at which the engine fell back (the fall_back calls)."""
    times = []
    real = engine_module.fall_back

    def timed(*a, **k):
        times.append(time.perf_counter())
        return real(*a, **k)
    monkeypatch.setattr(engine_module, "fall_back", timed)
    return times


def lost(got, want) -> int:
    """Tokens of `want` (per row) that `got` does not have at their place."""
    n = 0
    for g, w in zip(got, want):
        same = next((i for i, (a, b) in enumerate(zip(g, w)) if a != b), min(len(g), len(w)))
        n += len(w) - same
    return n


def one_fallback(record) -> DraftFallbackWarning:
    ws = [w for w in record if issubclass(w.category, DraftFallbackWarning)]
    assert len(ws) == 1, [str(w.message) for w in ws]
    return ws[0].message


def timed_call(eng, **kw):
    with pytest.warns(DraftFallbackWarning) as record:
        t0 = time.perf_counter()
        out = eng.generate(PROMPTS, **{**CALL, **kw})
        wall = time.perf_counter() - t0
    return out, one_fallback(record), wall


def assert_back_to_ssd(eng, reference):
    """A clean SSD call: no fallback (a DraftFallbackWarning is an error in tests), the clean
    run's tokens and hits."""
    t0 = time.perf_counter()
    out = eng.generate(PROMPTS, **CALL)
    assert out.metrics.fallback is None
    assert out.token_ids == reference["ar"] and out.metrics.hits == reference["ssd"].metrics.hits
    return time.perf_counter() - t0


def clean_wall(eng) -> float:
    t0 = time.perf_counter()
    eng.generate(PROMPTS, **CALL)
    return time.perf_counter() - t0


def ensure_up(eng):
    if eng.worker.down is not None:
        eng.restart_draft()
        eng.generate(PROMPTS, **CALL)  # compile the new process's steps


# ------------------------------------------------------------------ the draft process
def test_killed_draft_process_mid_generate(remote, reference, clock):
    eng, _ = remote
    ensure_up(eng)
    base = clean_wall(eng)
    proc, seen, killed = eng.worker.proc, [0], []

    def on_tokens(row, ids):
        seen[0] += len(ids)
        if seen[0] >= 12 and not killed:  # a few SSD rounds in
            os.kill(proc.pid, signal.SIGKILL)
            killed.append(time.perf_counter())
    out, warning, wall = timed_call(eng, on_tokens=on_tokens)
    assert proc.wait(timeout=10) == -signal.SIGKILL
    assert out.token_ids == reference["ar"], "tokens lost or changed"
    fb = out.metrics.fallback
    assert fb["during"] == "resolve" and "exited with code -9" in fb["error"], fb
    assert fb["tokens_before"] >= 12 and out.metrics.hits > 0  # SSD ran before the kill
    assert "restart_draft" in str(warning) and fb["draft"] in str(warning)
    detect = clock[0] - killed[0]
    assert detect < 5.0
    # while it is down, a call is plain decoding at once (one warning again), never an exception
    again, warning2, _ = timed_call(eng)
    assert again.token_ids == reference["ar"] and again.metrics.fallback["during"] == "start"
    assert again.metrics.lookups == 0  # none of the last call's counts
    assert "is down" in again.metrics.fallback["error"]
    restart_s = eng.restart_draft()
    assert eng.worker.proc.pid != proc.pid and eng.worker.down is None
    first_s = assert_back_to_ssd(eng, reference)
    TABLE.append(dict(fault="draft process killed (SIGKILL) mid-generate",
                      saw=f"one DraftFallbackWarning: {str(warning)[:90]}...",
                      lost=lost(out.token_ids, reference["ar"]),
                      recover=f"detected {detect:.3f} s after the kill; call {wall - base:+.2f} s "
                              f"vs clean; restart_draft() {restart_s:.1f} s, first SSD call "
                              f"after it {first_s:.1f} s (compiles)"))


def test_hung_draft_process_times_out(remote, reference, clock):
    eng, fault_file = remote
    ensure_up(eng)
    base = clean_wall(eng)
    proc = eng.worker.proc
    eng.worker.reply_timeout = 3.0
    try:
        faults.arm(fault_file, "hang", 3)  # the 3rd tree from now sleeps an hour on the device
        out, warning, wall = timed_call(eng)
    finally:
        eng.worker.reply_timeout = 120.0
    assert out.token_ids == reference["ar"]
    fb = out.metrics.fallback
    assert fb["during"] == "resolve" and "no answer in 3 s" in fb["error"], fb
    assert "was stopped" in fb["error"] and proc.poll() is not None, fb
    assert 3.0 <= wall and wall - base < 15.0  # the timeout, not more
    restart_s = eng.restart_draft()
    first_s = assert_back_to_ssd(eng, reference)
    TABLE.append(dict(fault="draft process hangs (device callback sleeps 1 h), reply_timeout=3 s",
                      saw=f"one DraftFallbackWarning: ...{fb['error'][:70]}...",
                      lost=lost(out.token_ids, reference["ar"]),
                      recover=f"call {wall - base:+.2f} s vs clean (the timeout); process killed; "
                              f"restart_draft() {restart_s:.1f} s, first SSD call after it "
                              f"{first_s:.1f} s (compiles)"))


def test_a_compile_is_not_a_hang(pair, reference, monkeypatch, tmp_path):
    """Issue 35: `reply_timeout` counted the draft's compile, so a fresh draft whose compile
    outlasted it fell back on every first call. Now the draft process sends "compiling"
    heartbeats: with a 3 s reply timeout and compiles 4 s longer than usual, the first call is
    SSD, exact, with no fallback; a compile past `warmup_timeout` is a hang again."""
    root, target, _ = pair
    monkeypatch.setenv("SSD_JAX_TEST_SLOW_COMPILE", "4")
    monkeypatch.setenv("SSD_JAX_TEST_FAULT_FILE", str(tmp_path / "never_armed"))
    t0 = time.perf_counter()
    rd = start_two_process(str(root / "draft"), cores=None, reply_timeout=3.0,
                           compilation_cache=False,
                           draft_main=os.path.join(HERE, "_two_process_faulty_draft.py"))
    try:
        eng = Engine(target, remote_draft=rd, compilation_cache=False)
        with warnings.catch_warnings():
            warnings.simplefilter("error", DraftFallbackWarning)
            out = eng.generate(PROMPTS, **CALL)
        first_s = time.perf_counter() - t0
        assert out.metrics.fallback is None and out.token_ids == reference["ar"]
        assert out.metrics.hits == reference["ssd"].metrics.hits
        rd.warmup_timeout = 3.0  # a new batch size compiles anew: past the cap, a hang
        with pytest.warns(DraftFallbackWarning):
            out = eng.generate(PROMPTS[:1], **CALL)
        fb = out.metrics.fallback
        assert "still compiling after 3 s (warmup_timeout)" in fb["error"], fb
        assert out.token_ids == [reference["ar"][0]]
    finally:
        rd.close()
    TABLE.append(dict(fault="a fresh draft compiles 4 s longer than reply_timeout=3 s",
                      saw="nothing: SSD from the first call (\"compiling\" heartbeats); a compile "
                          "past warmup_timeout=3 s: one DraftFallbackWarning",
                      lost=0, recover=f"first call {first_s:.1f} s from the draft's start"))


def test_draft_process_error_is_contained_and_the_next_call_is_ssd(remote, reference, clock):
    eng, fault_file = remote
    ensure_up(eng)
    base = clean_wall(eng)
    pid = eng.worker.proc.pid
    faults.arm(fault_file, "raise", 3)
    out, warning, wall = timed_call(eng)
    assert out.token_ids == reference["ar"]
    fb = out.metrics.fallback
    assert fb["during"] == "resolve" and faults.PLANTED in fb["error"], fb
    assert eng.worker.down is None and eng.worker.proc.poll() is None  # it reported and serves on
    next_s = assert_back_to_ssd(eng, reference)  # no restart needed
    assert eng.worker.proc.pid == pid
    # strict: one ssd_jax error naming the draft, with the tokens so far
    faults.arm(fault_file, "raise", 3)
    eng.strict = True
    try:
        with pytest.raises(DraftFailure) as e:
            eng.generate(PROMPTS, **CALL)
    finally:
        eng.strict = False
    err = e.value
    assert isinstance(err, ssd_jax.DraftFailure) and err.draft == eng.worker.name
    assert err.draft in str(err) and err.during == "resolve" and faults.PLANTED in err.cause
    assert 0 < sum(map(len, err.token_ids)) < N * len(PROMPTS)
    assert all(ref[:len(t)] == t for t, ref in zip(err.token_ids, reference["ar"]))
    assert err.result.metrics.fallback["during"] == "resolve"
    assert_back_to_ssd(eng, reference)
    TABLE.append(dict(fault="the draft's tree raises on its device (draft process)",
                      saw="one DraftFallbackWarning naming the error; strict=True: DraftFailure "
                          "with .token_ids so far",
                      lost=lost(out.token_ids, reference["ar"]),
                      recover=f"call {wall - base:+.2f} s vs clean; the next call is SSD "
                              f"({next_s:.2f} s, no restart)"))


def test_draft_process_error_at_t1_continues_with_plain_decodings_draws(remote, reference):
    """T = 1: the tokens committed before the fault are the clean SSD run's; the rest are exactly
    what plain decoding draws from there (same seed, request ids and positions)."""
    eng, fault_file = remote
    ensure_up(eng)
    faults.arm(fault_file, "raise", 3)
    out, _, _ = timed_call(eng, sampling=T1, seed=5)
    assert_continues_with_plain_decoding(out, reference["ssd_t1"], reference["ar_engine"])
    eng.generate(PROMPTS, **CALL)  # back to SSD (no warning allowed)


def assert_continues_with_plain_decoding(out, clean, ar_engine):
    committed = out.metrics.fallback["committed"]
    assert 0 < sum(committed) < N * len(PROMPTS) and out.metrics.fallback["round"] > 0
    for b, c in enumerate(committed):
        got = out.token_ids[b]
        assert len(got) == N and got[:c] == clean.token_ids[b][:c], b
        if c < N:
            rest = ar_engine.generate([PROMPTS[b] + got[:c]], mode="ar", max_new_tokens=N - c,
                                      sampling=T1, seed=5, request_ids=[b])
            assert got[c:] == rest.token_ids[0], b
    assert out.token_ids != clean.token_ids or sum(committed) == N * len(PROMPTS)


def test_malformed_reply_is_refused_and_the_target_carries_on(remote, reference):
    eng, fault_file = remote
    ensure_up(eng)
    base = clean_wall(eng)
    proc = eng.worker.proc
    faults.arm(fault_file, "malformed", 2)  # the 2nd resolve reply: rows as dtype "object", a pickle
    out, warning, wall = timed_call(eng)
    assert out.token_ids == reference["ar"]
    fb = out.metrics.fallback
    assert "malformed message refused" in fb["error"] and "dtype 'object' is not allowed" in fb["error"]
    assert proc.poll() is not None  # a draft that broke the protocol is stopped
    restart_s = eng.restart_draft()
    first_s = assert_back_to_ssd(eng, reference)
    TABLE.append(dict(fault="malformed reply (rows claimed as dtype 'object', a pickle behind)",
                      saw=f"one DraftFallbackWarning: ...{fb['error'][:80]}...",
                      lost=lost(out.token_ids, reference["ar"]),
                      recover=f"call {wall - base:+.2f} s vs clean; restart_draft() "
                              f"{restart_s:.1f} s, first SSD call after it {first_s:.1f} s"))


def test_interrupted_exchange_leaves_the_draft_down_not_out_of_step(remote, reference, monkeypatch):
    """A KeyboardInterrupt mid-exchange (a notebook's stop button) reaches the user; the draft,
    whose reply may be half read, is stopped rather than left out of step, and the next call says
    so and decodes plainly until restart_draft()."""
    eng, _ = remote
    ensure_up(eng)
    real, calls = eng.worker.channel.recv, [0]

    def interrupted(*a, **k):
        calls[0] += 1
        if calls[0] == 4:
            raise KeyboardInterrupt
        return real(*a, **k)
    monkeypatch.setattr(eng.worker.channel, "recv", interrupted)
    with pytest.raises(KeyboardInterrupt):
        eng.generate(PROMPTS, **CALL)
    assert "interrupted during" in eng.worker.down and eng.worker.proc.poll() is not None
    out, warning, _ = timed_call(eng)
    assert out.token_ids == reference["ar"] and "restart_draft" in str(warning)
    eng.restart_draft()
    assert_back_to_ssd(eng, reference)


# ------------------------------------------------------------------ in-process split placement
@pytest.fixture
def planted(tmp_path):
    path = str(tmp_path / "armed")
    undo = faults.install_tree_fault(path)
    yield path
    undo()


def test_split_placement_draft_device_error(pair, reference, planted, clock):
    eng = reference["local"]
    assert eng.placement.split, "the draft must be on its own device"
    base = clean_wall(eng)
    faults.arm(planted, "raise", 3)
    out, warning, wall = timed_call(eng)
    assert out.token_ids == reference["ar"]
    fb = out.metrics.fallback
    # the CPU may run the planted computation as it is dispatched (the failure then waits for the
    # round's verify to commit) or later (it surfaces in the lookup)
    assert fb["during"] in ("dispatch_tree", "resolve") and faults.PLANTED in fb["error"], fb
    next_s = assert_back_to_ssd(eng, reference)  # the next call re-prefills the draft: SSD again
    faults.arm(planted, "raise", 3)
    with pytest.warns(DraftFallbackWarning):
        t1 = eng.generate(PROMPTS, sampling=T1, seed=5, **CALL)
    assert_continues_with_plain_decoding(t1, reference["ssd_t1"], reference["ar_engine"])
    strict = Engine(pair[1], pair[2], compilation_cache=False, strict=True)
    faults.arm(planted, "raise", 2)
    with pytest.raises(DraftFailure, match="failed during '(dispatch_tree|resolve)'") as e:
        strict.generate(PROMPTS, **CALL)
    assert all(ref[:len(t)] == t for t, ref in zip(e.value.token_ids, reference["ar"]))
    assert strict.restart_draft() >= 0 and strict.generate(PROMPTS, **CALL).metrics.fallback is None
    TABLE.append(dict(fault="the draft's tree raises on its device (in-process split placement)",
                      saw="one DraftFallbackWarning naming the error; strict=True: DraftFailure",
                      lost=lost(out.token_ids, reference["ar"]),
                      recover=f"call {wall - base:+.2f} s vs clean; the next call is SSD "
                              f"({next_s:.2f} s)"))


def test_split_placement_sd_propose_error(reference, monkeypatch):
    eng = reference["local"]

    def broken(self, *a, **k):
        raise MemoryError("RESOURCE_EXHAUSTED: out of memory on the draft's device (planted)")
    monkeypatch.setattr(DraftWorker, "propose", broken)
    with pytest.warns(DraftFallbackWarning, match="RESOURCE_EXHAUSTED"):
        out = eng.generate(PROMPTS, mode="sd", max_new_tokens=N, k=K)
    assert out.token_ids == reference["ar"] and out.metrics.fallback["during"] == "propose"
    monkeypatch.undo()
    assert eng.generate(PROMPTS, mode="sd", max_new_tokens=N, k=K).metrics.fallback is None


# ------------------------------------------------------------------ join mode and its secret
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_join_mode_refuses_peers_without_the_secret(pair, reference, monkeypatch):
    root, target, _ = pair
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    listen, secret = f"127.0.0.1:{_free_port()}", "t" * 32
    draft_cmd = [sys.executable, "-m", "ssd_jax.runtime.draft_process", "--connect", listen,
                 "--draft", str(root / "draft"), "--timeout", "60"]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    seen = {}

    def peers():
        # 1. a real draft process with the wrong secret: it is told so and exits
        t0 = time.perf_counter()
        bad = subprocess.run(draft_cmd, env=dict(env, **{SECRET_ENV: "w" * 32}),
                             capture_output=True, text=True, timeout=120)
        seen["wrong"] = (bad.returncode, bad.stderr, time.perf_counter() - t0)
        # 2. something that is no draft at all
        with socket.create_connection(parse(listen), timeout=10) as s:
            s.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            s.shutdown(socket.SHUT_WR)
            seen["http"] = s.recv(1 << 16)
        # 3. the draft with the secret
        seen["good"] = subprocess.Popen(draft_cmd, env=dict(env, **{SECRET_ENV: secret}))

    th = threading.Thread(target=peers)
    th.start()
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        rd = start_two_process(None, listen=listen, secret=secret, cores=None, timeout=120)
    th.join()
    try:
        refused = [str(w.message) for w in record if issubclass(w.category, TransportWarning)]
        assert len(refused) == 2, refused
        assert all("still waiting" in r for r in refused)
        assert any("does not know the secret" in r for r in refused)
        code, stderr, wrong_s = seen["wrong"]
        assert code != 0 and "wrong secret" in stderr, stderr[-2000:]
        assert seen["http"].startswith(b"SSDJ-AUTH1")  # all it got: the challenge, then a close
        out = Engine(target, remote_draft=rd, compilation_cache=False).generate(PROMPTS, **CALL)
        assert out.token_ids == reference["ar"]
        assert out.metrics.hits == reference["ssd"].metrics.hits and out.metrics.fallback is None
    finally:
        rd.close()
        seen["good"].wait(timeout=60)
    TABLE.append(dict(fault="join mode: a draft with the wrong secret, then an HTTP request",
                      saw="a TransportWarning per refused peer (the target keeps waiting); the "
                          "draft process exits: 'the target refused this draft: wrong secret'",
                      lost=0, recover=f"none needed: the wrong-secret draft was refused within "
                                      f"{wrong_s:.1f} s of its start; the right one joined"))


def parse(addr):
    host, port = addr.rsplit(":", 1)
    return host, int(port)


def test_join_mode_needs_a_secret_and_an_address(monkeypatch):
    monkeypatch.delenv(SECRET_ENV, raising=False)
    monkeypatch.delenv(SECRET_FILE_ENV, raising=False)
    with pytest.raises(ValueError, match="needs a shared secret"):
        start_two_process(None, listen="127.0.0.1:12355", cores=None)
    with pytest.raises(ValueError, match="needs listen="):
        start_two_process(None, secret="s" * 32, cores=None)
    with pytest.raises(ValueError, match="give host:port"):
        start_two_process(None, listen="localhost", secret="s" * 32, cores=None)
    with pytest.raises(ValueError, match="at least 16"):
        start_two_process(None, listen="127.0.0.1:12355", secret="short", cores=None)


def test_a_missing_draft_is_an_error_not_a_hang(tmp_path):
    """A draft process that cannot load its model tells the target, which raises at once."""
    t0 = time.perf_counter()
    with pytest.raises(ValueError, match="draft process: "):
        start_two_process(str(tmp_path / "nothing"), cores=None, timeout=120)
    assert time.perf_counter() - t0 < 60
