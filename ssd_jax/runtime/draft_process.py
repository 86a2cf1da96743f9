"""The draft process of the two-process transport (`python -m ssd_jax.runtime.draft_process`).

Connects to the target (`--connect host:port`), proves the shared secret (SSD_JAX_DRAFT_SECRET,
SSD_JAX_DRAFT_SECRET_FILE or `--secret-file`), loads the draft and serves the target's requests
with a `DraftWorker` on its own device, one reply per request. After every speculation it sends
(round 1's backup, or a resolve), it dispatches the tree for that speculation at once, so the tree
runs while the target verifies it. An error in its own computation is reported to the target (the
target falls back to plain decoding for that call) and serving goes on; the process ends when the
target says "shutdown" or goes away. A "warm" request (a coming call's `warmup.CallPlan`, sent
while the target loads) is answered at once, then run as a throwaway first round
(`DraftWorker.warm_up`) whose account goes back as "warmed".
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import NoReturn

import numpy as np

from ssd_jax.runtime.wire import (HEARTBEAT_S, MAX_STR, REQUESTS, Channel, Message,
                                  TransportError, handshake_draft, parse_address, read_secret)

QUANTS = ("auto", "none", "int8", "int4")  # auto: ssd_jax.runtime.defaults.choose, in this process


def _load(spec: str, dtype: str, cache_dir: str | None, quant: str = "none",
          draft_vocab: int | None = None):
    from ssd_jax.models.load import load_draft

    path = Path(spec)
    # An HF folder without tokenizer files (how tests ship tiny random drafts) loads without one.
    with_tok = not (path.is_dir() and not (path / "tokenizer.json").exists())
    # The conversion cache is safe to share with the target's process, even for one model converted
    # by both at once (models/checkpoint.py: temporary, manifest, rename; the second keeps the first's).
    if "auto" in (dtype, quant):  # resolved here, on the draft's own machine and devices
        from ssd_jax.runtime.defaults import choose
        c = choose("auto", dtype, quant)
        dtype, quant = c["dtype"], c["draft_quant"]
    model = load_draft(spec, dtype, quant, draft_vocab, cache_dir=cache_dir, with_tokenizer=with_tok)
    if model.tokenizer is None:
        return model, model.cfg.vocab_size, None
    return model, model.tokenizer.vocab_size, model.tokenizer.fingerprint()


def decode_outcome(a: dict, k: int, row_vocab: int, resolve: bool) -> np.ndarray:
    """A request's packed `round_steps.Outcome` `[B, 6 + R]` (R = 4 + 2M: a report of M token
    columns); ValueError where it cannot be one: a report without a token column or of an odd
    width, a row's position, bonus or accepted count out of range (`resolve`: a verified round's
    outcome, M = K + 1 tokens)."""
    from ssd_jax.algorithm import decode_state as ds
    from ssd_jax.algorithm.round_steps import OUTCOME_COLUMN, REPORT_START

    p = a["outcome"]
    width = p.shape[1] - REPORT_START - ds.R_TOKENS
    if width < 2 or width % 2 or (resolve and width != 2 * (k + 1)):
        raise ValueError(f"an outcome of {p.shape[1]} columns: not {REPORT_START} + {ds.R_TOKENS} "
                         f"+ 2 x the round's tokens{f' (K + 1 = {k + 1})' if resolve else ''}")
    c = {name: p[:, i] for name, i in OUTCOME_COLUMN.items()}
    tokens = np.stack([c["bonus_out"], c["prev"], c["bonus"]])
    if p.size and (c["n"].min() < 1 or tokens.min() < 0 or tokens.max() >= row_vocab
                   or c["num_accepted"].min() < 0 or c["num_accepted"].max() > k
                   or not np.isin(c["active"], (0, 1)).all()):
        raise ValueError("an outcome with a position, token, accepted count or active flag out "
                         "of range")
    return p


_COMPILING = [False]  # this process is lowering or compiling a step (JAX's compile events)
_STARTS = ("/jax/core/compile/jaxpr_trace_duration", "/jax/core/compile/jaxpr_to_mlir_module_duration")
_ENDS = ("/jax/core/compile/backend_compile_duration", "/jax/compilation_cache/cache_retrieval_time_sec")


def _watch_compiles() -> None:
    """Follow JAX's compile events (once per process): a trace or lowering has ended, so a
    lowering or XLA compile is under way until the backend compile (or the persistent cache's
    read) ends. The trace itself is not covered (seconds, where a compile takes minutes)."""
    if getattr(_watch_compiles, "done", False):
        return
    from jax import monitoring

    def event(name, duration, **kw):
        if name in _STARTS:
            _COMPILING[0] = True
        elif name in _ENDS:
            _COMPILING[0] = False
    monitoring.register_event_duration_secs_listener(event)
    _watch_compiles.done = True


class DraftServer:
    """The draft process's side of the exchange: `handle` answers one request (and says what to
    do after the reply is sent: dispatch the next tree); `serve` loops over requests."""

    def __init__(self, channel: Channel, model):
        self.channel, self.model = channel, model
        self.worker = None
        self.pending: Exception | None = None  # raised after the last reply (a tree): told next
        self._send_lock = threading.Lock()  # replies and heartbeats: one frame at a time
        self._stop = threading.Event()
        self.timer = None  # metrics.CompileTimer while serving: what each reply reports

    def send(self, msg: Message) -> None:
        """Send one frame (replies from the serving thread, heartbeats from their own)."""
        with self._send_lock:
            self.channel.send(msg)

    def _heartbeat(self) -> None:
        """While a step lowers or compiles, a "compiling" frame every HEARTBEAT_S: the target's
        reply timeout then measures answers, never compiles (transport.RemoteDraft)."""
        while not self._stop.wait(HEARTBEAT_S):
            if _COMPILING[0]:
                try:
                    self.send(Message("compiling"))
                except TransportError:
                    return

    def _records(self) -> list:
        """What compiled since the last call, one record a program (wire "records"), each name
        cut to 200 characters (a frame's header is at most wire.MAX_HEADER bytes)."""
        programs = self.timer.take() if self.timer is not None else {}
        return [[name[:200], p["source"], *(float(p[k]) for k in
                                            ("seconds", "trace_s", "lower_s", "compile_s")),
                 int(p["count"])] for name, p in programs.items()]

    def _send_compiles(self) -> None:
        """The "compiled" frames of what compiled since the last ones, if anything did: up to
        100 programs a frame."""
        records = self._records()
        for i in range(0, len(records), 100):
            self.send(Message("compiled", {"programs": records[i:i + 100]}))

    def _worker(self, row_vocab: int):
        """The DraftWorker for proposal rows of `row_vocab` (made on the first call, and anew
        for another target's rows)."""
        import jax

        from ssd_jax.runtime.draft_worker import DraftWorker
        from ssd_jax.runtime.placement import make_placement

        if self.worker is None or self.worker.row_vocab != row_vocab:
            placement = make_placement("colocated", jax.local_devices())
            self.worker = DraftWorker(self.model, placement.draft, row_vocab)
        return self.worker

    def _warm(self, call) -> None:
        """Run the warm-up `call` asked for (`DraftWorker.warm_up`), then send the "warmed" frame:
        its seconds, what it compiled or loaded, the error if it failed (the call then meets that
        error itself, and says so)."""
        t0, error = time.perf_counter(), None
        try:
            self._worker(call.row_vocab).warm_up(call)
        except Exception as e:  # noqa: BLE001 - the call that follows reports it
            error = f"{type(e).__name__}: {e}"[:MAX_STR]
            if self.worker is not None:
                self.worker.finish()  # the failed call's tree, if any, goes
        _COMPILING[0] = False
        self.send(Message("warmed", {"seconds": time.perf_counter() - t0,
                                     "programs": self._records()[:100], "error": error}))

    def _spec(self, spec, rows) -> Message:
        return Message("spec", {}, {"spec": np.asarray(spec), "rows": np.asarray(rows)})

    def handle(self, msg: Message):
        """(reply Message, a function to run after sending it, or None)."""
        from ssd_jax.runtime.config import CallConfig

        kind, a, f, w = msg.kind, msg.arrays, msg.fields, self.worker
        if kind in ("start", "warm"):  # the block may be wider than the cache, a prompt not
            lens, width = a["lens"], a["tokens"].shape[1]
            if a["tokens"].shape[0] != len(lens) or len(lens) and (
                    lens.min() < 1 or lens.max() > min(width, f["cache_len"])):
                raise ValueError("prompt tokens, lengths and cache length do not fit together")
        if kind == "start":
            self._worker(f["row_vocab"]).start(a["tokens"], a["lens"], f["cache_len"])
            return Message("ok"), None
        if kind == "warm":
            from ssd_jax.runtime.warmup import CallPlan
            if f["mode"] not in ("sd", "ssd"):
                raise ValueError(f"warm-up for mode {f['mode']!r}: the draft serves 'sd' and 'ssd'")
            call = CallPlan(f["mode"], a["tokens"], a["lens"], f["cache_len"], f["row_vocab"],
                            CallConfig.of_draft_fields(f, len(a["lens"])))
            return Message("ok"), lambda: self._warm(call)
        if w is None:
            raise ValueError(f"{kind!r} before 'start'")
        if kind == "ready":
            w.ready()
            return Message("ok"), None
        if kind == "finish":
            w.finish()
            return Message("ok"), None
        from ssd_jax.runtime.draft_worker import RoundState

        packed = a["outcome"]
        run = CallConfig.of_draft_fields(f, len(packed))
        if len(packed) != w._batch:
            raise ValueError(f"an outcome of {len(packed)} rows for a call of {w._batch}")
        decode_outcome(a, run.k, w.row_vocab, resolve=kind == "resolve")
        if kind == "propose":
            spec, rows, _ = w.propose_from(packed, run)
            return self._spec(spec, rows), None
        if kind == "first":
            spec, rows, v = w.first(packed, run)
            return self._spec(spec, rows), lambda: w.dispatch_tree(
                RoundState.of_outcome(v), spec, w._put(np.ones(len(packed), bool)), run, wait=True)
        # resolve: the lookup and any backup, then (after the reply) the next round's tree
        import jax

        from ssd_jax.algorithm import decode_state as ds
        from ssd_jax.algorithm.round_steps import OUTCOME_COLUMN
        t0, tree_s = time.perf_counter(), w._tree_s
        spec, rows, missed, rep, v = w.resolve_on_device(packed, run, f["neural"])
        spec_h, rows_h, rep_h, counters = jax.device_get((spec, rows, rep, w.counters))
        c = counters.totals()
        times = {"resolve_s": time.perf_counter() - t0}
        if tree_s is not None:
            times["tree_s"] = tree_s
        reply = Message("resolved", {"times": times},
                        {"spec": spec_h, "rows": rows_h, "hit": rep_h[:, ds.R_HIT] > 0,
                         **{name: getattr(c, name).astype(np.int32) for name in
                            ("lookups_by_accept", "hits_by_accept", "backups")}})
        if not (packed[:, OUTCOME_COLUMN["active"]] > 0).any():
            return reply, None
        return reply, lambda: w.dispatch_tree(RoundState.of_outcome(v), spec, missed, run, wait=True)

    def serve(self) -> None:
        """Answer requests until "shutdown" or until the target goes away; a "compiling"
        heartbeat goes out while a step compiles, and before each reply a "compiled" frame with
        what this process compiled or loaded since the last one (the target counts it in the
        call's compile time: the call waited for it)."""
        from ssd_jax.runtime.metrics import CompileTimer

        _watch_compiles()
        beat = threading.Thread(target=self._heartbeat, name="ssd_jax-draft-heartbeat", daemon=True)
        beat.start()
        self.timer = CompileTimer()
        try:
            with self.timer.measure():
                self._serve()
        finally:
            self._stop.set()
            _COMPILING[0] = False

    def _serve(self) -> None:
        while True:
            try:
                msg = self.channel.recv(REQUESTS)
            except TransportError as e:
                if e.kind == "closed":
                    return  # the target is gone: nothing left to serve
                raise
            t0 = time.perf_counter()
            if msg.kind == "shutdown":
                self.send(Message("ok"))
                return
            if msg.kind in ("start", "finish"):
                self.pending = None
            after = None
            try:
                if self.pending is not None:
                    err, self.pending = self.pending, None
                    raise err
                reply, after = self.handle(msg)
            except Exception as e:  # noqa: BLE001 - the draft's own failure: tell the target
                reply = Message("error", {"message": f"{type(e).__name__}: {e}"[:MAX_STR],
                                          "during": msg.kind})
                if self.worker is not None:
                    self.worker.finish()  # the failed call's tree, if any, goes
            _COMPILING[0] = False  # a trace that no compile followed (eval_shape) ends here
            if reply.kind == "resolved":
                reply.fields["times"]["handle_s"] = time.perf_counter() - t0
            self._send_compiles()
            self.send(reply)
            if after is not None:
                try:
                    after()
                except Exception as e:  # noqa: BLE001 - answered at the next request
                    self.pending = e
                _COMPILING[0] = False


def connect(address: str, key: bytes, timeout: float) -> Channel:
    """Connect to the target at `address` (retrying while it does not listen yet, up to `timeout`
    seconds) and prove the secret; TransportError if refused."""
    host, port = parse_address(address)
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock = socket.create_connection((host, port), timeout=10)
            break
        except OSError:
            if time.monotonic() > deadline:
                raise TransportError("timeout", f"no target listening at {address} in {timeout:g} s")
            time.sleep(0.2)
    handshake_draft(sock, key)
    return Channel(sock)


def main(argv=None) -> None:
    """Command line: connect to the target, load the draft (or send the target the error), send
    its vocabulary and tokenizer fingerprint, then serve."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--connect", required=True, help="the target's host:port")
    p.add_argument("--draft", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quant", choices=QUANTS, default="none")
    p.add_argument("--draft-vocab", type=int, default=None)
    p.add_argument("--cpu", type=int, default=None, help="pin this process to one core")
    p.add_argument("--cache-dir", default=None)
    p.add_argument("--secret-file", default=None,
                   help="file holding the shared secret (default: $SSD_JAX_DRAFT_SECRET, "
                        "$SSD_JAX_DRAFT_SECRET_FILE)")
    p.add_argument("--timeout", type=float, default=300.0,
                   help="seconds to keep trying to reach the target")
    p.add_argument("--compilation-cache", default="on",
                   help="JAX's persistent compilation cache: on (the default directory, or "
                        "$SSD_JAX_COMPILE_CACHE), off, or a directory (default on)")
    p.add_argument("--step-store", choices=("on", "off"), default=None,
                   help="keep the draft's steps exported beside the compilation cache "
                        "(ssd_jax.algorithm.aot; default: $SSD_JAX_STEP_STORE, else off)")
    a = p.parse_args(argv)
    if a.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {a.cpu})  # before XLA starts its thread pool
    from ssd_jax.runtime.compile_cache import enable_compilation_cache
    try:  # the draft's tree and chain are the largest compiles of an SSD call: keep them
        enable_compilation_cache({"on": True, "off": False}.get(a.compilation_cache,
                                                                a.compilation_cache),
                                 None if a.step_store is None else a.step_store == "on")
    except (ValueError, OSError) as e:
        sys.exit(f"ssd_jax draft process: --compilation-cache: {e}")
    from ssd_jax.runtime.mappings import watch_mappings
    watch_mappings()  # its warnings reach this process's stderr, as the target's reach its own
    try:
        key = read_secret(secret_file=a.secret_file)
        if key is None:
            raise ValueError("no shared secret: set SSD_JAX_DRAFT_SECRET (or "
                             "SSD_JAX_DRAFT_SECRET_FILE, or pass --secret-file)")
        channel = connect(a.connect, key, a.timeout)
    except (ValueError, OSError, TransportError) as e:
        sys.exit(f"ssd_jax draft process: {e}")
    try:
        model, vocab_size, fingerprint = _load(a.draft, a.dtype, a.cache_dir, a.quant, a.draft_vocab)
        import jax

        from ssd_jax.models.backends import select
        backend = select("auto", jax.local_devices()[:1]).name
    except Exception as e:  # noqa: BLE001 - tell the target instead of leaving it waiting
        channel.send(Message("error", {"message": f"{type(e).__name__}: {e}"[:MAX_STR],
                                       "during": "load"}))
        return
    channel.send(Message("info", {"vocab_rows": int(model.cfg.vocab_size),
                                  "vocab_size": int(vocab_size), "fingerprint": fingerprint,
                                  "name": str(a.draft)[:MAX_STR], "backend": backend}))
    try:
        DraftServer(channel, model).serve()
    except TransportError as e:
        sys.exit(f"ssd_jax draft process: {e}")


def run(argv=None) -> NoReturn:
    """The draft process's entry point: `main`, then out at once with its exit code (a message
    given to `sys.exit` printed first), without Python's interpreter shutdown. That shutdown stops
    daemon threads wherever they are, and one stopped inside JAX's C++ aborted the process after
    a good run ("terminate called ..." / "FATAL: exception not rethrown" on stderr). Nothing is left
    for it to do: the replies are sent and the persistent cache is written as each program
    compiles."""
    code = 1
    try:
        main(argv)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        else:
            code = e.code or 0
    except BaseException:  # noqa: BLE001 - said on stderr, as the interpreter would
        traceback.print_exc()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    run()
