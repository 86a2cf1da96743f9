"""Metrics of one generate call, returned (never printed) as a dataclass with `to_dict()` for JSON.

`Metrics` and `RoundTimes` are registered pytrees: their numbers (counts, seconds, histograms,
the timeline, backups per kind) are the leaves, so `jax.tree.map` / `jax.tree.leaves` work over
them; the run's description (mode, K, fan-out, backend, fallback, extra) is static. Their JSON
carries `"schema": SCHEMA` so a reader knows which fields to expect; `Metrics.from_dict` /
`from_json` read it back.

Hit rates count from round 2 on, per active sequence and round (round 1 has no speculation cache).
Times are wall-clock seconds on the host; `compile_s` is measured apart (JAX's own compile events)
and excluded from `decode_s`, so tokens/s is a steady-state figure.
"""
from __future__ import annotations

import contextlib
import dataclasses
import json
import threading
from typing import Any

import jax
import numpy as np

from ssd_jax.algorithm.aot import STORE_PROGRAMS
from ssd_jax.algorithm.policy import acceptance_from_hist, ssd_speedup

SCHEMA = 1  # the version of `Metrics.to_dict`'s layout; bump it when a field changes meaning

_COMPILE_EVENTS = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_PHASE = dict(zip(_COMPILE_EVENTS, ("trace_s", "lower_s", "compile_s")))
_CACHE_HIT = "/jax/compilation_cache/cache_hits"


@dataclasses.dataclass
class RoundTimes:
    """One round's timeline (seconds from the round's start)."""
    verify_s: float = 0.0  # dispatch -> outcome on the host
    draft_s: float = 0.0  # SD drafting, or SSD tree dispatch -> tree ready
    backup_s: float = 0.0  # time spent producing a backup speculation after a miss
    exchange_s: float = 0.0  # moving outcome / speculation between meshes or processes
    round_s: float = 0.0
    hit: int = -1  # SSD: hits of this round's lookup (which decides the next round; -1: none)
    lookups: int = 0  # SSD: the sequences that lookup counted (those with a next round)
    active: int = 0
    tokens: int = 0  # tokens committed this round (all sequences)
    compiled: bool = False  # a compile happened inside this round: excluded from tokens/s


