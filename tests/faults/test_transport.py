"""The two-process transport: the draft in its own process (each pinned to a core), connected over
an authenticated socket with typed frames. It gives the same tokens as the in-process engine, at
T = 0 and at T = 1 (token for token, same seed and request ids, a batch of 16), and really
overlaps: every verify step waits on a signal that only the draft's tree steps send while they run
(a serialized design times out). The wire (ssd_jax.runtime.wire) refuses every malformed frame and
every peer without the secret, and carries no pickle."""
import ast
import hashlib
import hmac
import json
import os
import pickle
import re
import socket
import struct
import subprocess
import sys
import threading

import numpy as np
import pytest
from safetensors.numpy import save_file

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import params_from_hf, perturb_hf_tensors, random_hf_tensors
from ssd_jax.runtime import wire
from ssd_jax.runtime.engine import Engine, SSDConfig
from ssd_jax.runtime.wire import REPLIES, REQUESTS, Channel, Message, TransportError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CFG = tiny_config("qwen2", vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]


def write_hf(folder, tensors):
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CFG.to_hf(), f)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_process")
    t = random_hf_tensors(CFG, 0, scale=1.0)
    d = perturb_hf_tensors(t, 0.05, seed=1)
    write_hf(root / "target", t)
    write_hf(root / "draft", d)
    return root, t, d


def run_two_process(root, signal, quant="none", draft_vocab=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", SSD_JAX_TEST_SIGNAL=str(signal),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_two_process_target.py"),
                           str(root / "draft"), str(root / "target"), str(signal), quant,
                           *([str(draft_vocab)] if draft_vocab else [])],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_same_as_in_process(got: dict, eng: Engine):
    """The two-process run's SSD (both backups) and SD outputs equal `eng`'s in-process ones:
    tokens, cache hits and the SD accept histogram."""
    for backup in ("neural", "random"):
        want = eng.generate(PROMPTS, mode="ssd", max_new_tokens=20, k=3,
                            ssd=SSDConfig(fanout=(2, 2, 1, 1), backup=backup))
        assert got[backup]["tokens"] == want.token_ids, backup
        assert got[backup]["hits"] == want.metrics.hits, backup
    sd = eng.generate(PROMPTS, mode="sd", max_new_tokens=20, k=3)
    assert got["sd"]["tokens"] == sd.token_ids
    assert got["sd"]["accept_hist"] == list(sd.metrics.accept_hist)


def test_two_process_equals_in_process_and_overlaps(pair):
    root, t, d = pair
    got = run_two_process(root, root / "signal.txt")
    eng = Engine(Model(CFG, params_from_hf(t, CFG)), Model(CFG, params_from_hf(d, CFG)),
                 compilation_cache=False)
    assert_same_as_in_process(got, eng)
    for backup in ("neural", "random"):
        assert 0 < got[backup]["hits"] < got[backup]["lookups"]
    # backup="auto" in the draft process: at T = 0 whichever backup served a miss, the tokens are
    # plain decoding's; every miss was served, by a kind auto chooses from
    auto = got["auto"]
    assert auto["fallback"] is None and auto["tokens"] == got["neural"]["tokens"], auto
    assert 0 < auto["hits"] < auto["lookups"], auto
    assert sum(auto["backups"].values()) > 0 and set(auto["backups"]) <= {"neural", "random"}, auto
    # the overlap proof: every verify saw a tree step run while it was executing
    assert len(got["saw_tree"]) >= 4 and all(got["saw_tree"]), got["saw_tree"]
    # timed rounds: the same tokens; each round has its verify, the draft process's tree and
    # exchange seconds, and backup (the draft process's resolve) seconds exactly where it missed
    timed = got["timed"]
    assert timed["tokens"] == got["neural"]["tokens"]
    for verify_s, tree_s, backup_s, exchange_s, hit, lookups in timed["rounds"]:
        assert verify_s > 0 and tree_s > 0 and exchange_s > 0, timed["rounds"]
        assert (backup_s > 0) == (hit < lookups), timed["rounds"]
    # T = 1: the draft's draws (keyed by seed, request id, position) and its proposal rows cross
    # the wire unchanged, so every sampled token, hit and acceptance is the in-process one
    T1 = got["t1_batch"]  # the batch the target script ran: prompts, budget, K, seed, request ids
    assert len(T1["prompts"]) == 16
    t1 = dict(T1, sampling=SamplingParams(temperature=1.0))
    for mode in ("ssd", "sd"):
        want = eng.generate(mode=mode, ssd=SSDConfig(fanout=(2, 2, 1, 1)), **t1)
        mine = got[f"t1_{mode}"]
        assert mine["fallback"] is None
        assert mine["tokens"] == want.token_ids, mode
        assert mine["hits"] == want.metrics.hits and mine["accept_hist"] == list(
            want.metrics.accept_hist), mode
        # a real T = 1 run: the samples are not the greedy ones, the draft is not always accepted
        assert 0 < want.metrics.accept_hist[0] < sum(want.metrics.accept_hist)
    greedy = eng.generate(T1["prompts"], mode="ar", max_new_tokens=16).token_ids
    assert got["t1_ssd"]["tokens"] != greedy


