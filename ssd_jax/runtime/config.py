"""What a generate call asks for, checked before any work: the SSD knobs (`SSDConfig`), the mode,
K and sampling (`check_request`), and whether a draft fits a target (`check_pair`). Plain values
in, a ValueError that names the problem out, so the CLI can check a command before it loads a
model."""
from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from ssd_jax.algorithm import backups as _backups, fanout as fo
from ssd_jax.algorithm.sampling import SamplingParams

MODES = ("ar", "sd", "ssd")
BACKUPS = (*_backups.BACKUPS, "auto")  # SSDConfig.backup: a speculator, or one chosen per round
ROW_DTYPES = ("float32", "bfloat16", "float16")  # what the proposal rows may be stored in
_INT32 = (-(2 ** 31), 2 ** 31 - 1)
# Bounds on what one call may ask for, so every accepted call compiles in bounded time and memory
# (README, "Reliability"). MAX_K: the draft chain and the engine's tree are unrolled over K, so
# their compile grows with K; at K = 8 the K-dependent steps (chain + tree + verify) compile in
# 1.97x K = 4's CPU time at the default pair's shapes, at K = 12 in 2.2x on tiny ones
# (benchmarks/compile_vs_k.py, benchmarks/README.md "Compile time against K").
# MAX_FANOUT_WIDTH: tree branches per row (sum of F_0..F_K), the speculation cache's MQ.
# MAX_NEW_TOKENS / MAX_LEN: the cache length is a compiled shape and a buffer of B * max_len
# slots per layer; 2^17 is past every supported model's context.
MAX_K = 8
MAX_FANOUT_WIDTH = 64
MAX_LEN = 2 ** 17
MAX_NEW_TOKENS = MAX_LEN


def plain_ints(values) -> bool:
    """Whether every entry of `values` (an iterable) is a Python int: `type(x) is int`, so no bool
    (its own type) and no numpy scalar (those take `int_ids`' one-by-one checks); at C speed."""
    return set(map(type, values)) <= {int}


def _is_int(x) -> bool:
    return isinstance(x, (int, np.integer)) and not isinstance(x, bool)


def int_ids(values, name: str) -> list[int]:
    """`values` (a sequence of Python ints, or a 1-D integer numpy / jax array) as a list of ints;
    a TypeError naming `name` (e.g. "prompts[2]") and the position of the first float, bool,
    string or other non-integer, before any work. 3.0 is refused too: an id is never rounded."""
    if type(values) is range:
        return list(values)
    if type(values) is list and plain_ints(values):  # the common case
        return list(values)
    if hasattr(values, "dtype") and hasattr(values, "shape"):  # numpy / jax array
        a = np.asarray(values)
        if a.dtype == np.bool_ or not np.issubdtype(a.dtype, np.integer) or a.ndim != 1:
            raise TypeError(f"{name} must be integer ids: a list of ints or a 1-D integer array, "
                            f"got an array of {a.dtype} with shape {a.shape}")
        return [int(x) for x in a]
    if isinstance(values, (str, bytes)) or not hasattr(values, "__iter__"):
        raise TypeError(f"{name} must be a list of int ids, got {type(values).__name__} "
                        f"{values!r:.40}")
    out = []
    for j, x in enumerate(values):
        if hasattr(x, "dtype") and np.ndim(x) == 0 and not isinstance(x, np.generic):
            x = np.asarray(x)[()]  # a 0-d numpy / jax array: its scalar
        if not _is_int(x):
            raise TypeError(f"{name}[{j}] is {x!r:.40} ({type(x).__name__}): ids must be Python "
                            f"ints or integer numpy / jax arrays (no floats, bools or strings)")
        out.append(int(x))
    return out


def _is_real(x) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


