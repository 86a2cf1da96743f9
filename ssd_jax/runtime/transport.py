"""The draft in a second process, over an authenticated point-to-point socket.

On a 2-core CPU one JAX process spreads every forward over both cores, so two meshes in one process
barely overlap. Here the target process is pinned to one core and a draft process to another;
they exchange only token ids, outcome integers and proposal rows as typed numpy frames
(`ssd_jax.runtime.wire`: no pickle, size-checked, HMAC handshake on connect).

    remote = start_two_process("qwen2.5-coder-0.5b")   # best before other JAX use (core pinning)
    engine = Engine(load_model("qwen2.5-coder-1.5b"), remote_draft=remote)

`RemoteDraft` has the methods of `DraftWorker` the engine calls; the draft process runs the same
`DraftWorker` and, right after sending a speculation, dispatches its tree for it — so the tree runs
while the target verifies that speculation.

No runtime ties the two processes' lives together (this used to be jax.distributed, whose
heartbeat aborts the survivor): a draft process that dies, is silent past `reply_timeout` (its
"compiling" heartbeats aside: a compile is not a hang, up to `warmup_timeout`) or sends a
frame that fails its checks is a `TransportError` in the target, which the engine turns into a
fallback to plain decoding (`ssd_jax.runtime.fallback`); `RemoteDraft.restart` brings it back.
"""
from __future__ import annotations

import atexit
import os
import socket
import subprocess
import sys
import time
import warnings

import numpy as np

from ssd_jax.runtime.wire import (REPLIES, SECRET_ENV, SECRET_FILE_ENV, Channel, Message,
                                  TransportError, handshake_target, new_secret, parse_address,
                                  read_secret)

DEFAULT_REPLY_TIMEOUT = 120.0  # seconds of silence the target waits for one answer
DEFAULT_WARMUP_TIMEOUT = 1800.0  # seconds it waits for an answer while the draft says "compiling"


class TransportWarning(UserWarning):
    """A peer was refused while the target waited for its draft (the wait goes on)."""


class _Listener:
    """Where the target waits for its draft: one TCP socket, loopback unless told otherwise."""

    def __init__(self, listen: str):
        host, port = parse_address(listen)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.sock = socket.create_server((host, port), family=family)
        self.address = self.sock.getsockname()[:2]

    def accept(self, key: bytes, deadline: float, alive, timeout: float) -> Channel:
        """The first peer that passes the handshake; every other one is refused (a
        TransportWarning each) and the wait goes on until `deadline`."""
        refused = []
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                why = f"; refused {len(refused)} peer(s), last: {refused[-1]}" if refused else ""
                raise TransportError("timeout", f"no draft joined {self.where} in {timeout:g} s{why}")
            self.sock.settimeout(min(1.0, left))
            try:
                conn, peer = self.sock.accept()
            except socket.timeout:
                alive()
                continue
            try:
                handshake_target(conn, key, timeout=min(10.0, max(left, 0.1)))
            except TransportError as e:
                conn.close()
                refused.append(f"{peer[0]}:{peer[1]} ({e})")
                warnings.warn(TransportWarning(f"ssd_jax: refused a draft peer from {peer[0]}:"
                                               f"{peer[1]}: {e}; still waiting for the draft"),
                              stacklevel=4)
                continue
            return Channel(conn)

    @property
    def where(self) -> str:
        """host:port as a draft would connect to it."""
        host, port = self.address
        return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"

    def close(self):
        """Stop listening."""
        self.sock.close()