@pytest.mark.parametrize("quant,draft_vocab", [("int8", None), ("int8", 40), ("int4", None)])
def test_two_process_quantized_draft_equals_in_process(pair, quant, draft_vocab):
    """`start_two_process(..., quant="int8", draft_vocab=n)` prepares the draft in its process
    exactly as `ssd_jax.models.draft_head.prepare_draft` does in-process. An unquantized remote draft
    would give the same tokens but not the same counts (this pair: random-backup hits 18 vs 17, SD
    accept histogram [5, 5, 2, 10] vs [6, 5, 2, 10]); an uncut one differs from a cut one too."""
    from ssd_jax.models.draft_head import prepare_draft
    root, t, d = pair
    got = run_two_process(root, "-", quant=quant, draft_vocab=draft_vocab)
    assert_same_as_in_process(got, Engine(Model(CFG, params_from_hf(t, CFG)),
                                          prepare_draft(Model(CFG, params_from_hf(d, CFG)), quant,
                                                        draft_vocab),
                                          compilation_cache=False))


def test_draft_format_auto_is_chosen_in_the_draft_process_and_a_bad_one_fails_at_once(pair):
    """quant="auto" is what `defaults.choose` picks, decided where the draft runs (its own
    machine's devices); an unknown format is a ValueError before any process starts (it used to
    surface as a join timeout after the spawned process exited on its argument)."""
    import jax
    from ssd_jax.models.draft_head import prepare_draft
    from ssd_jax.models.load import load_model
    from ssd_jax.runtime.defaults import choose
    from ssd_jax.runtime.draft_process import _load
    from ssd_jax.runtime.transport import start_two_process
    root, _, _ = pair
    c = choose("auto", "auto", "auto")
    got, _, _ = _load(str(root / "draft"), "auto", None, "auto")
    want = prepare_draft(load_model(str(root / "draft"), c["dtype"], with_tokenizer=False),
                         c["draft_quant"])
    assert jax.tree.structure(got.params) == jax.tree.structure(want.params)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(got.params),
                                                    jax.tree.leaves(want.params)))
    with pytest.raises(ValueError, match="unknown draft format quant='fp8'"):
        start_two_process(str(root / "draft"), quant="fp8", cores=None)


# --------------------------------------------------------------------------------- the wire
@pytest.fixture
def link():
    a, b = socket.socketpair()
    yield Channel(a, max_bytes=1 << 20), Channel(b, max_bytes=1 << 20), a
    a.close()
    b.close()


def _raw(header: dict, payload: bytes = b"") -> bytes:
    h = json.dumps(header).encode()
    return struct.pack("!4sBI", wire.MAGIC, wire.VERSION, len(h)) + h + payload


