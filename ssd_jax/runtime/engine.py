"""The round loop for `ar | sd | ssd`: the only place that knows about time, devices and rounds.

    engine = Engine(target, draft)                      # models.Model (cfg, params, tokenizer)
    out = engine.generate(["def fib(n):"], mode="ssd", max_new_tokens=64)
    out.texts[0], out.metrics.hit_rate

SSD round (ALGORITHM.md §2): dispatch `verify` on the target mesh, dispatch `draft_tree` on the draft mesh
right after (async dispatch overlaps them), block on the outcome only, look the outcome up in the
speculation cache, back up the missed rows, commit. Output is exactly the target's distribution in
every mode; modes differ only in speed.
"""
from __future__ import annotations

import dataclasses
import functools
import threading
import time
from typing import Callable, Sequence

import numpy as np

from ssd_jax.models import backends
from ssd_jax.models.adapters import as_model
from ssd_jax.models.draft_head import head_width
from ssd_jax.models.protocol import is_builtin
from ssd_jax.runtime.batch import Batch, GenerationResult
from ssd_jax.runtime.chat import chat_prompts
from ssd_jax.runtime import stream as streaming
from ssd_jax.runtime.compile_cache import enable_compilation_cache
from ssd_jax.runtime.config import (CallConfig, SSDConfig, call_config, check_max_len, check_pair,
                                    check_request)
from ssd_jax.runtime.device_loop import DeviceLoop
from ssd_jax.runtime.draft_worker import DraftWorker
from ssd_jax.runtime.fallback import DraftDown, Guarded, fall_back, restart
from ssd_jax.runtime.mappings import watch_mappings
from ssd_jax.runtime.metrics import CompileTimer, Metrics
from ssd_jax.algorithm.policy import BackupChooser, plan_from_sd, width_slope_from_times
from ssd_jax.runtime.proposer import Proposer
from ssd_jax.runtime.placement import Placement, make_placement, spans_processes, to_mesh
from ssd_jax.runtime.request import cache_length, encode, padded_rows
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.runtime.sharding import take_target


def _one_call_at_a_time(method):
    """Run an Engine method under the engine's lock (see `Engine`): a stream this thread left
    running ends first, then the call waits for any other thread's call to finish."""
    @functools.wraps(method)
    def call(self, *args, **kwargs):
        streaming.settle(self)  # a stream this thread left running on this engine ends first
        if self._holder == threading.get_ident():
            raise RuntimeError(f"Engine.{method.__name__} called from inside a call on the same "
                               f"engine (e.g. from on_tokens): it would wait for itself; use "
                               f"another Engine, or call after this one returns")
        with self._lock:
            self._holder = threading.get_ident()
            try:
                return method(self, *args, **kwargs)
            finally:
                self._holder = None
    return call


