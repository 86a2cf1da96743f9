"""The draft in a second process, coordinated through JAX's own multi-process runtime.

On a 2-core CPU one JAX process spreads every forward over both cores, so two meshes in one process
barely overlap. Here the target process is pinned to one core and a draft process to
another; they exchange only token ids, outcome integers and proposal rows, as pickled host values
over `jax.experimental.multihost_utils.process_allgather` (gloo collectives on the CPU).

    remote = start_two_process("qwen2.5-coder-0.5b")   # before any other JAX use in this process
    engine = Engine(load_model("qwen2.5-coder-1.5b"), remote_draft=remote)

`RemoteDraft` has the methods of `DraftWorker` the engine calls; the draft process runs the same
`DraftWorker` and, right after sending a speculation, dispatches its tree for it — so the tree runs
while the target verifies that speculation.
"""
from __future__ import annotations

import atexit
import os
import pickle
import socket
import subprocess
import sys
import time

import numpy as np

TARGET, DRAFT = 0, 1  # jax.distributed process ids of the two processes


class Channel:
    """Point-to-point messages between the two processes. Both call `exchange` at the same point:
    the sender with its object, the receiver with None. Two allgathers: size, then bytes."""

    def __init__(self):
        import jax
        self.me = jax.process_index()
        self.seconds = 0.0  # time spent exchanging
        self._count = 0  # messages so far (names each one's barrier)

    def _meet(self):
        """Both processes reach the same message before its collectives start. Why: gloo gives up
        on a peer after ~30 s, and a peer can be busy far longer between messages (loading and
        converting its model before the first one); the coordination service's barrier waits up
        to 10 minutes. Messages are numbered, so both sides must exchange in the same order, as
        the collectives already require."""
        from jax._src import distributed
        client = distributed.global_state.client
        if client is not None:
            self._count += 1
            client.wait_at_barrier(f"ssd_jax_channel_{self._count}", timeout_in_ms=600_000)

    def _allgather(self, x: np.ndarray) -> np.ndarray:
        from jax.experimental import multihost_utils
        return np.asarray(multihost_utils.process_allgather(x))

    def exchange(self, sender: int, obj=None):
        """Move a picklable `obj` from process `sender` to the other one; both return it (the sender
        its own object, the receiver the unpickled copy). Adds the time taken to `self.seconds`."""
        t0 = time.perf_counter()
        self._meet()
        mine = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL) if self.me == sender else b""
        size = int(self._allgather(np.array([len(mine)], np.int64))[sender, 0])
        # Buffers come in power-of-2 sizes: each new shape would compile a new allgather, and a
        # compile per round costs more than the bytes.
        buf = np.zeros(max(1024, 1 << (size - 1).bit_length()), np.uint8)
        if self.me == sender:
            buf[:size] = np.frombuffer(mine, np.uint8)
        got = self._allgather(buf)[sender, :size]
        self.seconds += time.perf_counter() - t0
        return obj if self.me == sender else pickle.loads(got.tobytes())

    def send(self, obj):
        """`exchange` with this process as the sender; the other process must call `recv`."""
        return self.exchange(self.me, obj)

    def recv(self):
        """`exchange` with the other process as the sender: returns the object it `send`s."""
        return self.exchange(1 - self.me)


def _np(x):
    return None if x is None else np.asarray(x)