def test_frames_round_trip_every_kind_and_dtype(link):
    send, recv, _ = link
    import ml_dtypes
    for dtype in ("float32", "bfloat16", "float16"):
        rows = np.random.default_rng(0).random((2, 3, 5)).astype(
            ml_dtypes.bfloat16 if dtype == "bfloat16" else dtype)
        msg = Message("resolved", {"times": {"tree_s": 0.5, "resolve_s": 0}},
                      {"spec": np.arange(6, dtype=np.int32).reshape(2, 3), "rows": rows,
                       "hit": np.array([True, False]),
                       "lookups_by_accept": np.array([3, 1, 0, 2], np.int32),
                       "hits_by_accept": np.array([2, 1, 0, 1], np.int32),
                       "backups": np.array([2, 0, 0], np.int32)})
        send.send(msg)
        got = recv.recv(REPLIES, timeout=5)
        assert got.kind == "resolved" and got.fields == msg.fields
        for k in msg.arrays:
            assert got.arrays[k].dtype == msg.arrays[k].dtype
            np.testing.assert_array_equal(got.arrays[k], msg.arrays[k])
    # what the draft compiled before a reply: one record a program
    programs = [["jit(stored_draft_tree)", "persistent cache", 4.8, 0.1, 0.2, 4.5, 1]]
    send.send(Message("compiled", {"programs": programs}))
    assert recv.recv(REPLIES, timeout=5).fields["programs"] == programs
    # a warm-up's account, sent on its own after the "warm" request's "ok"
    warmed = {"seconds": 11.2, "programs": programs, "error": None}
    send.send(Message("warmed", warmed))
    assert recv.recv(REPLIES, timeout=5).fields == warmed
    send.send(Message("info", {"vocab_rows": 64, "vocab_size": 60, "fingerprint": None,
                               "name": "d", "backend": "xla"}))
    assert recv.recv(REPLIES, timeout=5).fields["fingerprint"] is None


def test_a_rounds_outcome_crosses_the_wire_and_the_draft_checks_it(link):
    """The device loop's requests carry the round's packed `Outcome` (one int32 array) and, for
    "resolve", backup="auto"'s choice; the draft process refuses an outcome it cannot serve
    (`draft_process.decode_outcome`) with a ValueError naming what is wrong, which it reports as
    its own error (the target falls back)."""
    from ssd_jax.runtime.config import CallConfig
    from ssd_jax.runtime.draft_process import decode_outcome

    send, recv, _ = link
    K, V = 2, 8
    # num_accepted, bonus_out, n, prev, bonus, active, then a report of K + 1 token columns
    cols = np.array([[0, 1, 3, 2, 1, 1], [2, 5, 7, 4, 5, 0]], np.int32)
    report = np.zeros((2, 4 + 2 * (K + 1)), np.int32)
    good = np.concatenate([cols, report], 1)
    run = CallConfig(k=K, seed=1, request_ids=(4, 5), draft_sampling=SamplingParams())
    for neural in (None, True, False):
        send.send(Message("resolve", dict(run.draft_fields(), neural=neural),
                          {"outcome": good}))
        got = recv.recv(REQUESTS, timeout=5)
        assert got.fields["neural"] is neural
        np.testing.assert_array_equal(decode_outcome(got.arrays, K, V, resolve=True), good)
    np.testing.assert_array_equal(decode_outcome({"outcome": good[:, :12]}, K, V, False),
                                  good[:, :12])  # round 1's view: a one-token report
    bad = {"odd report width": (good[:, :-1], "columns"),
           "K + 1 tokens": (good[:, :12], "K + 1 = 3"),
           "position 0": (np.where(np.arange(good.shape[1]) == 2, 0, good), "out of range"),
           "token past the rows": (np.where(np.arange(good.shape[1]) == 4, V, good), "out of range"),
           "accepted > K": (np.where(np.arange(good.shape[1]) == 0, K + 1, good), "out of range"),
           "active flag 2": (np.where(np.arange(good.shape[1]) == 5, 2, good), "out of range")}
    for case, (packed, needle) in bad.items():
        with pytest.raises(ValueError, match=re.escape(needle)):
            decode_outcome({"outcome": packed.astype(np.int32)}, K, V, resolve=True)
            pytest.fail(case)