@dataclasses.dataclass
class Metrics:
    """Counters and timings of one generate call (see the module docstring for what counts).

    mode: "ar" | "sd" | "ssd"; k: K (0 for AR); rounds / new_tokens: rounds run and tokens
    generated; timed_tokens / decode_s: tokens and seconds of the rounds without a compile (the
    steady state); prefill_s, compile_s, draft_s, verify_s, backup_s: seconds spent in each; the
    accept_hist* lists (K+1 entries) count sequence-rounds by accepted draft tokens, overall and
    (SSD) after a cache hit or a miss; hits / lookups: speculation-cache hits among the looked-up
    sequence-rounds (SSD, from round 2); backups: misses served per backup speculator; timeline:
    one `RoundTimes` per round; predicted_speedup: the docs/ALGORITHM.md §6 formula's speedup over
    AR from this run's quantities (None when it cannot be computed); fanout: SSD's F_0..F_K after a
    hit; backend: the op table chosen per model; fallback: None, or when the draft failed and the
    call finished with plain decoding on the target (`ssd_jax.runtime.fallback`), what failed:
    {draft, during, error, round, tokens_before, committed (per prompt)}; extra: anything else a
    caller attaches; memory: the bytes each device holds for weights, KV cache and speculation
    cache (`memory_of`); compiles: what compile_s is made of, one entry per program compiled
    during the call (`CompileTimer.programs`: its trace, lowering and backend seconds and where
    the executable came from), a draft process's as "draft process: <name>" (its replies report
    them, `CompileTimer.add_remote`).
    """

    mode: str
    k: int = 0
    rounds: int = 0
    new_tokens: int = 0
    timed_tokens: int = 0  # tokens of the rounds that decode_s covers
    prefill_s: float = 0.0
    decode_s: float = 0.0
    compile_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    backup_s: float = 0.0
    # acceptance: accept_hist[j] = rounds (per active sequence) that accepted exactly j draft tokens
    accept_hist: list[int] = dataclasses.field(default_factory=list)
    accept_hist_after_hit: list[int] = dataclasses.field(default_factory=list)
    accept_hist_after_miss: list[int] = dataclasses.field(default_factory=list)
    hits: int = 0
    lookups: int = 0
    # SSD: the lookups and hits split by the outcome they looked up, [K+1] by accepted count j
    # (j = K: every draft token accepted), so a hit rate can be read per outcome
    hits_by_accept: list[int] = dataclasses.field(default_factory=list)
    lookups_by_accept: list[int] = dataclasses.field(default_factory=list)
    backups: dict[str, int] = dataclasses.field(default_factory=dict)
    timeline: list[RoundTimes] = dataclasses.field(default_factory=list)
    predicted_speedup: float | None = None
    fanout: tuple[int, ...] | None = None  # SSD: the F_0..F_K used after a hit
    backend: dict[str, str] = dataclasses.field(default_factory=dict)  # op table per model
    fallback: dict[str, Any] | None = None  # the draft's failure, when the call fell back
    extra: dict[str, Any] = dataclasses.field(default_factory=dict)
    # bytes held per device, {"weights" | "kv_cache" | "spec_cache": {device: bytes}}
    # (`memory_of(engine)`; empty until filled)
    memory: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)
    # {program name: {"seconds", "trace_s", "lower_s", "compile_s", "count", "source"}}
    compiles: dict[str, dict[str, Any]] = dataclasses.field(default_factory=dict)

    def init_hist(self, k: int) -> None:
        """Set K and zero the three acceptance histograms (K+1 entries each)."""
        self.k = k
        self.accept_hist = [0] * (k + 1)
        self.accept_hist_after_hit = [0] * (k + 1)
        self.accept_hist_after_miss = [0] * (k + 1)
        self.hits_by_accept = [0] * (k + 1)
        self.lookups_by_accept = [0] * (k + 1)

    def add_round(self, r: RoundTimes) -> None:
        """Append a round to the timeline; unless it compiled, add its time and tokens to the
        steady-state `decode_s` / `timed_tokens`."""
        self.timeline.append(r)
        self.rounds += 1
        if not r.compiled:
            self.decode_s += r.round_s
            self.timed_tokens += r.tokens

    @property
    def tokens_per_s(self) -> float:
        """Steady state: tokens over time of the rounds in which nothing compiled."""
        return self.timed_tokens / self.decode_s if self.decode_s > 0 else float("nan")

    @property
    def tokens_per_round(self) -> float:
        """Tokens emitted per sequence-round (accepted + bonus), from the accepted-length histogram."""
        total = sum(self.accept_hist)
        return sum((j + 1) * c for j, c in enumerate(self.accept_hist)) / total if total else 0.0

    @property
    def acceptance_per_position(self) -> list[float]:
        """P(draft token i accepted | tokens before it accepted), i = 1..K."""
        out = []
        for i in range(1, self.k + 1):
            reached = sum(self.accept_hist[i - 1:])
            out.append(sum(self.accept_hist[i:]) / reached if reached else float("nan"))
        return out

    @property
    def acceptance_rate(self) -> float:
        """Mean accepted draft tokens over K (per sequence-round)."""
        total = sum(self.accept_hist)
        if not total or not self.k:
            return 0.0
        return sum(j * c for j, c in enumerate(self.accept_hist)) / (total * self.k)

    @property
    def per_token_acceptance(self) -> float:
        """Maximum-likelihood geometric acceptance a: accepted / (accepted + rejections), the a of
        E = (1 - a^(K+1)) / (1 - a)."""
        try:
            return acceptance_from_hist(self.accept_hist)
        except ValueError:  # no rounds yet (or an AR run)
            return float("nan")

    @property
    def hit_rate(self) -> float:
        """hits / lookups (NaN before any lookup)."""
        return self.hits / self.lookups if self.lookups else float("nan")

    @property
    def hit_rate_by_accept(self) -> list[float]:
        """hits / lookups per looked-up outcome, [K+1] by accepted count (NaN where none)."""
        return [h / n if n else float("nan") for h, n in zip(self.hits_by_accept, self.lookups_by_accept)]

    def sd_phases(self) -> dict | None:
        """What `fanout="plan"` plans from, out of this timed SD run's steady rounds: {"tv":
        median verify seconds, "draft_s": median drafting seconds, "accept_hist"}; None without
        a steady round."""
        steady = [r for r in self.timeline if not r.compiled]
        if not steady:
            return None
        return dict(tv=float(np.median([r.verify_s for r in steady])),
                    draft_s=float(np.median([r.draft_s for r in steady])),
                    accept_hist=list(self.accept_hist))

    def ssd_prediction(self, t1: float | None) -> float | None:
        """The docs/ALGORITHM.md §6 speed-up over plain decoding from this SSD run's own steady
        rounds (median verify and tree times, mean backup time, tokens per round after hits and
        misses, hit rate, mean active batch), given T_1, a plain decode step measured apart; None
        without T_1, steady rounds or lookups."""
        steady = [r for r in self.timeline if not r.compiled]
        if t1 is None or not steady or not self.lookups:
            return None
        tv = float(np.median([r.verify_s for r in steady]))
        tp = float(np.median([r.draft_s for r in steady]))
        with_backup = [r.backup_s for r in steady if r.backup_s > 0]
        tb = float(np.mean(with_backup)) if with_backup else 0.0
        batch = max(int(round(np.mean([r.active for r in steady]))), 1)
        # one miss stalls the batch: the formula's all-hit probability is p_hit^batch
        return ssd_speedup(t1, tv, tp, tb, self.hit_rate, mean_tokens(self.accept_hist_after_hit),
                           mean_tokens(self.accept_hist_after_miss), batch=batch)

    def to_dict(self) -> dict[str, Any]:
        """Every field plus the derived rates, as JSON-ready values (NaN -> None)."""
        d = dataclasses.asdict(self)
        d.update(tokens_per_s=self.tokens_per_s, tokens_per_round=self.tokens_per_round,
                 acceptance_per_position=self.acceptance_per_position,
                 acceptance_rate=self.acceptance_rate, hit_rate=self.hit_rate,
                 hit_rate_by_accept=self.hit_rate_by_accept,
                 per_token_acceptance=self.per_token_acceptance)
        d["schema"] = SCHEMA
        return _jsonable(d)

    def to_json(self) -> str:
        """`to_dict()` as one JSON string."""
        return json.dumps(self.to_dict())

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Metrics":
        """The Metrics a `to_dict()` (or its JSON) describes; the derived rates are recomputed,
        not read. Raises ValueError for a dict without `schema` or of another schema version."""
        if d.get("schema") != SCHEMA:
            raise ValueError(f"metrics of schema {d.get('schema')!r}: this ssd_jax reads schema "
                             f"{SCHEMA}")
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in names}
        kw["timeline"] = [RoundTimes(**r) for r in kw.get("timeline", [])]
        if kw.get("fanout") is not None:
            kw["fanout"] = tuple(kw["fanout"])
        for name in ("prefill_s", "decode_s", "compile_s", "draft_s", "verify_s", "backup_s"):
            if kw.get(name) is None:  # NaN is written as null
                kw[name] = float("nan")
        return cls(**kw)

    @classmethod
    def from_json(cls, text: str) -> "Metrics":
        """`from_dict` of a JSON string written by `to_json`."""
        return cls.from_dict(json.loads(text))

    def summary(self) -> str:
        """One human-readable line: tokens, tokens/s, tokens per round and hit rate where they apply."""
        s = f"{self.mode}: {self.new_tokens} tokens, {self.tokens_per_s:.2f} tok/s"
        if self.mode != "ar":
            s += f", {self.tokens_per_round:.2f} tokens/round"
        if self.lookups:
            s += f", hit rate {self.hit_rate:.2f}"
        return s + f" (compile {self.compile_s:.1f}s apart)"


