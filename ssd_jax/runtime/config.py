"""What a generate call asks for, checked before any work: the SSD knobs (`SSDConfig`), the mode,
K and sampling (`check_request`), and whether a draft fits a target (`check_pair`). Plain values
in, a ValueError that names the problem out, so the CLI can check a command before it loads a
model."""
from __future__ import annotations

import dataclasses

from ssd_jax.algorithm import fanout as fo
from ssd_jax.algorithm.sampling import SamplingParams

MODES = ("ar", "sd", "ssd")
BACKUPS = ("neural", "random", "ngram", "auto")


@dataclasses.dataclass(frozen=True)
class SSDConfig:
    """SSD knobs. fanout: F_0..F_K after a hit (None: one candidate per position; "plan": the
    fan-out `ssd_jax.algorithm.policy.plan_from_sd` picks at this K from the times and acceptance this engine
    measured in its last `ar` and `sd` runs, resolved when generate starts and reported in
    `metrics.fanout`); fanout_backup: after a backup round (None: same as fanout; same sum)."""
    fanout: tuple[int, ...] | str | None = None
    fanout_backup: tuple[int, ...] | None = None
    saguaro_c: float = 1.0
    backup: str = "neural"  # neural | random | ngram | auto (ssd_jax.algorithm.policy.BackupChooser)
    row_dtype: str = "float32"
    cache_budget_bytes: int | None = None

    def lists(self, k: int, vocab: int | None = None) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(F after a hit, F after a backup) for lookahead k, each K+1 entries with equal sums
        and, given the vocabulary size, within `fanout.caps` (V - 1 candidates at j < K, V at K);
        or a ValueError naming the bad knob (fan-out lists, saguaro_c, backup)."""
        if isinstance(self.fanout, str):
            raise ValueError(f"fanout {self.fanout!r}: give F_0..F_K, None, or 'plan' (which the "
                             f"engine resolves from its measurements)")
        hit = tuple(self.fanout) if self.fanout is not None else fo.uniform(k, 1)
        backup = tuple(self.fanout_backup) if self.fanout_backup is not None else hit
        if len(hit) != k + 1 or len(backup) != k + 1:
            raise ValueError(f"fan-out lists need K+1 = {k + 1} entries: got {hit} and {backup}")
        if sum(hit) != sum(backup) or sum(hit) < 1 or min(hit + backup) < 0:
            raise ValueError(f"fan-out lists must be >= 0 with equal positive sums (static MQ): "
                             f"{hit} vs {backup}")
        if vocab is not None:
            cap = fo.caps(k, int(vocab))
            for f in (hit, backup):
                if any(x > c for x, c in zip(f, cap)):
                    raise ValueError(f"fan-out {f} asks for more candidates than a vocabulary of "
                                     f"{vocab} has: at most {cap} (the drafted token is masked "
                                     f"out at j < K)")
        if not 0.0 < self.saguaro_c <= 1.0:
            raise ValueError(f"saguaro_c must be in (0, 1], got {self.saguaro_c}")
        if self.backup not in BACKUPS:
            raise ValueError(f"unknown backup {self.backup!r}: use neural, random, ngram or auto")
        return hit, backup


def check_request(mode: str, max_new_tokens: int, k: int, sampling=SamplingParams(),
                  draft_sampling=None, ssd: SSDConfig | None = None,
                  vocab: int | None = None) -> None:
    """A ValueError naming the first bad argument of a generate call (mode, max_new_tokens, K,
    the sampling parameters, and for SSD the fan-out lists, Saguaro C and backup); None if all
    are good. Needs no model (`vocab`, the vocabulary size, only adds the fan-out caps):
    `Engine.generate` and the CLI call it before any work."""
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}: use one of {', '.join(MODES)}")
    if isinstance(max_new_tokens, bool) or int(max_new_tokens) != max_new_tokens or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    if mode != "ar" and (isinstance(k, bool) or int(k) != k or k < 1):
        raise ValueError(f"lookahead K must be an int >= 1, got {k!r}")
    for name, s in (("sampling", sampling), ("draft_sampling", draft_sampling)):
        if s is not None and not isinstance(s, SamplingParams):
            raise ValueError(f"{name} must be a ssd_jax.SamplingParams, got {type(s).__name__}")
    if mode == "ssd" and ssd is not None:
        if not isinstance(ssd, SSDConfig):
            raise ValueError(f"ssd must be a ssd_jax.SSDConfig, got {type(ssd).__name__}")
        # "plan" is resolved from the engine's own measurements: check the rest of the knobs
        plan = ssd.fanout == "plan"
        (dataclasses.replace(ssd, fanout=None, fanout_backup=None) if plan else ssd).lists(
            int(k), vocab)


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