@dataclasses.dataclass(frozen=True)
class SSDConfig:
    """SSD knobs. fanout: F_0..F_K after a hit (None: one candidate per position; "plan": the
    fan-out `ssd_jax.algorithm.policy.plan_from_sd` picks at this K from the times and acceptance this engine
    measured in its last `ar` and `sd` runs, resolved when generate starts and reported in
    `metrics.fanout`); fanout_backup: after a backup round (None: same as fanout, except with
    backup="random": every branch at j = 0, where a round of random tokens ends; same sum)."""
    fanout: tuple[int, ...] | str | None = None
    fanout_backup: tuple[int, ...] | None = None
    saguaro_c: float = 1.0
    backup: str = "neural"  # neural | random | ngram | auto (ssd_jax.algorithm.policy.BackupChooser)
    row_dtype: str = "float32"
    cache_budget_bytes: int | None = None

    def lists(self, k: int, vocab: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(F after a hit, F after a backup) for lookahead k, each K+1 entries with equal sums
        and, given the vocabulary size, within `fanout.caps` (V - 1 candidates at j < K, V at K);
        or a ValueError naming the bad knob (fan-out lists, saguaro_c, backup, row_dtype,
        cache_budget_bytes)."""
        if isinstance(self.fanout, str):
            raise ValueError(f"fanout {self.fanout!r}: give F_0..F_K, None, or 'plan' (which the "
                             f"engine resolves from its measurements)")
        for name, f in (("fanout", self.fanout), ("fanout_backup", self.fanout_backup)):
            if f is not None and (isinstance(f, (str, bytes)) or not hasattr(f, "__iter__")
                                  or not all(_is_int(x) for x in f)):
                raise ValueError(f"{name} must be a sequence of ints F_0..F_K, got {f!r}")
        hit = tuple(int(x) for x in self.fanout) if self.fanout is not None else fo.uniform(k, 1)
        backup = tuple(int(x) for x in self.fanout_backup) if self.fanout_backup is not None else hit
        if self.fanout_backup is None and self.backup == "random" and len(hit) == k + 1 \
                and sum(hit) >= 1 and min(hit) >= 0:
            # Random tokens are (almost) never accepted: the outcome after a random backup round is
            # j = 0, so its fork puts every branch there. With the hit list instead, a list with
            # F_0 = 0 (the CLI's default) would miss after every random round, never to hit again.
            backup = fo.allocate(k, sum(hit), 0.0, vocab=vocab)
        if len(hit) != k + 1 or len(backup) != k + 1:
            raise ValueError(f"fan-out lists need K+1 = {k + 1} entries: got {hit} and {backup}")
        if sum(hit) != sum(backup) or sum(hit) < 1 or min(hit + backup) < 0:
            raise ValueError(f"fan-out lists must be >= 0 with equal positive sums (static MQ): "
                             f"{hit} vs {backup}")
        if sum(hit) > MAX_FANOUT_WIDTH:
            raise ValueError(f"fan-out {hit} has {sum(hit)} tree branches per row, past the "
                             f"bound MAX_FANOUT_WIDTH={MAX_FANOUT_WIDTH} (ssd_jax.runtime.config)")
        if vocab is not None:
            cap = fo.caps(k, int(vocab))
            for f in (hit, backup):
                if any(x > c for x, c in zip(f, cap)):
                    raise ValueError(f"fan-out {f} asks for more candidates than a vocabulary of "
                                     f"{vocab} has: at most {cap} (the drafted token is masked "
                                     f"out at j < K)")
        if not _is_real(self.saguaro_c) or not 0.0 < self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in (0, 1], got {self.saguaro_c!r}")
        if not isinstance(self.backup, str) or self.backup not in BACKUPS:
            raise ValueError(f"unknown backup {self.backup!r}: use neural, random, ngram or auto")
        try:
            row = np.dtype(self.row_dtype).name
        except TypeError:
            row = None
        if row not in ROW_DTYPES:
            raise ValueError(f"row_dtype {self.row_dtype!r}: use one of {', '.join(ROW_DTYPES)}")
        b = self.cache_budget_bytes
        if b is not None and (not _is_int(b) or b < 1):
            raise ValueError(f"cache_budget_bytes must be None or an int >= 1, got {b!r}")
        return hit, backup


@dataclasses.dataclass(frozen=True)
class CallConfig:
    """One generate call's settings once checked and resolved (`call_config`): the one value the
    target's loop, the draft and the wire read them from, host values only (each side places its
    own copy of the traced ones on its mesh, once a call).

    Static (a new value compiles anew): k, the fan-out lists, backup, row_dtype, whether a
    sampling is greedy. Traced (a new value reuses the compiled steps): seed, request ids, the
    sampling values `[B]`, saguaro_c. The draft's part crosses to a draft process as
    `draft_fields()` (`of_draft_fields` there)."""
    k: int
    seed: int
    request_ids: tuple[int, ...]  # [B]: the rows' PRNG keys (`ssd_jax.algorithm.sampling`)
    draft_sampling: SamplingParams  # [B] numpy values: what the draft proposes from
    target_sampling: SamplingParams | None = None  # [B] numpy values; None in a draft process
    fanout_hit: tuple[int, ...] = ()  # SSD: F_0..F_K after a hit, and after a backup round
    fanout_backup: tuple[int, ...] = ()
    saguaro_c: float = 1.0
    # SSD: the speculation for a row that missed (BACKUPS); "auto": neural or random, as the
    # target's `BackupChooser` picks each round (round 1's is neural)
    backup: str = "neural"
    row_dtype: str = "float32"  # the proposal rows' dtype
    verifier: Callable | None = None  # the target's; None: `ssd_jax.rejection_sample`

    def draft_fields(self) -> dict:
        """The draft's part for the wire: JSON scalars and lists (its sampling values one per
        request)."""
        sp = SamplingParams.per_request(self.draft_sampling, len(self.request_ids))
        return dict(seed=int(self.seed), request_ids=[int(r) for r in self.request_ids],
                    temperature=[float(x) for x in sp.temperature],
                    top_k=[int(x) for x in sp.top_k], top_p=[float(x) for x in sp.top_p],
                    k=int(self.k), fanout_hit=[int(f) for f in self.fanout_hit],
                    fanout_backup=[int(f) for f in self.fanout_backup],
                    saguaro_c=float(self.saguaro_c), backup=str(self.backup),
                    row_dtype=str(self.row_dtype))

    @classmethod
    def of_draft_fields(cls, f: dict, batch: int) -> "CallConfig":
        """The draft's `CallConfig` of `draft_fields()` as a draft process received them for a
        batch of `batch` rows; a ValueError for a value the draft cannot serve."""
        if len(f["request_ids"]) != batch:
            raise ValueError(f"{len(f['request_ids'])} request ids for a batch of {batch}")
        if not 1 <= f["k"] <= MAX_K:
            raise ValueError(f"K = {f['k']} outside [1, {MAX_K}]")
        if f["backup"] not in BACKUPS or f["row_dtype"] not in ROW_DTYPES:
            raise ValueError(f"backup {f['backup']!r} / row dtype {f['row_dtype']!r} not served")
        if not len(f["temperature"]) == len(f["top_k"]) == len(f["top_p"]) == batch:
            raise ValueError(f"sampling values for {len(f['temperature'])} / {len(f['top_k'])} / "
                             f"{len(f['top_p'])} requests (temperature / top_k / top_p), a batch "
                             f"of {batch}")
        sampling = SamplingParams(np.asarray(f["temperature"], np.float32),
                                  np.asarray(f["top_k"], np.int32),
                                  np.asarray(f["top_p"], np.float32))
        return cls(k=f["k"], seed=f["seed"], request_ids=tuple(f["request_ids"]),
                   draft_sampling=sampling, fanout_hit=tuple(f["fanout_hit"]),
                   fanout_backup=tuple(f["fanout_backup"]), saguaro_c=f["saguaro_c"],
                   backup=f["backup"], row_dtype=f["row_dtype"])


def call_config(mode: str, k: int, seed: int, request_ids, sampling: SamplingParams,
                draft_sampling: SamplingParams, ssd: SSDConfig | None, vocab: int | None,
                row_vocab: int, verifier: Callable | None = None, rows: int | None = None
                ) -> CallConfig:
    """The `CallConfig` of a call `check_request` passed, its rows padded (`request_ids` `[B]`,
    the samplings `[B]` numpy values): for SSD (`ssd` with its fan-out given, not "plan") the
    fan-out lists (`SSDConfig.lists`) and the speculation cache's rows `[B, MQ, K, V]` (V =
    row_vocab, the target's embedding rows) checked against `ssd.cache_budget_bytes`, a
    ValueError before any work (rows: the requests among the B rows, if fewer: the rest pad the
    batch bucket, which the message says)."""
    from ssd_jax.algorithm.speculation_cache import check_budget

    rids = tuple(int(r) for r in request_ids)
    kw = {}
    if mode == "ssd":
        f_hit, f_backup = ssd.lists(k, vocab)
        try:
            check_budget(len(rids), sum(f_hit), k, row_vocab, ssd.row_dtype,
                         ssd.cache_budget_bytes, draft_greedy=draft_sampling.greedy)
        except ValueError as e:
            if rows is None or rows == len(rids):
                raise
            raise ValueError(f"{e} (the {rows} requests run as {len(rids)} rows, their batch "
                             f"bucket; Engine(batch_buckets=False) runs {rows})") from None
        kw = dict(fanout_hit=f_hit, fanout_backup=f_backup, saguaro_c=float(ssd.saguaro_c),
                  backup=ssd.backup, row_dtype=np.dtype(ssd.row_dtype).name)
    return CallConfig(k=int(k), seed=int(seed), request_ids=rids, draft_sampling=draft_sampling,
                      target_sampling=sampling, verifier=verifier, **kw)


def check_request(mode: str, max_new_tokens: int, k: int, sampling=SamplingParams(),
                  draft_sampling=None, ssd: SSDConfig | None = SSDConfig(),
                  vocab: int | None = None, *, seed=0, stop=(), eos_ids=None,
                  on_tokens: Callable | None = None, verifier: Callable | None = None,
                  chat: bool = False, max_len: int | None = None, request_ids=None) -> None:
    """A ValueError naming the first bad argument of a generate call, or None if all are good:
    mode, max_new_tokens, K (any mode: an int >= 1; plain decoding ignores it but takes none
    below 1 unless it is the engine's 0), the sampling parameters, for SSD the `SSDConfig` (fan-out
    lists, Saguaro C, backup, row dtype, budget), seed (an int32), stop (a list of strings, not
    one string), eos_ids (ints in [0, vocab)), on_tokens / verifier (callables), chat (a bool),
    request_ids (ints in int32: a TypeError names a float, bool or string and its index) and,
    given max_len, whether even a one-token prompt fits it (prompt + max_new_tokens + K + 2).

    Needs no model (`vocab`, the vocabulary size, only adds the fan-out caps and the EOS range):
    `Engine.generate` and the CLI call it before any work."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if max_new_tokens > MAX_NEW_TOKENS:
        raise ValueError(f"max_new_tokens={max_new_tokens} is past the bound "
                         f"MAX_NEW_TOKENS={MAX_NEW_TOKENS} (ssd_jax.runtime.config)")
    if not _is_int(k) or (k < 1 and not (mode == "ar" and k == 0)):
        raise ValueError(f"lookahead K must be an int >= 1, got {k!r}")
    if k > MAX_K:
        raise ValueError(f"lookahead K={k} is past the bound MAX_K={MAX_K}: the draft's steps "
                         f"are unrolled over K and compile in time growing with it "
                         f"(ssd_jax.runtime.config)")
    for name, s in (("sampling", sampling), ("draft_sampling", draft_sampling)):
        each = s if isinstance(s, (list, tuple)) and s else [s]
        for one in each:
            if s is not None and not isinstance(one, SamplingParams):
                raise ValueError(f"{name} must be a ssd_jax.SamplingParams (or one per prompt), "
                                 f"got {type(one).__name__}")
    if sampling is None:
        raise ValueError("sampling must be a ssd_jax.SamplingParams, got None")
    if mode == "ssd":
        if not isinstance(ssd, SSDConfig):
            raise ValueError(f"ssd must be a ssd_jax.SSDConfig, got {type(ssd).__name__}")
        # "plan" is resolved from the engine's own measurements: check the rest of the knobs
        plan = ssd.fanout == "plan"
        (dataclasses.replace(ssd, fanout=None, fanout_backup=None) if plan else ssd).lists(
            int(k), vocab)
    if isinstance(seed, bool) or np.ndim(seed) != 0 or \
            not np.issubdtype(np.asarray(seed).dtype, np.integer) or \
            not _INT32[0] <= int(seed) <= _INT32[1]:
        raise ValueError(f"seed must be an int in [{_INT32[0]}, {_INT32[1]}], got {seed!r}")
    if isinstance(stop, str) or not hasattr(stop, "__iter__") or \
            not all(isinstance(s, str) for s in stop):
        raise ValueError(f"stop must be a list of strings (e.g. stop=[{stop!r}]), got {stop!r}"
                         if isinstance(stop, str) else f"stop must be a list of strings, got {stop!r}")
    if eos_ids is not None:
        if isinstance(eos_ids, (str, bytes)) or not hasattr(eos_ids, "__iter__") or \
                not all(_is_int(t) and t >= 0 and (vocab is None or t < vocab) for t in eos_ids):
            top = f", {vocab})" if vocab is not None else ", V)"
            raise ValueError(f"eos_ids must be token ids in [0{top}, got {eos_ids!r}")
    for name, fn in (("on_tokens", on_tokens), ("verifier", verifier)):
        if fn is not None and not callable(fn):
            raise ValueError(f"{name} must be a function or None, got {type(fn).__name__}")
    if not isinstance(chat, (bool, np.bool_)):
        raise ValueError(f"chat must be True or False, got {chat!r}")
    if request_ids is not None:
        bad = [r for r in int_ids(request_ids, "request_ids") if not _INT32[0] <= r <= _INT32[1]]
        if bad:
            raise ValueError(f"request_ids must fit int32 [{_INT32[0]}, {_INT32[1]}], got {bad[0]}")
    if max_len is not None:
        check_max_len(max_len)
        need = 1 + int(max_new_tokens) + int(k) + 2
        if need > max_len:
            raise ValueError(f"max_new_tokens ({max_new_tokens}) + K ({k}) + 2 + a one-token "
                             f"prompt = {need} exceeds the cache length max_len={max_len}: "
                             f"lower max_new_tokens or raise max_len")