class RemoteDraft:
    """Target-side proxy of the draft process (the methods the engine calls on a DraftWorker).

    Every request has one reply, waited for at most `reply_timeout` seconds of silence: while the
    draft process lowers or compiles a step it sends a "compiling" heartbeat about every
    `wire.HEARTBEAT_S`, and each one restarts that clock, so a compile never counts as a hang; a
    reply still compiling after `warmup_timeout` seconds counts as hung. A draft that goes
    away, hangs or sends a malformed frame marks this proxy down (`down` says why; a process this
    one spawned is killed) and raises TransportError; an error the draft process reports about its
    own computation raises TransportError("remote") and leaves the connection up (the next
    generate call starts afresh). `restart()` starts a spawned draft again, or waits for a
    joining one to connect again."""

    remote = True

    def __init__(self, cmd: list[str] | None, env: dict | None, listen: str, key: bytes,
                 timeout: float, reply_timeout: float,
                 warmup_timeout: float = DEFAULT_WARMUP_TIMEOUT):
        self.cmd, self.env, self.listen, self.key = cmd, env, listen, key
        self.timeout, self.reply_timeout = float(timeout), float(reply_timeout)
        self.warmup_timeout = float(warmup_timeout)
        self.proc: subprocess.Popen | None = None
        self.channel: Channel | None = None
        self.down: str | None = "not connected"
        self.info: dict = {}
        self._warming: float | None = None  # when `warm` was sent, until its "warmed" is read
        self.warmup: dict | None = None  # the last warm-up's account (`warmed`)
        self.counters = None  # the call's lookup counters (`LookupCounters`, summed), SSD
        self.times: dict[str, float] = {}  # the last resolve's seconds (`resolve_on_device`)
        self._connect()
        self.row_vocab = self.info["vocab_rows"]  # set by the engine to the target's rows
        atexit.register(self.close)

    @property
    def name(self) -> str:
        """The draft as its process names it (the model it loaded)."""
        return str(self.info.get("name", "remote draft"))

    def bind(self, target) -> "RemoteDraft":
        """Check the draft fits `target` (a Model: one tokenizer, by fingerprint) and pad / cut its
        proposal rows to the target's embedding rows; returns self (the engine's worker)."""
        fp = self.info.get("fingerprint")
        if fp is not None and target.tokenizer is not None and fp != target.tokenizer.fingerprint():
            raise ValueError("draft and target have different tokenizers: speculative decoding "
                             "needs one shared vocabulary")
        self.row_vocab = int(target.cfg.vocab_size)
        return self

    # ------------------------------------------------------------------ connection
    def _alive(self):
        if self.proc is not None and self.proc.poll() is not None:
            raise TransportError("closed", f"the draft process exited with code {self.proc.returncode}")

    def _connect(self):
        listener = _Listener(self.listen)
        deadline = time.monotonic() + self.timeout
        try:
            if self.cmd is not None:
                self.proc = subprocess.Popen(self.cmd + ["--connect", listener.where], env=self.env)
            self.channel = listener.accept(self.key, deadline, self._alive, self.timeout)
        except BaseException as e:
            self._kill()
            if isinstance(e, TransportError):
                raise RuntimeError(f"the draft process did not join: {e}") from e
            raise
        finally:
            listener.close()
        try:
            msg = self.channel.recv({k: REPLIES[k] for k in ("info", "error")},
                                    timeout=max(deadline - time.monotonic(), 1.0), alive=self._alive)
        except TransportError as e:
            self._kill()
            raise RuntimeError(f"the draft process did not say what it loaded: {e}") from e
        if msg.kind == "error":
            self._kill()
            raise ValueError(f"draft process: {msg.fields['message']}")
        self.info, self.down = dict(msg.fields), None

    def _kill(self):
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass

    def _fail(self, e: TransportError) -> TransportError:
        time.sleep(0.05)  # a process that just died: let its exit code arrive
        dead = self.proc is not None and self.proc.poll() is not None
        self._kill()
        why = str(e)
        if dead and "exited" not in why:
            why += f" (the draft process exited with code {self.proc.returncode})"
        elif self.proc is not None:
            why += " (the draft process was stopped)"
        self.down = why
        return TransportError(e.kind, why)

    def _ask(self, kind: str, fields: dict, arrays: dict, reply: str,
             timeout: float | None = None) -> Message:
        if self.down is not None:
            raise TransportError("down", f"the draft process is down: {self.down}; "
                                         f"engine.restart_draft() starts it again")
        t = self.reply_timeout if timeout is None else timeout
        try:
            self.channel.send(Message(kind, fields, arrays), timeout=t)
            msg = self._await(kind, reply, t)
        except TransportError as e:
            raise self._fail(e) from e
        except BaseException:  # e.g. KeyboardInterrupt: a reply may be half read or still due
            self._fail(TransportError("closed", f"interrupted during {kind!r}"))
            raise
        if msg.kind == "error":
            raise TransportError("remote", f"the draft process raised during {kind!r}: "
                                           f"{msg.fields['message']}")
        return msg

    def _await(self, kind: str, reply: str, t: float) -> Message:
        """The reply to request `kind` (or an "error"), reading past the heartbeats, "compiled"
        frames (the call's compile time: the reply waited for them) and a warm-up's "warmed"."""
        expect = {reply: REPLIES[reply], "error": REPLIES["error"],
                  "compiling": REPLIES["compiling"], "compiled": REPLIES["compiled"]}
        if self._warming is not None:
            expect["warmed"] = REPLIES["warmed"]
        t0 = time.monotonic()
        cap = t0 + max(self.warmup_timeout, t)
        while True:  # heartbeats while the draft compiles: each restarts the reply clock
            msg = self.channel.recv(expect, timeout=t, alive=self._alive)
            if msg.kind == "compiled":
                _count_compiles(msg.fields["programs"])
            elif msg.kind == "warmed" and reply != "warmed":
                self._take_warmed(msg, t0)
                expect.pop("warmed")
            elif msg.kind != "compiling":
                return msg
            if time.monotonic() > cap:
                raise TransportError("timeout", f"still compiling after {self.warmup_timeout:g} "
                                                f"s (warmup_timeout) during {kind!r}")

    def _take_warmed(self, msg: Message, since: float, count: bool = True) -> dict:
        """Keep a "warmed" frame's account in `warmup`, with the seconds waited for it since
        `since`. Read while a request of a call waited (`count`), those seconds count as that
        call's compile time, one program "draft process: the warm-up, still running"."""
        f = msg.fields
        waited = max(time.monotonic() - since, 0.0)
        self.warmup = dict(seconds=float(f["seconds"]), waited_s=waited, error=f["error"],
                           programs={name: dict(source=source, seconds=seconds, count=n)
                                     for name, source, seconds, _, _, _, n in f["programs"]})
        self._warming = None
        if count and waited >= 1e-3:
            _count_compiles([["the warm-up, still running", "compiled", waited, 0.0, 0.0, waited,
                              1]])
        return self.warmup

    def _spec(self, msg: Message, batch: int, k: int, hit: bool = False):
        a = msg.arrays
        want = {"spec": (batch, k), "rows": (batch, k, self.row_vocab), "hit": (batch,)}
        for name, arr in a.items():
            if name in want and arr.shape != want[name]:
                raise self._fail(TransportError("malformed", f"malformed message refused: {name} "
                                                f"of shape {arr.shape}, expected {want[name]}"))
        spec = a["spec"]
        if spec.size and (spec.min() < 0 or spec.max() >= self.row_vocab):
            raise self._fail(TransportError("malformed", "malformed message refused: a speculated "
                                                         f"token outside [0, {self.row_vocab})"))
        return (spec, a["rows"], a["hit"]) if hit else (spec, a["rows"])

    # ------------------------------------------------------------------ the DraftWorker calls
    def start(self, prompt_tokens, prompt_lens, cache_len):
        """Send prompt_tokens `[B, T]`, prompt_lens `[B]`, cache_len S and the row vocabulary V: the
        draft process builds its worker if needed (the first time: up to `timeout` seconds) and
        dispatches its prefill."""
        self.counters, self.times = None, {}  # the call's, from its first round on
        self._ask("start", {"cache_len": int(cache_len), "row_vocab": int(self.row_vocab)},
                  {"tokens": np.asarray(prompt_tokens, np.int32),
                   "lens": np.asarray(prompt_lens, np.int32)}, "ok",
                  timeout=max(self.timeout, self.reply_timeout))

    def ready(self):
        """Block until the draft process's prefill is done."""
        self._ask("ready", {}, {}, "ok")

    def propose_from(self, packed, run):
        """SD drafting in the draft process from a round's packed `Outcome` (on the target's
        mesh: fetched once and sent): (spec `[B, K]`, rows `[B, K, V]` as numpy, the outcome
        unpacked on the host)."""
        return self._speculation("propose", packed, run)

    def first(self, packed, run):
        """SSD's round 1 in the draft process (a backup from the rows after the prefill, packed:
        `round_steps.round_view`): (spec `[B, K]`, rows `[B, K, V]`, the view unpacked on the
        host); the draft process then dispatches its tree at once. Zeroes the call's lookup
        counters."""
        from ssd_jax.algorithm.lookup_counters import LookupCounters
        out = self._speculation("first", packed, run)
        self.counters = LookupCounters.zeros(run.k, 1)
        return out

    def _speculation(self, kind: str, packed, run):
        """Request `kind` ("propose", "first") with the packed outcome; its "spec" reply."""
        p = _fetched(packed)
        spec, rows = self._spec(self._ask(kind, run.draft_fields(), {"outcome": p}, "spec"),
                                len(p), run.k)
        return spec, rows, _unpacked(p)

    def dispatch_tree(self, s, spec, from_backup, run):
        """Nothing to do here: the draft process dispatched the tree when it sent `spec`."""

    def tree_ready(self) -> None:
        """Nothing to wait for here: the draft process times its tree (`times`)."""

    def warm(self, call) -> None:
        """Have the draft process run a throwaway call of `call`'s shapes (a
        `ssd_jax.runtime.warmup.CallPlan`) so that call finds the draft's programs compiled or
        loaded. Returns once the draft process has the request: it warms up while this process
        goes on (loading the target); `warmed()` waits for the end, and so does the next call."""
        self._ask("warm", dict(call.call.draft_fields(), cache_len=int(call.cache_len),
                               row_vocab=int(call.row_vocab), mode=str(call.mode)),
                  {"tokens": np.asarray(call.tokens, np.int32),
                   "lens": np.asarray(call.lens, np.int32)}, "ok")
        self._warming, self.warmup = time.monotonic(), None

    def warmed(self) -> dict | None:
        """Wait for the warm-up `warm` started to end (heartbeats keep a compile from counting
        as a hang) and return its account: {"seconds": its time in the draft process,
        "waited_s": the part of it this call waited for, "programs": {name: {"source",
        "seconds", "count"}}, "error": its error or None}; None if no warm-up was asked for.
        The waited seconds are the caller's: no call counts them."""
        if self._warming is None:
            return self.warmup
        if self.down is not None:
            raise TransportError("down", f"the draft process is down: {self.down}")
        t0 = time.monotonic()
        try:
            msg = self._await("warm", "warmed", max(self.timeout, self.reply_timeout))
        except TransportError as e:
            raise self._fail(e) from e
        if msg.kind == "error":  # a frame no request asked for: the exchange is broken
            raise self._fail(TransportError("malformed", "an error frame while no request was "
                                                         f"pending: {msg.fields['message']}"))
        return self._take_warmed(msg, t0, count=False)

    def resolve_on_device(self, packed, run, neural: bool | None = None):
        """The round's packed `Outcome` (fetched once) to the draft process, which looks it up,
        drafts the backup for the rows that missed and (after its reply) the next tree; returns
        (spec `[B, K]`, rows `[B, K, V]`, missed `[B]`, the round's report with its hit column,
        the outcome unpacked), host arrays, as `DraftWorker.resolve_on_device` returns them on
        the draft's mesh. `counters` becomes the call's lookup counters so far and `times` the
        draft process's seconds: "tree_s" (this round's tree, dispatch to ready), "resolve_s"
        (the lookup and any backup), "exchange_s" (the round trip less its handling).
        neural: backup="auto"'s choice for this round."""
        from ssd_jax.algorithm import decode_state as ds
        from ssd_jax.algorithm.lookup_counters import BACKUP_INDEX, LookupCounters

        p = _fetched(packed)
        t0 = time.perf_counter()  # the round trip, not the wait for the verify before it
        msg = self._ask("resolve", dict(run.draft_fields(), neural=neural), {"outcome": p},
                        "resolved")
        spec, rows, hit = self._spec(msg, len(p), run.k, hit=True)
        a = msg.arrays
        want = {"lookups_by_accept": run.k + 1, "hits_by_accept": run.k + 1,
                "backups": len(BACKUP_INDEX)}
        for name, size in want.items():
            if a[name].shape != (size,) or (a[name].size and a[name].min() < 0):
                raise self._fail(TransportError("malformed", f"malformed message refused: "
                                                f"{name} of shape {a[name].shape}, expected "
                                                f"({size},) counts"))
        self.counters = LookupCounters(*(a[name][None] for name in want))
        times = dict(msg.fields["times"])
        times["exchange_s"] = max(time.perf_counter() - t0 - times.pop("handle_s", 0.0), 0.0)
        self.times = times
        o = _unpacked(p)
        report = o.report.copy()
        report[:, ds.R_HIT] = np.where(o.active, hit, -1)  # `decode_state.with_hits`, on the host
        return spec, rows, ~hit & o.active, report, o

    def finish(self):
        """End of a generate call: the draft process drops its pending tree."""
        self._ask("finish", {}, {}, "ok")

    # ------------------------------------------------------------------ life cycle
    def restart(self) -> None:
        """Start the draft again: a spawned process is killed (if still there) and spawned anew; a
        joining one is waited for on the same address (up to `timeout` seconds). The new draft
        must be the same model as the old (embedding rows and tokenizer)."""
        old = dict(self.info)
        self._kill()
        self._warming = None
        self.down = "restarting"
        self._connect()
        for key in ("vocab_rows", "vocab_size", "fingerprint"):
            if old.get(key) != self.info.get(key):
                self.close()
                self.down = f"the restarted draft differs from the old one in {key}"
                raise ValueError(self.down)

    def close(self):
        """Stop the draft process (asked first, killed if it does not exit within 30 s)."""
        if self.down is None:
            try:
                self._ask("shutdown", {}, {}, "ok", timeout=10.0)
            except TransportError:
                pass
        self.down = self.down or "closed"
        if self.channel is not None:
            self.channel.close()
        if self.proc is not None and self.proc.poll() is None:
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=30)