class RemoteDraft:
    """Target-side proxy of the draft process (the methods the engine calls on a DraftWorker)."""

    remote = True

    def __init__(self, channel: Channel, proc: subprocess.Popen | None, info: dict):
        self.channel = channel
        self.proc = proc
        self.info = info  # the draft's embedding rows, tokenizer size and fingerprint
        self.row_vocab = info["vocab_rows"]  # set by the engine to the target's rows
        self._closed = False

    def start(self, prompt_tokens, prompt_lens, cache_len):
        """Send prompt_tokens `[B, T]`, prompt_lens `[B]`, cache_len S and the row vocabulary V: the
        draft process builds its worker if needed and prefills."""
        self.channel.send(("start", np.asarray(prompt_tokens), np.asarray(prompt_lens), int(cache_len),
                           int(self.row_vocab)))

    def ready(self):
        """Block until the draft process's prefill is done."""
        self.channel.send(("ready",))
        self.channel.recv()

    def propose(self, s, run):
        """SD drafting in the draft process: (spec `[B, K]` int32, rows `[B, K, V]`) as numpy."""
        self.channel.send(("propose", s, run))
        return self.channel.recv()

    def backup(self, s, run):
        """Round 1's speculation (a backup from the real outcome): (spec `[B, K]`, rows `[B, K, V]`)
        as numpy; the draft process then dispatches its tree at once."""
        self.channel.send(("first", s, run))
        return self.channel.recv()

    def dispatch_tree(self, s, spec, from_backup, run):
        """Nothing to do here: the draft process dispatched the tree when it sent `spec`."""
        pass  # the draft process dispatched it as soon as it sent `spec`

    def resolve(self, num_accepted, bonus, s, run):
        """Send the outcome (num_accepted `[B]`, bonus `[B]`); receive (spec `[B, K]`, rows
        `[B, K, V]`, hit `[B]` bool, times dict) with the exchange's seconds as times["exchange_s"]."""
        t0 = self.channel.seconds
        self.channel.send(("resolve", np.asarray(num_accepted), np.asarray(bonus), s, run))
        spec, rows, hit, times = self.channel.recv()
        times = dict(times, exchange_s=self.channel.seconds - t0)
        return spec, rows, hit, times

    def finish(self):
        """End of a generate call: the draft process drops its pending tree."""
        self.channel.send(("finish",))

    def close(self):
        """Stop the draft process. Both processes leave jax.distributed together (its shutdown is
        a barrier), so this process cannot start another draft process afterwards."""
        import jax
        if self._closed or (self.proc is not None and self.proc.poll() is not None):
            return
        self._closed = True
        self.channel.send(("shutdown",))
        jax.distributed.shutdown()
        if self.proc is not None:
            self.proc.wait(timeout=120)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init(coordinator: str, process_id: int, cpu: int | None, timeout: int = 300):
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {cpu})  # before XLA starts its thread pool
    import jax
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=coordinator, num_processes=2,
                               process_id=process_id, initialization_timeout=timeout)


def start_two_process(draft: str | None, *, dtype: str = "float32", quant: str = "none",
                      draft_vocab: int | None = None,
                      cores: tuple[int, int] | None = (0, 1), cache_dir: str | None = None,
                      timeout: int = 300, draft_main: str | None = None,
                      coordinator: str | None = None) -> RemoteDraft:
    """Launch the draft process and join it. Call before any other JAX use in this process.

    draft: a default model name, a .gguf file, an HF folder, or a directory written by
    `ssd_jax.models.checkpoint.save` (how tests ship tiny random drafts). quant: "int8" / "int4" quantizes the
    draft's weights in its process (models/quant.py); draft_vocab: cut its head to token ids
    [0, draft_vocab) there (models/draft_head.py). cores: (target core, draft core)
    to pin each process to, or None to leave placement to the OS. draft_main: a script to run
    instead of `-m ssd_jax.runtime.draft_process` (same arguments; e.g. an instrumented draft in tests).

    Multi-host: pass `coordinator="host0:PORT"` (this host's reachable address) and `draft=None` to
    spawn nothing; start the draft on its own host with
    `python -m ssd_jax.runtime.draft_process --coordinator host0:PORT --draft NAME [--cpu N]`.
    """
    import jax
    if jax._src.distributed.global_state.client is not None:
        raise RuntimeError("jax.distributed is already initialised in this process")
    if draft is None:  # the draft process runs elsewhere (another host) and joins `coordinator`
        if coordinator is None:
            raise ValueError("draft=None (a draft started elsewhere) needs coordinator='host:port'")
        _init(coordinator, TARGET, cores[0] if cores is not None else None, timeout)
        channel = Channel()
        info = channel.recv()
        if "error" in info:
            raise ValueError(f"draft process: {info['error']}")
        remote = RemoteDraft(channel, None, info)
        atexit.register(remote.close)
        return remote
    coordinator = coordinator or f"127.0.0.1:{_free_port()}"
    entry = [draft_main] if draft_main is not None else ["-m", "ssd_jax.runtime.draft_process"]
    cmd = [sys.executable, *entry, "--coordinator", coordinator,
           "--draft", str(draft), "--dtype", dtype, "--quant", quant]
    if draft_vocab is not None:
        cmd += ["--draft-vocab", str(int(draft_vocab))]
    if cores is not None:
        cmd += ["--cpu", str(cores[1])]
    if cache_dir is not None:
        cmd += ["--cache-dir", str(cache_dir)]
    proc = subprocess.Popen(cmd)
    try:
        _init(coordinator, TARGET, cores[0] if cores is not None else None, timeout)
    except Exception as e:
        proc.kill()
        raise RuntimeError(f"the draft process did not join (exit code {proc.poll()}): {e}") from e
    channel = Channel()
    info = channel.recv()
    if "error" in info:
        proc.kill()
        raise ValueError(f"draft process: {info['error']}")
    remote = RemoteDraft(channel, proc, info)
    atexit.register(remote.close)
    return remote