def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (np.floating, float)):
        return None if np.isnan(x) else float(x)
    if isinstance(x, np.integer):
        return int(x)
    return x


def device_bytes(*trees) -> dict[str, int]:
    """{device: bytes} of the jax.Arrays in `trees` (each shard counted on its own device; a
    buffer reached twice counted once; None, deleted and non-array leaves skipped)."""
    out: dict[str, int] = {}
    seen: set[tuple[int, int]] = set()
    for x in jax.tree_util.tree_leaves(trees):
        if not isinstance(x, jax.Array) or x.is_deleted():
            continue
        for shard in x.addressable_shards:
            buf = (shard.device.id, shard.data.unsafe_buffer_pointer())
            if buf in seen:  # one buffer under two Array objects (a no-op device_put)
                continue
            seen.add(buf)
            key = f"{shard.device.platform}:{shard.device.id}"
            out[key] = out.get(key, 0) + int(shard.data.nbytes)
    return out


def layout_bytes(tree, sharding=None) -> dict[str, int]:
    """{device: bytes} the jax.Arrays of `tree` occupy by their shapes and shardings (no buffer
    is touched, so arrays still in flight are not waited for); with a `sharding`, also its
    `jax.ShapeDtypeStruct`s, laid out by it."""
    out: dict[str, int] = {}
    for x in jax.tree_util.tree_leaves(tree):
        if isinstance(x, jax.Array):
            sh = x.sharding
        elif sharding is not None and isinstance(x, jax.ShapeDtypeStruct):
            sh = sharding
        else:
            continue
        shard = int(np.prod(sh.shard_shape(x.shape))) * x.dtype.itemsize
        for d in sh.addressable_devices:
            key = f"{d.platform}:{d.id}"
            out[key] = out.get(key, 0) + shard
    return out