def check_max_len(max_len) -> None:
    """A ValueError unless the cache length `max_len` is an int in [2, MAX_LEN]."""
    if not _is_int(max_len) or not 2 <= max_len <= MAX_LEN:
        raise ValueError(f"max_len must be an int in [2, MAX_LEN={MAX_LEN}] (a prompt token and a "
                         f"new one at least), got {max_len!r}")


def check_pair(target, draft) -> None:
    """A ValueError unless `draft` can propose for `target` (models.Model each): one tokenizer
    (by fingerprint) or none for both, and embedding rows the tokenizer fits."""
    tt, dt = target.tokenizer, draft.tokenizer
    if tt is not None and dt is not None and tt.fingerprint() != dt.fingerprint():
        raise ValueError("draft and target have different tokenizers: speculative decoding needs "
                         "one shared vocabulary")
    if (tt is None) != (dt is None):
        raise ValueError("give both target and draft a tokenizer, or neither")
    if draft.cfg.vocab_size != target.cfg.vocab_size:
        vs = tt.vocab_size if tt is not None else None
        if vs is None or vs > min(draft.cfg.vocab_size, target.cfg.vocab_size):
            raise ValueError(f"draft embedding rows ({draft.cfg.vocab_size}) and target rows "
                             f"({target.cfg.vocab_size}) differ and the tokenizer does not fit both")
