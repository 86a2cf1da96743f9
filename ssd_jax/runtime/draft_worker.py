"""Everything the draft does, on the draft mesh: prefill, SD drafting, the SSD tree, lookup, backups.

The engine talks to the draft only through these methods. The device loop's (`first`,
`propose_from`, `dispatch_tree`, `resolve_on_device`) take a round's packed `Outcome`, on any
mesh or the host, and return speculation tokens / proposal rows: the same calls a draft in
another process serves from the packed outcome the wire carries (`ssd_jax.runtime.transport`,
`ssd_jax.runtime.draft_process`). `propose` and `backup` serve them (and a proposer's caller)
from a `RoundState`.
"""
from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from ssd_jax.models import backends
from ssd_jax.models.protocol import forward, init_cache, is_builtin, with_lengths
from ssd_jax.algorithm import backups, round_steps, steps
from ssd_jax.algorithm.aot import step_jit
from ssd_jax.runtime.config import CallConfig
from ssd_jax.runtime.metrics import layout_bytes
from ssd_jax.runtime.placement import _placed, move, settle, spans_processes, to_mesh
from ssd_jax.runtime.request import prefill_once
from ssd_jax.runtime.sharding import consume
from ssd_jax.algorithm.tree import draft_tree


@dataclasses.dataclass
class RoundState:
    """Per-row state at a round boundary, `[B]` device (or host) arrays: an unpacked `Outcome`'s
    rows (`of_outcome`)."""
    n: np.ndarray  # [B] position of the bonus token
    prev: np.ndarray  # [B] committed token at n-1
    bonus: np.ndarray  # [B]
    active: np.ndarray  # [B] bool
    # the rows' tokens for prompt lookup, [B, H] int32 by position (a proposer's; None where
    # nothing reads it)
    history: jax.Array | None

    @classmethod
    def of_outcome(cls, v, history=None) -> "RoundState":
        """The rows after an unpacked `round_steps.Outcome`'s commit (device or host arrays);
        history: a proposer's `[B, H]`."""
        return cls(n=v.n, prev=v.prev, bonus=v.bonus, active=v.active, history=history)


@step_jit(static_argnames=("cfg", "ops"))
def _logits(params, cfg, tokens, cache, ops):
    return forward(params, cfg, tokens, cache, ops=ops)[0]