def memory_of(engine) -> dict[str, dict[str, int]]:
    """What `engine` holds on each of this process's devices now: {"weights": {device: bytes},
    "kv_cache": ..., "spec_cache": ...}: the laid-out weights of target and (local) draft, the
    KV caches and the SSD speculation cache of the last call (a draft in another process reports
    nothing here). `metrics.memory` of the CLI's --json."""
    w = getattr(engine, "worker", None)
    return {"weights": device_bytes(engine.tparams, getattr(w, "params", None)),
            "kv_cache": device_bytes(getattr(engine, "tcache", None), getattr(w, "cache", None)),
            # the tree in flight, else the last call's (each round's is dropped once looked up)
            "spec_cache": device_bytes(getattr(w, "_tree", None)) or dict(getattr(w, "spec_bytes", {}))}


# ----------------------------------------------------------------------------------- pytrees
class _Static:
    """A static pytree part compared by value (dicts and lists included) and hashable."""

    def __init__(self, value):
        self.value = value

    def __eq__(self, other):
        return isinstance(other, _Static) and self.value == other.value

    def __hash__(self):
        return hash(json.dumps(self.value, sort_keys=True, default=repr))


_METRIC_STATIC = ("mode", "k", "fanout", "backend", "fallback", "extra", "memory", "compiles")
_METRIC_LEAVES = tuple(f.name for f in dataclasses.fields(Metrics) if f.name not in _METRIC_STATIC)
_ROUND_FIELDS = tuple(f.name for f in dataclasses.fields(RoundTimes))


def _flatten_metrics(m: Metrics):
    return ([getattr(m, n) for n in _METRIC_LEAVES],
            _Static(tuple(getattr(m, n) for n in _METRIC_STATIC)))


def _unflatten_metrics(static: _Static, leaves) -> Metrics:
    return Metrics(**dict(zip(_METRIC_STATIC, static.value)), **dict(zip(_METRIC_LEAVES, leaves)))


jax.tree_util.register_pytree_node(Metrics, _flatten_metrics, _unflatten_metrics)
jax.tree_util.register_pytree_node(
    RoundTimes, lambda r: ([getattr(r, n) for n in _ROUND_FIELDS], None),
    lambda _, leaves: RoundTimes(*leaves))


