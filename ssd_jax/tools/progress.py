"""What `ssd-jax generate` is doing, on stderr: loading / converting each model (with elapsed
seconds), compiling the steps, then tokens flowing. Never on stdout, which carries the text or the
`--json` object. On when stderr is a terminal, or with `--progress` (off with `--no-progress`).

    ssd-jax: loading target qwen2.5-coder-1.5b (bfloat16) ...
    ssd-jax:   qwen2.5-coder-1.5b: converting ... (the first load; cached for later loads)
    ssd-jax: target loaded in 41.3 s
    ssd-jax: generating; a first run compiles its steps (JAX's compile cache serves later runs)
    ssd-jax:   compiled jit(verify) in 12.4 s (12.4 s compiling so far)
    ssd-jax: first tokens after 15.0 s
"""
from __future__ import annotations

import contextlib
import logging
import sys
import threading
import time

from ssd_jax.runtime.metrics import _COMPILE_EVENTS, REMOTE_LISTENERS, _program_name

_BACKEND_COMPILE = "/jax/core/compile/backend_compile_duration"
_active: list["Progress"] = []  # the Progress that JAX's compile events report to
_registered = False
_lock = threading.Lock()


def _on_event(event: str, duration: float, fun_name: str | None = None, **_) -> None:
    # the events `metrics.CompileTimer` sums (trace, lowering, backend compile), so that the
    # running figure here and out.metrics.compile_s are one figure
    if event in _COMPILE_EVENTS:
        for p in list(_active):
            p.phase(_program_name(fun_name), duration, done=event == _BACKEND_COMPILE)


def _on_remote(name: str, record: dict) -> None:
    for p in list(_active):
        p.phase(name, record["seconds"], done=True, source=record["source"])


class _LogLines(logging.Handler):
    """The loader's log records (models/load.py's "ssd_jax.load") as indented progress lines."""

    def __init__(self, progress: "Progress"):
        super().__init__(logging.INFO)
        self.progress = progress

    def emit(self, record):
        self.progress.say("  " + record.getMessage())


class Progress:
    """Progress lines on `stream` (default stderr) when `enabled`. enabled None: when `stream`
    is a terminal. `every` seconds at least between two "tokens so far" lines (--json mode, where
    no text shows the tokens flowing). `clock`: seconds (time.perf_counter)."""

    def __init__(self, enabled: bool | None = None, stream=None, every: float = 2.0,
                 clock=time.perf_counter):
        self.stream = sys.stderr if stream is None else stream
        if enabled is None:
            isatty = getattr(self.stream, "isatty", None)
            enabled = bool(isatty and isatty())
        self.enabled, self.every, self.clock = enabled, every, clock
        self.compile_s = 0.0
        self._pending: dict[str, float] = {}  # a program's seconds until its compile ends
        self._start = self._last = None
        self.tokens = 0

    def say(self, line: str) -> None:
        """One line `ssd-jax: <line>` on the stream, when enabled."""
        if self.enabled:
            print(f"ssd-jax: {line}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def step(self, what: str, done: str):
        """Say `<what> ...`, run the block (the loader's log lines shown inside it), then say
        `<done> in <seconds> s`."""
        t0 = self.clock()
        self.say(f"{what} ...")
        handler, log = _LogLines(self), logging.getLogger("ssd_jax.load")
        level, propagate = log.level, log.propagate
        if self.enabled:  # shown here alone, not also by a root handler (absl installs one)
            log.addHandler(handler)
            log.setLevel(logging.INFO)
            log.propagate = False
        try:
            yield
        finally:
            if self.enabled:
                log.removeHandler(handler)
                log.setLevel(level)
                log.propagate = propagate
        self.say(f"{done} in {self.clock() - t0:.1f} s")

    @contextlib.contextmanager
    def generating(self, warmed: bool = False):
        """Around the generate call: say that a first run compiles (`warmed`: that the warm-up
        compiled the steps already), report each step's compile as JAX finishes it (its backend
        compile events)."""
        global _registered
        self.say("generating" if warmed else "generating; a first run compiles its steps (JAX's "
                                              "compile cache serves later runs)")
        self._start = self._last = self.clock()
        if not self.enabled:
            yield self
            return
        with _lock:
            if not _registered:
                import jax
                jax.monitoring.register_event_duration_secs_listener(_on_event)
                REMOTE_LISTENERS.append(_on_remote)
                _registered = True
            _active.append(self)
        try:
            yield self
        finally:
            with _lock:
                _active.remove(self)

    def phase(self, name: str, seconds: float, done: bool, source: str | None = None) -> None:
        """`seconds` more of program `name`'s trace, lowering or compile (JAX's name, e.g.
        "jit(verify)"; the draft process's as "draft process: ..."); `done`: its compile ended,
        said in one line with its seconds (from half a second) and the running total, the same
        total as out.metrics.compile_s. out.metrics.compiles holds every program."""
        self.compile_s += seconds
        total = self._pending.pop(name, 0.0) + seconds
        if not done:
            self._pending[name] = total
        elif total >= 0.5:
            verb = "traced" if source == "traced" else "compiled"  # traced: inside another one
            how = f", {source}" if source not in (None, "compiled", "traced") else ""
            self.say(f"  {verb} {name} in {total:.1f} s{how} ({self.compile_s:.1f} s compiling "
                     "so far)")

    def delta(self, n_tokens: int, counting: bool) -> None:
        """`n_tokens` more tokens arrived: the first time, say how long they took; with
        `counting` (no text on the terminal) say the running count every `every` seconds."""
        now = self.clock()
        if self.tokens == 0 and n_tokens:
            self.say(f"first tokens after {now - self._start:.1f} s")
            self._last = now
        self.tokens += n_tokens
        if counting and now - self._last >= self.every:
            self.say(f"  {self.tokens} tokens so far")
            self._last = now