BAD_FRAMES = {
    "pickle": (pickle.dumps({"kind": "ok"}), "not an ssd_jax frame"),
    "version": (struct.pack("!4sBI", wire.MAGIC, 99, 2) + b"{}", "wire version 99"),
    "huge header": (struct.pack("!4sBI", wire.MAGIC, wire.VERSION, 1 << 24), "over the limit"),
    "not json": (struct.pack("!4sBI", wire.MAGIC, wire.VERSION, 4) + b"\x80abc", "not JSON"),
    "NaN": (_raw({"kind": "resolved", "fields": {"times": {"x": float("nan")}}, "arrays": []}),
            "not JSON"),
    "unknown kind": (_raw({"kind": "exec", "fields": {}, "arrays": []}), "unexpected kind 'exec'"),
    "request as reply": (_raw({"kind": "start", "fields": {}, "arrays": []}), "unexpected kind"),
    "object dtype": (_raw({"kind": "spec", "fields": {}, "arrays": [
        ["spec", "int32", [1, 1]], ["rows", "object", [8]]]}, b"\0" * 12),
        "dtype 'object' is not allowed"),
    "wrong dtype": (_raw({"kind": "spec", "fields": {}, "arrays": [
        ["spec", "float32", [1, 1]], ["rows", "float32", [1, 1, 1]]]}), "dtype 'float32'"),
    "rank": (_raw({"kind": "spec", "fields": {}, "arrays": [
        ["spec", "int32", [1]], ["rows", "float32", [1, 1, 1]]]}), "is not 2 sizes"),
    "negative size": (_raw({"kind": "spec", "fields": {}, "arrays": [
        ["spec", "int32", [1, -1]], ["rows", "float32", [1, 1, 1]]]}), "is not 2 sizes"),
    "too big": (_raw({"kind": "spec", "fields": {}, "arrays": [
        ["spec", "int32", [1, 1]], ["rows", "float32", [1024, 1024, 1]]]}), "over the limit"),
    "missing field": (_raw({"kind": "error", "fields": {"message": "x"}, "arrays": []}),
                      "needs fields"),
    "field type": (_raw({"kind": "error", "fields": {"message": 3, "during": "x"}, "arrays": []}),
                   "'message' must be str"),
    "bool byte": (_raw({"kind": "resolved", "fields": {"times": {}}, "arrays": [
        ["spec", "int32", [1, 1]], ["rows", "float32", [1, 1, 1]], ["hit", "bool", [1]],
        ["lookups_by_accept", "int32", [0]], ["hits_by_accept", "int32", [0]],
        ["backups", "int32", [0]]]}, b"\0" * 8 + b"\x07"), "bool byte"),
    "extra key": (_raw({"kind": "ok", "fields": {}, "arrays": [], "code": "x"}), "header must be"),
    "compile record": (_raw({"kind": "compiled", "fields": {"programs": [
        ["jit(x)", "compiled", -1.0, 0, 0, 0, 1]]}, "arrays": []}), "'programs' must be records"),
}


@pytest.mark.parametrize("case", sorted(BAD_FRAMES))
def test_malformed_frames_are_refused_with_a_clear_error(link, case):
    _, recv, peer = link
    raw, needle = BAD_FRAMES[case]
    peer.sendall(raw)
    with pytest.raises(TransportError, match="malformed message refused") as e:
        recv.recv(REPLIES, timeout=5)
    assert e.value.kind == "malformed" and needle in str(e.value), str(e.value)


def test_truncated_frame_and_silence_are_closed_and_timeout(link):
    send, recv, peer = link
    peer.sendall(_raw({"kind": "spec", "fields": {}, "arrays": [
        ["spec", "int32", [1, 1]], ["rows", "float32", [1, 1, 2]]]}, b"\0" * 6))
    with pytest.raises(TransportError, match="no answer in 0.3 s") as e:
        recv.recv(REPLIES, timeout=0.3)
    assert e.value.kind == "timeout"
    peer.close()
    with pytest.raises(TransportError, match="closed") as e:
        recv.recv(REPLIES, timeout=5)
    assert e.value.kind == "closed"


def test_a_sender_cannot_emit_what_a_receiver_refuses(link):
    send, _, _ = link
    with pytest.raises(TransportError, match="dtype 'int64'"):
        send.send(Message("spec", {}, {"spec": np.zeros((1, 1), np.int64),
                                        "rows": np.zeros((1, 1, 1), np.float32)}))
    with pytest.raises(TransportError, match="'cache_len' must be int"):
        send.send(Message("start", {"cache_len": 3.5, "row_vocab": 4},
                          {"tokens": np.zeros((1, 1), np.int32), "lens": np.ones(1, np.int32)}))
    assert set(REQUESTS).isdisjoint(REPLIES)