class CompileTimer:
    """Sums JAX's compile-event durations (trace, lower, backend compile) while active, in all and
    per program.

    `programs[name]`: the program's "trace_s", "lower_s" and "compile_s" (XLA's compile, or on
    a persistent-cache hit the read and load of the executable), their sum "seconds", "count"
    (compiles of that name) and "source": "compiled", "persistent cache" (the executable was
    read from JAX's persistent cache), "step store" (traced from an exported step of
    `aot.StoredJit`'s store, then compiled), "step store, persistent cache", or "traced" (a
    function traced inside another program, count 0: its trace is part of that one's). A name is JAX's
    (`jit(decode_chunk)`, or a stored step's own name); eager ops compile as small programs of
    their own (`jit(convert_element_type)`)."""

    _lock = threading.Lock()
    _active: list["CompileTimer"] = []
    _registered = False
    _thread = threading.local()  # a persistent-cache hit seen in this thread, for its compile

    def __init__(self):
        self.seconds = 0.0
        self.programs: dict[str, dict[str, Any]] = {}

    @classmethod
    def _listener(cls, event: str, duration: float, fun_name: str | None = None, **_):
        if event not in _COMPILE_EVENTS:
            return
        phase = _PHASE[event]
        hit = False
        if phase == "compile_s":  # JAX reports a cache hit inside the compile it ends
            hit, cls._thread.hit = getattr(cls._thread, "hit", False), False
        name = _program_name(fun_name)
        for t in list(cls._active):
            t.seconds += duration
            p = t.programs.setdefault(name, dict(seconds=0.0, trace_s=0.0, lower_s=0.0,
                                                 compile_s=0.0, count=0, source="traced"))
            p[phase] += duration
            p["seconds"] += duration
            if phase == "compile_s":
                p["count"] += 1
                stored = name in STORE_PROGRAMS  # aot.StoredJit's exported steps
                p["source"] = ("step store, persistent cache" if stored and hit else
                               "step store" if stored else
                               "persistent cache" if hit else "compiled")

    @classmethod
    def _event(cls, event: str, **_):
        if event == _CACHE_HIT:
            cls._thread.hit = True

    @classmethod
    def add_remote(cls, name: str, record: dict) -> None:
        """A compile another process made for the call (the draft process's, reported with its
        reply: `transport.RemoteDraft`), counted in every open timer under `name` with its
        phases, count and source, and told to each of `REMOTE_LISTENERS` (the progress lines)."""
        for t in list(cls._active):
            t.seconds += record["seconds"]
            p = t.programs.setdefault(name, dict(seconds=0.0, trace_s=0.0, lower_s=0.0,
                                                 compile_s=0.0, count=0, source="traced"))
            for key in ("seconds", "trace_s", "lower_s", "compile_s", "count"):
                p[key] += record[key]
            if record["count"]:
                p["source"] = record["source"]
        for listener in list(REMOTE_LISTENERS):
            listener(name, record)

    def take(self) -> dict:
        """The programs counted so far, and a fresh start: `programs` and `seconds` emptied."""
        with self._lock:
            programs, self.programs, self.seconds = self.programs, {}, 0.0
        return programs

    @contextlib.contextmanager
    def measure(self):
        """Context manager: add to `self.seconds` every compile event that ends while it is open
        (from any thread; the listener is registered with JAX once per process)."""
        with self._lock:
            if not CompileTimer._registered:
                jax.monitoring.register_event_duration_secs_listener(CompileTimer._listener)
                jax.monitoring.register_event_listener(CompileTimer._event)
                CompileTimer._registered = True
            CompileTimer._active.append(self)
        try:
            yield self
        finally:
            with self._lock:
                CompileTimer._active.remove(self)


REMOTE_LISTENERS: list = []  # f(name, record) for each compile another process reports


def _program_name(fun_name: str | None) -> str:
    """One name for a program's trace ("decode_chunk"), lowering and compile ("jit(decode_chunk)")
    events: JAX's jit(...) form."""
    if not fun_name:
        return "?"
    return fun_name if fun_name.startswith(("jit(", "pjit(")) else f"jit({fun_name})"


def mean_tokens(hist) -> float:
    """Mean tokens emitted per round, accepted + the bonus, from an accept histogram (1 if empty)."""
    total = sum(hist)
    return sum((j + 1) * c for j, c in enumerate(hist)) / total if total else 1.0