class Engine:
    """Holds the loaded target and draft, placed on their meshes, and runs generate calls.

    One call at a time: an engine's calls (`generate`, `stream`, `restart_draft`) serialise on
    one lock, held for the whole call (a stream's from its first delta to its last, on its worker
    thread), so threads may share an engine and each call returns exactly what it returns run
    alone; a second thread's call waits for the first to end. A call made from inside a call on
    the same thread (from `on_tokens`) is a RuntimeError; a stream the calling thread stopped
    iterating is ended first (see `stream`). Concurrency across calls needs one Engine per
    caller (each its own cache and compiled steps). A two-process draft (`start_two_process`,
    join mode) serves one target connection: the engine bound to it, one call at a time; two
    engines must not share one `RemoteDraft`. A draft in this process that hangs (never returns)
    is not detected: XLA cannot cancel a running computation, so the draft process, which can be
    stopped, is the layout for that (README, "Reliability").

    One copy of the weights: the engine takes a built-in `Model`'s params over. `Engine(target,
    draft)` places them on their mesh and lays them out with the backend's `prepare` a layer at
    a time, pointing `target.params` (and `target.cfg`, for a tensor-parallel layout) at the
    result as it goes, so the un-prepared arrays are released as they are replaced and the
    devices never hold the model twice. Afterwards `target` and `engine.target` (the same object)
    hold the engine's laid-out weights: its config and tokenizer are as before, and
    `forward(target.params, target.cfg, tokens, cache, ops=engine.tops)` runs it (the default
    XLA ops also run it unless the backend re-laid out a weight, e.g. the CPU kernels' bf16
    strips; a later Engine of another backend turns such weights back into logical ones
    first). Keep your own reference to the original params only if you want a second copy.
    The draft's `Model` is taken over the same way by its `DraftWorker`. Load with
    `load_model(..., sharding=placement.target_mesh)` to build the weights on the mesh in the
    first place (each device receives only its shard)."""

    def __init__(self, target, draft=None, *, placement: str | Placement = "split",
                 max_len: int = 4096, compilation_cache: bool | str = True, remote_draft=None,
                 proposer=None, backend: str = "auto", strict: bool = False,
                 step_store: bool | None = None, round_chunks: bool | None = None,
                 batch_buckets: bool | None = None):
        """target / draft: `ssd_jax.models.model.Model` (the built-in transformer, or a model of
        one's own from `ssd_jax.models.adapters`: `from_nnx`, `from_functions`; a flax.nnx.Module
        that follows `ssd_jax.models.protocol` is adapted as is; anything else is one TypeError
        naming what it lacks). placement: "split" | "colocated" | a layout "T+D" such as "4+1"
        (T-way tensor-parallel target, D-way data-parallel draft; ssd_jax.runtime.sharding)
        | a ready Placement. remote_draft: a `ssd_jax.runtime.transport.RemoteDraft` (the draft in its own
        process, started by `start_two_process`) instead of a local draft. proposer: any
        `ssd_jax.runtime.proposer.Proposer` (SD only) instead of a draft model. backend: the op
        table for each mesh, "auto" (pallas on a GPU, the cpu kernels on a one-device CPU mesh
        where they build, else xla), "xla", "pallas", a plug-in name, or an `Ops`
        (`ssd_jax.models.backends.select`); `self.backend` reports the choice per model.
        strict: when the draft fails mid-call (ssd_jax.runtime.fallback), False finishes the call
        with plain decoding on the target (one DraftFallbackWarning, `metrics.fallback`), True
        raises `ssd_jax.DraftFailure` with the tokens so far; `restart_draft()` brings it back.
        compilation_cache: JAX's persistent cache (True: the default directory,
        $SSD_JAX_COMPILE_CACHE overrides; a directory; False: leave JAX's settings alone).
        step_store: also store the steps' exported modules there, so a later process skips
        their trace and lowering (`ssd_jax.algorithm.aot`; None: $SSD_JAX_STEP_STORE, default
        off; the CLI turns it on). Leave it off where you patch library code in memory.
        round_chunks: SD and SSD with the draft on the target's own mesh (colocated, or one
        device) run up to 8 rounds a dispatch in one `lax.while_loop` (`round_steps.sd_chunk` /
        `ssd_chunk`; the same tokens). None (default): on a GPU or TPU, where a round's
        dispatches cost as much as its compute, and off on a CPU, where the default pair's
        chunks run a call 2-6% faster but compile 5-8 s longer on its first
        (benchmarks/README.md at 8faea7c); True / False force it.
        batch_buckets: True runs a call of B prompts as `request.batch_bucket(B)` rows (1, 2, 4,
        8, then multiples of 8), the rest padding that never runs, so a new batch size within a
        bucket reuses the compiled steps (each row's tokens are its own either way: every draw
        is keyed by its request); False runs exactly B rows. None (default): on a GPU or TPU,
        where a few rows more barely move a step's time and a compile takes a minute, and off
        on a CPU, where the padding rows cost their share (benchmarks/README.md,
        "batch_buckets.py")."""
        for name, v in (("round_chunks", round_chunks), ("batch_buckets", batch_buckets)):
            if v is not None and not isinstance(v, bool):
                raise TypeError(f"{name} must be True, False or None, got {v!r}")
        self.round_chunks = round_chunks
        self.batch_buckets = batch_buckets
        enable_compilation_cache(compilation_cache, step_store)
        watch_mappings()  # a warning before XLA:CPU's programs use up the process's mappings
        target = as_model(target, "target")  # one TypeError naming what a wrong object lacks
        draft = None if draft is None else as_model(draft, "draft")
        if is_builtin(target.cfg) and head_width(target.params) < target.cfg.vocab_size:
            raise ValueError(f"the target's head scores only {head_width(target.params)} of "
                             f"{target.cfg.vocab_size} token ids (ssd_jax.models.draft_head.truncate_head): "
                             "the output would be exact to that cut model, not the target; cut "
                             "the draft's head instead")
        if sum(x is not None for x in (draft, remote_draft, proposer)) > 1:
            raise ValueError("give one of draft, remote_draft or proposer")
        if remote_draft is not None:
            placement = "colocated"  # the target alone uses this process's device
        self.placement = (placement if isinstance(placement, Placement)
                          else make_placement(placement))
        self.target = target
        self.draft = draft if draft is not None else remote_draft
        check_max_len(max_len)
        self.max_len = int(max_len)
        self.strict, self._backend = bool(strict), backend
        if draft is not None:
            check_pair(target, draft)
            self.worker = DraftWorker(draft, self.placement.draft, target.cfg.vocab_size, backend)
        elif remote_draft is not None:
            self.worker = remote_draft.bind(target)
        elif proposer is not None:
            if not isinstance(proposer, Proposer):
                raise ValueError("proposer must have start, propose and finish methods "
                                 "(ssd_jax.runtime.proposer.Proposer)")
            self.draft = self.worker = proposer
        else:
            self.worker = None
        # tcfg: the target's config as its (possibly tensor-parallel) weights are laid out; the
        # backend's own layout pass (`prepare`) runs once, on the placed weights
        self.tops = backends.select(backend, self.placement.target_mesh)
        if is_builtin(target.cfg):  # consumed: target.params becomes the laid-out weights
            self.tcfg, self.tparams = take_target(target, self.placement.target_mesh, self.tops.prepare)
        else:  # a model of one's own (models.protocol): replicated on the target mesh, own ops
            self.tcfg, self.tparams = target.cfg, to_mesh(target.params, self.placement.target)
        self._serial = spans_processes(self.placement.target_mesh)
        tok = target.tokenizer
        self.vocab_size = tok.vocab_size if tok is not None else target.cfg.vocab_size
        self.eos_ids = tuple(tok.eos_ids) if tok is not None else ()
        self.tcache = None  # the last call's target KV cache, its DeviceLoop's (memory_of)
        self._t1: float | None = None  # last measured plain decode step (for the §6 prediction)
        self._sd: dict | None = None  # last SD run's verify / draft medians and accept histogram
        self._width_slope: float | None = None  # the local draft's, measured once (plan_fanout)
        self._lock = threading.Lock()  # one call at a time (_one_call_at_a_time)
        self._holder: int | None = None  # the thread whose call holds it

    @property
    def backend(self) -> dict[str, str]:
        """The op table each model runs with: {"target": name, "draft": name} ("draft" only with a
        local draft model; a remote draft reports its own in `info`)."""
        out = {"target": self.tops.name}
        ops = getattr(self.worker, "ops", None)
        if ops is not None:
            out["draft"] = ops.name
        elif getattr(self.worker, "info", None):
            out["draft"] = str(self.worker.info.get("backend", "?"))
        return out

    # ------------------------------------------------------------------ public API
    @_one_call_at_a_time
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]] | str | None = None, *,
                 messages: Sequence[dict] | Sequence[Sequence[dict]] | None = None,
                 mode: str = "ssd", max_new_tokens: int = 64,
                 sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
                 draft_sampling: SamplingParams | Sequence[SamplingParams] | None = None, k: int = 4,
                 ssd: SSDConfig = SSDConfig(), seed: int = 0, stop: Sequence[str] = (),
                 chat: bool = False, eos_ids: Sequence[int] | None = None,
                 request_ids: Sequence[int] | None = None,
                 on_tokens: Callable[[int, list[int]], None] | None = None,
                 verifier: Callable | None = None, timeline: bool = False) -> GenerationResult:
        """Generate up to `max_new_tokens` tokens for each prompt; every mode samples exactly the
        target's distribution (docs/ALGORITHM.md §3), modes differ only in speed.

        prompts: a string, a list of strings (tokenized by the target's tokenizer; `chat` applies
            its chat template to each as one user turn), or token ids (a list of ints, or a list
            of such lists). B prompts of any lengths form one batch.
        messages: instead of prompts, a chat: [{"role": "system" | "user" | "assistant" |
            "tool", "content": str}, ...] (system prompt and turns), or a list of such chats,
            rendered by the target's chat template (ssd_jax.runtime.chat).
        mode: "ar" (plain decoding), "sd" (speculative decoding with the draft), "ssd" (the
            speculation cache: the draft pre-drafts the next round for likely outcomes).
        sampling: the target's `SamplingParams` (temperature 0 = greedy; top-k, top-p), or one
            per prompt; draft_sampling: the draft's proposal (default: the same); any proposal
            stays exact. Their values are traced, and so is Saguaro C (`ssd.saguaro_c`): a call
            with new values reuses the compiled steps; only switching between all-greedy and
            sampled parameters compiles anew (`SamplingParams`).
        k: lookahead K, draft tokens per round. ssd: `SSDConfig` (fan-out F_0..F_K, Saguaro C,
            backup "neural" | "random" | "ngram" | "auto", proposal row dtype, cache budget).
        seed: the run's PRNG seed; every draw is keyed by (seed, request id, position, stream),
            so a request's tokens depend on none of the batch, hits or misses.
            request_ids [B]: the ids those keys use (default 0..B-1).
        stop: strings that end a sequence (the text is cut before them); eos_ids: token ids that
            end it (default: the tokenizer's EOS tokens).
        on_tokens(row, ids): called as each row's tokens are committed (streaming).
        verifier: a function with `ssd_jax.rejection_sample`'s signature (p [B, K+1, V],
            q [B, K, V], tokens [B, K], accept keys, residual keys) -> VerifyResult, e.g. a
            planted bug for the exactness harness.
        timeline: wait between a round's phases to time them (`metrics.timeline`'s verify /
            draft / backup seconds, `predicted_speedup`, what `fanout="plan"` plans from), each
            round read before the next is dispatched: same tokens, slower rounds. By default
            rounds are enqueued ahead of the host's one small read each
            (`ssd_jax.runtime.device_loop`) and the timeline has each round's wall time and
            counts only.

        Returns a `GenerationResult`: texts [B], token_ids [B][n_b], logprobs [B][n_b] (the
        target's raw log-probabilities of the emitted tokens), finish reasons and `metrics`
        (tokens/s, tokens per round, acceptance, hit rate, the per-round timeline, the backend).
        Raises ValueError, before any work, for an argument it cannot serve.
        """
        prompts, chat = chat_prompts(self.target.tokenizer, prompts, messages, chat)
        check_request(mode, max_new_tokens, k, sampling, draft_sampling, ssd, self.vocab_size,
                      seed=seed, stop=stop, eos_ids=eos_ids, on_tokens=on_tokens,
                      verifier=verifier, chat=chat, request_ids=request_ids)
        if mode != "ar" and self.draft is None:
            raise ValueError(f"mode {mode!r} needs a draft model: Engine(target, draft)")
        if mode == "ssd" and isinstance(self.worker, Proposer) and not hasattr(self.worker,
                                                                             "resolve_on_device"):
            raise ValueError("mode 'ssd' needs a draft model (its tree); a proposer serves mode 'sd'")
        ids = encode(prompts, self.target.tokenizer, self.vocab_size, chat)
        rids = np.asarray(request_ids if request_ids is not None else range(len(ids)), np.int32)
        if rids.shape != (len(ids),):
            raise ValueError(f"request_ids needs one id per prompt ({len(ids)}), got {rids.shape}")
        # [B] values, traced by the steps (SamplingParams.per_request), B the batch bucket's rows
        ids, rids, sampling, draft_sampling, n = padded_rows(ids, rids, sampling, draft_sampling,
                                                             self._buckets())
        batch = Batch(ids, max_new_tokens, self.eos_ids if eos_ids is None else eos_ids, stop,
                      self.target.tokenizer.decode if self.target.tokenizer else None, on_tokens,
                      rows=n)
        cache_len = cache_length(batch.prompt_lens, max_new_tokens, k, self.max_len,
                                 self.target.cfg.max_position_embeddings)
        metrics = Metrics(mode=mode, backend=self.backend)
        if mode == "ssd" and ssd.fanout == "plan":
            ssd = dataclasses.replace(ssd, fanout=self.plan_fanout(k, batch.rows),
                                      fanout_backup=None)
        # SSD's fan-out lists and speculation-cache budget: a refusal comes before any work
        call = call_config(mode, k, seed, rids, sampling, draft_sampling, ssd, self.vocab_size,
                           self.target.cfg.vocab_size, verifier, rows=batch.rows)
        chooser = None
        if mode == "ssd":
            metrics.init_hist(call.k)
            metrics.fanout = call.fanout_hit
            chooser = BackupChooser(batch.rows) if call.backup == "auto" else None
        timer = CompileTimer()
        # its failures: DraftDown (a timed round waits for each draft call; otherwise the loop
        # reads the draft's last array of each round instead, `device_loop`)
        draft = Guarded(self.worker, wait=timeline) if mode != "ar" else None
        with timer.measure():
            self._rounds(batch, cache_len, call, metrics, mode, chooser, draft, timeline, timer)
        if timeline and metrics.fallback is None:  # its phases were timed
            if mode == "sd":  # what fanout="plan" plans from
                self._sd = metrics.sd_phases() or self._sd
            elif mode == "ssd":
                metrics.predicted_speedup = metrics.ssd_prediction(self._t1)
        metrics.compile_s = timer.seconds
        metrics.compiles = {name: dict(p) for name, p in timer.programs.items()}
        metrics.backend = self.backend  # again: a kernel may have fallen back during the run
        metrics.new_tokens = sum(len(g) for g in batch.generated)
        return batch.result(metrics)

    def _buckets(self) -> bool:
        """Whether calls pad their rows to the batch bucket (`batch_buckets`; None: not on a
        CPU)."""
        if self.batch_buckets is not None:
            return self.batch_buckets
        return not self.placement.on_cpu

    def _rounds(self, batch: Batch, cache_len: int, call: CallConfig, m: Metrics, mode: str,
                chooser, draft, timeline: bool, timer: CompileTimer) -> None:
        """The call's prefill and rounds (`ssd_jax.runtime.device_loop`, every mode, draft and
        placement); a draft that fails hands the call to plain decoding from its committed
        tokens. chooser: SSD's `BackupChooser` under backup="auto", else None."""
        self.tcache = None  # the last call's: released before this call places its own
        loop = DeviceLoop(self, batch, call, m, k=0 if mode == "ar" else call.k, timed=timeline,
                          timer=timer)
        try:
            loop.prefill(cache_len, draft)
            if mode == "ar":
                loop.ar()
                self._t1 = loop.t1 if loop.t1 is not None else self._t1  # the §6 prediction's
            elif mode == "sd":
                loop.sd(draft)
            else:
                loop.ssd(draft, chooser)
        except DraftDown as down:  # go on with the target alone from the committed tokens
            loop.sync_host()
            # a remote draft's counters came with its last reply, of a round committed; an
            # in-process draft's are on its failed device (or count a round rolled back)
            loop.counters_into(m, self.worker.counters if loop.remote else None)
            m.new_tokens = sum(len(g) for g in batch.generated)
            fall_back(self, down, batch, m, self.strict)
            loop.recover(cache_len)
            loop.ar(measure=False)
        finally:
            self.tcache = loop.tcache  # what `metrics.memory_of` counts after the call
        loop.sync_host()

    def stream(self, prompts=None, *, messages=None, **kwargs) -> "streaming.TextStream":
        """`generate` as a generator of `ssd_jax.runtime.stream.StreamDelta`s (row, text,
        token_ids, logprobs, finish_reason on a row's last one), for `for d in
        engine.stream(...)`; a delta's text never splits a UTF-8 character, and a row's texts
        join to its `generate` text. Takes generate's arguments but on_tokens (a TypeError at
        once for an unknown one); the call starts on the first iteration and raises its errors
        there. The returned `TextStream` has `.result` (the GenerationResult) once done and
        `close()` (or a `with` block) to end the call early."""
        return streaming.start(self, prompts, messages, kwargs)

    @_one_call_at_a_time
    def warm_up(self, plan) -> dict:
        """Run the target's side of a throwaway first round of `plan` (a
        `ssd_jax.runtime.warmup.CallPlan`) as the device loop runs it: its prefill and the
        commit of its token, then a verify of a speculation of K zeros and its commit. The call
        of that plan then finds the target's programs compiled or loaded; the draft's side is
        `RemoteDraft.warm` (`DraftWorker.warm_up` in process). Returns {"seconds": its wall
        time, "compile_s": the part spent compiling or loading, "programs": {name: {"source",
        "seconds", "count"}}}, as `RemoteDraft.warmed` accounts for the draft's."""
        t0, timer = time.perf_counter(), CompileTimer()
        with timer.measure():
            self._warm_up(plan)
        return dict(seconds=time.perf_counter() - t0, compile_s=timer.seconds,
                    programs={name: dict(source=p["source"], seconds=p["seconds"], count=p["count"])
                              for name, p in timer.programs.items()})

    def _warm_up(self, plan) -> None:
        batch = Batch(plan.prompts(), plan.max_new_tokens, plan.eos_ids, ())
        DeviceLoop(self, batch, plan.call, Metrics(mode=plan.mode), k=plan.call.k,
                   timer=CompileTimer()).warm_round(plan.cache_len, ssd=plan.mode == "ssd")

    @_one_call_at_a_time
    def restart_draft(self) -> float:
        """Bring the draft back after a failure (`ssd_jax.runtime.fallback.restart`); returns the
        seconds it took. The next SD / SSD call uses it."""
        return restart(self)

    def plan_fanout(self, k: int, batch: int = 1) -> tuple[int, ...]:
        """The fan-out `policy.plan_from_sd` picks for SSD at lookahead k from this engine's last
        `ar` run (T_1) and `sd` run (T_v, draft time, accept histogram)."""
        if self._t1 is None or self._sd is None:
            raise ValueError("fanout='plan' needs this engine's measurements: run generate(..., "
                             "mode='ar') and generate(..., mode='sd', timeline=True) first (an "
                             "untimed call does not time a round's phases), or give F_0..F_K")
        sd = self._sd
        if sum(sd["accept_hist"]) == 0:
            raise ValueError("fanout='plan': the last SD run completed no timed round")
        return plan_from_sd(self._t1, sd["tv"], sd["draft_s"], sd["accept_hist"], ks=(k,),
                            batch=batch, vocab=self.vocab_size,
                            width_slope=self.draft_width_slope()).fanout

    def draft_width_slope(self) -> float | None:
        """The extra cost per row of this engine's draft forward relative to one row (what a tree
        branch adds to a tree step), timed once on the draft's devices; None for a remote draft
        or a proposer (the planner then reads a slope off the target's verify)."""
        if self._width_slope is None and isinstance(self.worker, DraftWorker):
            self._width_slope = width_slope_from_times(self.worker.width_times())
        return self._width_slope