def _pair_with_handshake(target_key, draft_key):
    a, b = socket.socketpair()
    errs = {}

    def draft_side():
        try:
            wire.handshake_draft(b, draft_key, timeout=5)
        except TransportError as e:
            errs["draft"] = e
    th = threading.Thread(target=draft_side)
    th.start()
    try:
        wire.handshake_target(a, target_key, timeout=5)
    except TransportError as e:
        errs["target"] = e
    th.join()
    a.close()
    b.close()
    return errs


def test_handshake_needs_the_same_secret_on_both_sides():
    key = b"k" * 32
    assert _pair_with_handshake(key, key) == {}
    errs = _pair_with_handshake(key, b"x" * 32)
    assert errs["target"].kind == "auth" and "does not know the secret" in str(errs["target"])
    assert "wrong secret" in str(errs["draft"])


def test_a_peer_that_is_not_a_target_is_refused_by_the_draft():
    a, b = socket.socketpair()
    a.sendall(b"HTTP/1.1 200 OK\r\n\r\n" + b"x" * 64)
    with pytest.raises(TransportError, match="not an ssd_jax target"):
        wire.handshake_draft(b, b"k" * 32, timeout=5)
    # a target that answers the challenge without the secret is not believed either
    a2, b2 = socket.socketpair()
    nonce = b"n" * 32

    def fake_target():
        a2.sendall(b"SSDJ-AUTH1" + nonce)
        a2.recv(64)
        a2.sendall(b"OKAY" + hmac.new(b"z" * 32, b"target", hashlib.sha256).digest())
    th = threading.Thread(target=fake_target)
    th.start()
    with pytest.raises(TransportError, match="did not prove the secret"):
        wire.handshake_draft(b2, b"k" * 32, timeout=5)
    th.join()
    for s in (a, b, a2, b2):
        s.close()


def test_secrets_come_from_argument_env_or_file_and_must_be_long(tmp_path):
    f = tmp_path / "secret"
    f.write_text("s" * 20 + "\n")
    assert wire.read_secret(secret_file=str(f), env={}) == b"s" * 20
    assert wire.read_secret(env={wire.SECRET_ENV: "e" * 16}) == b"e" * 16
    assert wire.read_secret(env={wire.SECRET_FILE_ENV: str(f)}) == b"s" * 20
    assert wire.read_secret("a" * 16, env={wire.SECRET_ENV: "e" * 16}) == b"a" * 16
    assert wire.read_secret(env={}) is None
    with pytest.raises(ValueError, match="at least 16"):
        wire.read_secret("short", env={})


def test_no_pickle_in_the_transport():
    """Neither side of the exchange imports pickle (or another deserialiser of code)."""
    for mod in ("wire", "transport", "draft_process", "fallback"):
        src = open(os.path.join(ROOT, "ssd_jax", "runtime", f"{mod}.py")).read()
        imported = set()
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Import):
                imported |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                imported.add(node.module.split(".")[0])
        assert not imported & {"pickle", "cPickle", "dill", "cloudpickle", "marshal", "shelve"}, mod
        assert "multihost_utils" not in src and "distributed.initialize" not in src, mod


def test_the_draft_process_reports_many_compiles_in_frames_that_fit():
    """A draft process that compiled 250 programs (long names) before a reply: "compiled" frames
    of at most 100 records, each header within wire.MAX_HEADER, and its timer emptied."""
    from ssd_jax.runtime.draft_process import DraftServer
    from ssd_jax.runtime.metrics import CompileTimer

    sent = []

    class Channel:
        def send(self, msg):
            sent.append((msg, wire.encode(msg)))

    server = DraftServer(Channel(), model=None)
    server.timer = CompileTimer()
    server.timer.programs = {f"jit({'x' * 5000}{i})": dict(
        seconds=1.0, trace_s=0.1, lower_s=0.2, compile_s=0.7, count=1, source="compiled")
        for i in range(250)}
    server._send_compiles()
    assert [len(m.fields["programs"]) for m, _ in sent] == [100, 100, 50]
    assert all(len(frame[0]) <= wire.MAX_HEADER for _, frame in sent)
    assert server.timer.programs == {} and server.timer.seconds == 0.0