class DraftWorker:
    """The draft model placed on its mesh, with the backend table chosen for that mesh
    (`ssd_jax.models.backends.select`) and its weights laid out once by that table's `prepare`."""

    def __init__(self, draft, sharding, row_vocab: int, backend="auto"):
        self.model = draft
        self.cfg = draft.cfg
        self.sharding = sharding  # replicated on the draft mesh: weights and scalars
        self.rows = sharding  # per-sequence arrays: batch-sharded on a 2+ device mesh (see start)
        self._batch = None
        self.local_rows = False  # set per call by `start`
        # A data-parallel draft (2+ devices) gets the xla table ("auto"), which XLA partitions
        # over the batch; a kernel's custom call has no partitioning rule.
        self.ops = backends.select(backend, sharding.mesh)
        # a model of one's own (models.protocol) brings its own ops: no layout pass for it;
        # the built-in one's params are taken over (draft.params becomes the laid-out copy)
        self.params = (consume(draft, lambda f, x: to_mesh(x, sharding), self.ops.prepare)
                       if is_builtin(self.cfg) else to_mesh(draft.params, sharding))
        self.row_vocab = int(row_vocab)  # the target's rows: proposals are padded/cut to match
        tok = draft.tokenizer
        self.vocab_size = tok.vocab_size if tok is not None else min(self.cfg.vocab_size, row_vocab)
        self.cache = None
        self._tree = None
        self._tree_s = None
        self._spec_bytes: dict[str, int] = {}  # {device: bytes} of the last call's tree
        self._tree_shapes = None  # a chunked call's tree arguments, as shapes (`spec_bytes`)
        self._serial = spans_processes(sharding.mesh)
        self._sampling = (None, None)  # (host values, the SamplingParams placed on the draft mesh)
        self._values = (None, None)  # (call, its seed and request ids placed on the draft mesh)
        self._sampling_of = None  # (the SamplingParams object last placed, the batch)
        self.counters = None  # SSD's lookup counters of the call (device loop)

    def width_times(self, widths: tuple[int, ...] = (1, 8), context: int = 128,
                    repeats: int = 3) -> dict[int, float]:
        """{M: seconds} of one draft forward over M new tokens (batch 1, `context` tokens of KV),
        the median of `repeats` after a compile: what a tree step over M branches costs on this
        draft's devices (`policy.width_slope_from_times` makes the planner's slope of it)."""
        cache = init_cache(self.cfg, 1, context + max(widths), sharding=self.sharding)
        cache = with_lengths(cache, to_mesh(np.asarray([context], np.int32), self.sharding))
        out = {}
        for m in widths:
            toks = to_mesh(np.zeros((1, m), np.int32), self.sharding)
            ts = []
            for _ in range(repeats + 1):
                t0 = time.perf_counter()
                jax.block_until_ready(_logits(self.params, self.cfg, toks, cache, self.ops))
                ts.append(time.perf_counter() - t0)
            out[m] = float(np.median(ts[1:]))
        return out

    def _put(self, x):
        """x (host or device values) on the draft mesh: per-row arrays `[B, ...]` with the
        rows' sharding, anything else replicated; a device array moves device to device."""
        if not isinstance(x, jax.Array):
            x = np.asarray(x)
        per_row = x.ndim >= 1 and x.shape[0] == self._batch
        return to_mesh(x, self.rows if per_row else self.sharding)

    def _call_values(self, run: CallConfig):
        """(seed, request ids `[B]`) of the call on the draft mesh, placed once per call."""
        key = (self._batch, run.seed, run.request_ids)
        if self._values[0] != key:
            self._values = (key, (to_mesh(np.int32(run.seed), self.sharding),
                                  self._put(np.asarray(run.request_ids, np.int32))))
        return self._values[1]

    def _placed_sampling(self, sp):
        """`sp` (a SamplingParams of host values) on the draft mesh, placed once per new value or
        batch: its values are traced arguments of the draft's steps, so a new value recompiles
        nothing and the same one is not sent again every round."""
        if self._sampling_of is not None and self._sampling_of[0] is sp \
                and self._sampling_of[1] == self._batch:  # the same object again: this call's
            return self._sampling[1]
        key = (self._batch,) + tuple(np.asarray(v).tobytes() + np.asarray(v).dtype.str.encode()
                                     for v in (sp.temperature, sp.top_k, sp.top_p))
        if self._sampling[0] != key:
            self._sampling = (key, jax.tree_util.tree_map(self._put, sp))
        self._sampling_of = (sp, self._batch)
        return self._sampling[1]

    def _fit_rows(self, rows):
        return round_steps.fit_rows(rows, self.row_vocab)

    def start(self, prompt_tokens: np.ndarray, prompt_lens: np.ndarray, cache_len: int):
        """Prefill the draft's cache with the prompts [B, T] (lengths [B]) in a cache of
        `cache_len` slots; dispatched, not waited for (`ready` waits)."""
        B = prompt_tokens.shape[0]
        self._batch, self.rows = B, _batch_sharding(self.sharding, B)
        # whether the call's rows are sharded over a data-parallel mesh: then no draft step may
        # reduce across them (`round_steps.resolve`'s local_rows)
        self.local_rows = len(self.rows.device_set) > 1 and not self.rows.is_fully_replicated
        self.spec_bytes = {}
        self.cache = init_cache(self.cfg, B, cache_len, sharding=self.rows)
        if prefill_once(self.cfg, len(self.rows.device_set), prompt_tokens, prompt_lens):
            self.cache = steps.prefill_cache_shared(self.params, self.cfg, self.cache,
                                                    self._put(prompt_tokens[:1]),
                                                    self._put(prompt_lens[:1]), ops=self.ops)
        else:
            self.cache = steps.prefill_cache(self.params, self.cfg, self.cache,
                                             self._put(prompt_tokens), self._put(prompt_lens),
                                             ops=self.ops)
        self.cache = settle(self.cache, self._serial)
        self.history = None  # the rows' tokens by position, for the device loop's n-gram backup
        self._prompt = (prompt_tokens, cache_len)

    def warm_up(self, call) -> None:
        """Run a throwaway call of `call`'s shapes and statics (a `warmup.CallPlan`), so that the
        call itself finds its draft programs compiled or loaded: the prefill, then SD's proposal,
        or SSD's first backup, its tree, and a lookup that misses (an outcome no branch holds)
        with the backup that follows, each from a packed `Outcome` as the device loop sends it.
        The next `start` replaces what it leaves."""
        B, run = len(call.lens), call.call
        self.start(call.tokens, call.lens, call.cache_len)
        lens = np.asarray(call.lens, np.int32)
        z, ones = np.zeros(B, np.int32), np.ones(B, np.int32)
        prev = np.asarray(call.tokens, np.int32)[np.arange(B), lens - 1]
        # the rows after the prefill and its one-token report (`round_steps.round_view`)
        view = round_steps.packed_on_host(1, num_accepted=z, bonus_out=z, n=lens, prev=prev,
                                            bonus=z, active=ones)
        if call.mode == "sd":  # round 1's proposal, then one from a verified round's outcome
            after = round_steps.packed_on_host(run.k + 1, num_accepted=z, bonus_out=z, n=lens + 1,
                                               prev=prev, bonus=z, active=ones)
            for packed in (view, after):
                spec, _, v = self.propose_from(packed, run)
                jax.block_until_ready(round_steps.pass_report(v.report, spec))
            return
        spec, _, v = self.first(view, run)
        jax.block_until_ready(round_steps.pass_report(v.report, spec))
        self.dispatch_tree(RoundState.of_outcome(v), spec, self._put(np.ones(B, bool)), run,
                           wait=True)
        keys = np.asarray(self._tree.keys)  # [B, MQ, 2]: (accepted, bonus) each branch assumed
        bonus = np.asarray([min(set(range(len(k) + 1)) - set(k[k[:, 0] == 0, 1].tolist()))
                            for k in keys], np.int32)
        # a verified round: none accepted, a bonus no branch holds, its (K+1)-token report
        outcome = round_steps.packed_on_host(run.k + 1, num_accepted=z, bonus_out=bonus, n=lens + 1,
                                             prev=prev, bonus=bonus, active=ones)
        neural = True if run.backup == "auto" else None  # auto's program takes its choice traced
        jax.block_until_ready(self.resolve_on_device(outcome, run, neural)[1])
        self._tree = None

    def first(self, packed, run: CallConfig):
        """SSD's round 1, which has no speculation cache yet: a backup from the rows after the
        prefill (packed `[B, 6 + R]`: `round_steps.round_view`, on any mesh or the host). Zeroes
        the call's lookup counters and, for the n-gram backup, starts the rows' history. Returns
        (spec `[B, K]`, rows `[B, K, V]`, the view unpacked on the draft mesh), in flight."""
        self.start_counters(run.k)
        v = round_steps.unpack(self._put_rows(packed))
        if run.backup == "ngram":
            self.start_history(v)
        spec, rows = self.backup(RoundState.of_outcome(v), run)
        return spec, rows, v

    def propose_from(self, packed, run: CallConfig):
        """SD's next speculation from a round's packed `Outcome` (or round 1's view): (spec
        `[B, K]`, rows `[B, K, V]`, the outcome unpacked on the draft mesh), in flight."""
        v = round_steps.unpack(self._put_rows(packed))
        spec, rows = self.propose(RoundState.of_outcome(v), run)
        return spec, rows, v

    def start_history(self, outcome) -> None:
        """The device loop's n-gram backup: each row's tokens by position `[B, cache_len]` on
        the draft mesh, from the prompts `start` was given and the prefill's token (outcome: the
        first round's unpacked `Outcome`); `resolve_on_device` adds each round's tokens."""
        toks, cache_len = self._prompt
        self.history = backups.start_history(self._put(toks), outcome.report, outcome.n, cache_len)

    def ready(self):
        """Block until the prompt's KV (dispatched by `start`) is computed."""
        jax.block_until_ready(self.cache)

    def propose(self, s: RoundState, run: CallConfig, saguaro_top_n: tuple[int, ...] = (),
                saguaro_c: float = 1.0, draft_rows: np.ndarray | None = None):
        """K draft tokens from each row's bonus (SD drafting; also the neural backup, for the
        `draft_rows` [B] that missed: the others' draft KV stays untouched)."""
        seed, rids = self._call_values(run)
        spec, rows, self.cache = steps.draft_chain(
            self.params, self.cfg, self.cache, self._put(s.prev), self._put(s.bonus), self._put(s.n),
            seed, rids, self._placed_sampling(run.draft_sampling),
            self.vocab_size, run.k, saguaro_top_n, np.float32(saguaro_c), run.row_dtype, ops=self.ops,
            draft_rows=None if draft_rows is None else self._put(
                draft_rows if isinstance(draft_rows, jax.Array) else np.asarray(draft_rows, bool)))
        return settle((spec, self._fit_rows(rows)), self._serial)

    def backup(self, s: RoundState, run: CallConfig, draft_rows: np.ndarray | None = None):
        """A speculation from each row's real outcome (ALGORITHM.md §5) for the `draft_rows` [B]
        that need one (default: the active rows). Saguaro scales the top F^b_i + 1 tokens of draft token i+1: the
        candidates the fork after this backup round will cache."""
        if run.backup in ("neural", "auto"):  # auto: round 1 (`first`) is neural
            top_n = tuple(f + 1 for f in run.fanout_backup[:-1])
            rows = s.active if draft_rows is None else draft_rows
            return self.propose(s, run, top_n, run.saguaro_c, draft_rows=rows)
        (seed, rids), n = self._call_values(run), self._put(s.n)
        kw = dict(k=run.k, vocab_size=self.vocab_size, row_vocab=self.row_vocab,
                  row_dtype=run.row_dtype)
        if run.backup == "random":
            return settle(backups.random_speculation(seed, rids, n, **kw), self._serial)
        if run.backup == "ngram":  # the rows' history kept here (`start_history`)
            return backups.ngram_speculation_on_device(self.history, seed, rids, n, **kw)
        raise ValueError(f"unknown backup {run.backup!r}")

    def dispatch_tree(self, s: RoundState, spec, from_backup: np.ndarray, run: CallConfig,
                      wait: bool = False):
        """Glue + fork + tree decode for the speculation in flight (async: returns at once).
        wait=True blocks until the tree is ready and records its time (a draft process has
        nothing else to do meanwhile, so this measures T_p without serialising anything)."""
        t0 = time.perf_counter()
        args = self._tree_args(s, spec, from_backup, run)
        try:
            self._tree, self.cache = draft_tree(*args, ops=self.ops)
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile at these shapes
            fallback = backends.without_kernels(self.ops, ("tree_attention",), f"{type(e).__name__}: {e}")
            if fallback is self.ops:
                raise
            self.ops = fallback  # compile errors raise before anything runs: the cache is intact
            self._tree, self.cache = draft_tree(*args, ops=self.ops)
        settle(self._tree, self._serial)
        self._tree_s = None
        if wait:
            jax.block_until_ready(self._tree)
            self._tree_s = time.perf_counter() - t0

    def tree_ready(self) -> None:
        """Block until the tree in flight is computed (a timed round's draft time, `DeviceLoop`
        with timeline=True); an error of its computation raises here."""
        jax.block_until_ready(self._tree)

    def _tree_args(self, s: RoundState, spec, from_backup, run: CallConfig) -> tuple:
        """`draft_tree`'s positional arguments for the speculation in flight, on the draft mesh."""
        top_n = tuple(f + 1 for f in run.fanout_hit[:-1])
        seed, rids = self._call_values(run)
        if isinstance(s.bonus, jax.Array):  # the device loop: every per-row array in one move
            bonus, spec, n, active, from_backup = self._put_rows(
                (s.bonus, spec, s.n, s.active, from_backup))
        else:
            bonus, spec, n, active, from_backup = (
                self._put(s.bonus), to_mesh(spec, self.rows), self._put(s.n),
                self._put(s.active), self._put(from_backup))
        return (self.params, self.cfg, self.cache, bonus, spec, n, active, from_backup, seed,
                rids, self._placed_sampling(run.draft_sampling), self.vocab_size,
                run.fanout_hit, run.fanout_backup, top_n, np.float32(run.saguaro_c), run.row_dtype)

    def note_tree_layout(self, s: RoundState, spec, from_backup, run: CallConfig) -> None:
        """Where the tree never leaves a computation (the device loop's chunks of rounds): keep
        its arguments' shapes, from which `spec_bytes` lays the tree out when asked."""
        if not self._spec_bytes:
            self._tree_shapes = jax.tree_util.tree_map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding)
                if isinstance(x, jax.Array) else x, self._tree_args(s, spec, from_backup, run))

    @property
    def spec_bytes(self) -> dict[str, int]:
        """{device: bytes} of the last call's tree (`metrics.memory_of`'s spec_cache). A chunked
        call's is computed here, from shapes (`jax.eval_shape`: a trace, nothing runs), so
        only a caller who asks pays for it."""
        if self._tree_shapes is not None:
            shapes, _ = draft_tree.jit.eval_shape(*self._tree_shapes, ops=self.ops)
            self._spec_bytes, self._tree_shapes = layout_bytes(shapes, self.rows), None
        return self._spec_bytes

    @spec_bytes.setter
    def spec_bytes(self, value: dict[str, int]) -> None:
        self._spec_bytes, self._tree_shapes = value, None

    def start_counters(self, k: int) -> None:
        """Zero SSD's lookup counters for a call at lookahead k (the device loop's; per row,
        placed as the rows are, after `start`)."""
        self.counters = to_mesh(round_steps.LookupCounters.zeros(k, self._batch), self.rows)

    def resolve_on_device(self, outcome, run: CallConfig, neural: bool | None = None):
        """`resolve` for the device loop: the verify's packed `Outcome` (on the target mesh;
        moved here device to device) -> (spec `[B, K]`, rows `[B, K, V]`, missed `[B]`, the
        round's report with its hit column, the outcome unpacked here), all on the draft mesh and
        nothing waited for; the call's counters are updated in place (`self.counters`).
        neural: under backup="auto", this round's choice (traced); None for the other backups."""
        seed, rids = self._call_values(run)
        outcome = self._put_rows(outcome)
        kw = dict(vocab_size=self.vocab_size, row_vocab=self.row_vocab, k=run.k,
                  backup=run.backup, row_dtype=run.row_dtype, local_rows=self.local_rows,
                  saguaro_top_n=tuple(f + 1 for f in run.fanout_backup[:-1]))

        def call():
            return round_steps.resolve(self.params, self.cfg, self.cache, self._tree, outcome,
                                       self.counters, seed, rids,
                                       self._placed_sampling(run.draft_sampling),
                                       np.float32(run.saguaro_c),
                                       self.history if run.backup == "ngram" else None, neural,
                                       ops=self.ops, **kw)
        try:
            spec, rows, missed, self.cache, self.counters, rep, view, history = call()
        except Exception as e:  # noqa: BLE001 - a kernel that fails to compile at these shapes
            fallback = backends.without_kernels(self.ops, ("cache_gather",), f"{type(e).__name__}: {e}")
            if fallback is self.ops:
                raise
            self.ops = fallback  # compile errors raise before anything runs: the cache is intact
            spec, rows, missed, self.cache, self.counters, rep, view, history = call()
        if history is not None:
            self.history = history
        self._drop_tree()
        return spec, rows, missed, rep, view

    def _drop_tree(self) -> None:
        """Forget the round's tree once looked up, keeping its size for `metrics.memory_of` (the
        same every round of a call)."""
        if self._tree is not None and not self._spec_bytes:
            self.spec_bytes = layout_bytes(self._tree)
        self._tree = None

    def _put_rows(self, tree):
        """Per-row device arrays (a pytree of `[B, ...]`) onto the draft mesh in one move; each
        leaf already there is kept as is."""
        leaves, treedef = jax.tree_util.tree_flatten(tree)
        if all(isinstance(x, jax.Array) and _placed(x, self.rows) for x in leaves):
            return tree
        return move(tree, self.rows)  # the packed outcome, every round

    def finish(self):
        """End of a generate call: the call's last tree, if one is left, is dropped (its size
        kept for `metrics.memory_of`). A remote worker is told to stop waiting for outcomes."""
        self._drop_tree()


def _batch_sharding(sharding, batch: int):
    """Data parallelism on a 2+ device draft mesh: shard the batch axis when it divides evenly."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    mesh = sharding.mesh
    if mesh.devices.size > 1 and batch % mesh.devices.size == 0:
        return NamedSharding(mesh, P(mesh.axis_names))
    return sharding