def _fetched(packed) -> np.ndarray:
    """A packed `Outcome` as the int32 numpy array the wire carries (one device-to-host read)."""
    from ssd_jax.runtime.placement import to_host
    return np.ascontiguousarray(to_host(packed), np.int32)


def _unpacked(p: np.ndarray):
    """`round_steps.Outcome.unpack` on the host."""
    from ssd_jax.algorithm.round_steps import Outcome
    return Outcome.unpack(p)


def _count_compiles(programs: list) -> None:
    """A "compiled" frame's records into the call's compile time (`CompileTimer.add_remote`),
    each program named "draft process: <its name>"."""
    from ssd_jax.runtime.metrics import CompileTimer
    for name, source, seconds, trace_s, lower_s, compile_s, count in programs:
        CompileTimer.add_remote(f"draft process: {name}", dict(
            seconds=seconds, trace_s=trace_s, lower_s=lower_s, compile_s=compile_s, count=count,
            source=source))


def start_two_process(draft: str | None, *, dtype: str = "float32", quant: str = "none",
                      draft_vocab: int | None = None,
                      cores: tuple[int, int] | None = (0, 1), cache_dir: str | None = None,
                      timeout: float = 300, reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
                      warmup_timeout: float = DEFAULT_WARMUP_TIMEOUT,
                      draft_main: str | None = None, listen: str | None = None,
                      secret: str | bytes | None = None,
                      secret_file: str | None = None,
                      compilation_cache: bool | str = True,
                      step_store: bool | None = None) -> RemoteDraft:
    """Launch the draft process (or wait for one to join) and connect to it.

    draft: a default model name, a .gguf file, an HF folder, or a directory written by
    `ssd_jax.models.checkpoint.save` (how tests ship tiny random drafts). quant: "int8" / "int4"
    quantizes the draft's weights in its process (models/quant.py); draft_vocab: cut its head to
    token ids [0, draft_vocab) there (models/draft_head.py). cores: (target core, draft core) to pin
    each process to (this one is pinned here: call before JAX starts its backend for the pin to
    cover XLA's threads), or None to leave placement to the OS. timeout: seconds for the draft to
    join and load its model; reply_timeout: seconds of silence the target waits for any later
    answer before it counts the draft as hung (a compile does not count: the draft process sends
    a "compiling" heartbeat while it lowers or compiles a step); warmup_timeout: seconds an
    answer may take while the draft keeps saying it is compiling (default 1800; a compile that
    never ends is a hang too). draft_main: a script to run instead of `-m ssd_jax.runtime.draft_process`
    (same arguments; e.g. an instrumented draft in tests). compilation_cache: the spawned draft's
    persistent compilation cache, as `Engine`'s argument (True: the default directory, which
    SSD_JAX_COMPILE_CACHE overrides; a directory; False: off): the draft's steps are the largest
    compiles of an SSD call, so a second run reads them back instead of compiling them again.
    step_store: the draft process's step store, as `Engine`'s argument (None: its
    $SSD_JAX_STEP_STORE).

    The target listens on `listen` ("host:port", default 127.0.0.1 and a free port) and a draft
    must prove the shared secret (HMAC) before anything else is read. A spawned draft gets a fresh
    random secret through its environment. Join mode, `draft=None`: spawn nothing, wait on
    `listen` (give a port; bind a reachable address such as "0.0.0.0:12355" only on a network you
    trust) for a draft started elsewhere with the same secret, taken from `secret`, `secret_file`,
    or the environment (SSD_JAX_DRAFT_SECRET, or SSD_JAX_DRAFT_SECRET_FILE naming a file):

        python -m ssd_jax.runtime.draft_process --connect HOST:PORT --draft NAME [--cpu N]

    quant "auto" (and dtype "auto") are resolved in the draft's process, by
    `ssd_jax.runtime.defaults.choose` on its own devices.
    """
    from ssd_jax.runtime.draft_process import QUANTS
    if quant not in QUANTS:  # checked here: the spawned process would only exit on it
        raise ValueError(f"unknown draft format quant={quant!r}: use {', '.join(QUANTS)}")
    if draft is None:
        if listen is None:
            raise ValueError("draft=None (a draft started elsewhere) needs listen='host:port'")
        key = read_secret(secret, secret_file)
        if key is None:
            raise ValueError(f"join mode needs a shared secret: pass secret= or secret_file=, or set "
                             f"{SECRET_ENV} (or {SECRET_FILE_ENV}); the draft process needs the same")
        cmd = env = None
    else:
        key_text = new_secret()
        key = key_text.encode()
        entry = [draft_main] if draft_main is not None else ["-m", "ssd_jax.runtime.draft_process"]
        cmd = [sys.executable, *entry, "--draft", str(draft), "--dtype", dtype, "--quant", quant,
               "--timeout", str(timeout)]
        if draft_vocab is not None:
            cmd += ["--draft-vocab", str(int(draft_vocab))]
        if cores is not None:
            cmd += ["--cpu", str(cores[1])]
        if cache_dir is not None:
            cmd += ["--cache-dir", str(cache_dir)]
        cmd += ["--compilation-cache", {True: "on", False: "off"}.get(compilation_cache,
                                                                      str(compilation_cache))]
        if step_store is not None:
            cmd += ["--step-store", "on" if step_store else "off"]
        env = {k: v for k, v in os.environ.items() if k != SECRET_FILE_ENV}
        env[SECRET_ENV] = key_text
    parse_address(listen or "127.0.0.1:0")  # a bad address is an error before anything starts
    if cores is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cores[0]})
    return RemoteDraft(cmd, env, listen or "127.0.0.1:0", key, timeout, reply_timeout,
                       warmup_timeout)
