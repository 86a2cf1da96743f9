"""What a generate call does when its draft fails: finish on the target alone, or raise.

The engine makes every draft call through `Guarded`, which waits for the call's device arrays (so
an error on the draft's device surfaces here, not inside the target's next step) and turns any
exception — a dead, hung or misbehaving draft process (`ssd_jax.runtime.wire.TransportError`), an
error in an in-process draft's computation (out of memory on its device, a failing kernel) — into
`DraftDown`. The engine then commits what the target has already computed and `fall_back` decides:
by default the call goes on with plain decoding from the committed tokens (exact: every token is
still drawn from the target's distribution with the same position keys), records the failure in
`Metrics.fallback` and warns once (`DraftFallbackWarning`); with `Engine(strict=True)` it raises
`DraftFailure` with the tokens so far. Nothing here imports JAX at module level.
"""
from __future__ import annotations

import warnings


class DraftFailure(RuntimeError):
    """The draft failed during a generate call of an `Engine(strict=True)`.

    draft: the draft's name; during: the draft call that failed ("start", "propose", "first"
    (SSD's round 1), "dispatch_tree", "tree_ready" (a timed round), "resolve", "finish");
    cause: the error's text; result: the `GenerationResult` of the tokens committed before the failure
    (token_ids: the same, per prompt). The original exception is `__cause__`."""

    def __init__(self, message: str, *, draft: str, during: str, cause: str, result=None):
        super().__init__(message)
        self.draft, self.during, self.cause, self.result = draft, during, cause, result
        self.token_ids = result.token_ids if result is not None else None


class DraftFallbackWarning(UserWarning):
    """A generate call finished on the target alone because its draft failed (one per call)."""


class DraftDown(Exception):
    """Internal: a draft call failed (`during` names it); the engine falls back or raises."""

    def __init__(self, during: str, error: BaseException):
        super().__init__(f"{during}: {type(error).__name__}: {error}")
        self.during, self.error = during, error


# Calls whose failure waits for the draft's next call: the engine has target work in flight or to
# commit when it makes them (the prefill's first tokens, the round's verify).
_DEFERRED = ("start", "dispatch_tree")
# the name a failure gives its call (`DraftFailure.during`): the device loop's forms of a call
# under the call's name
_DURING = {"propose_from": "propose", "resolve_on_device": "resolve"}


class Guarded:
    """The engine's view of its draft worker for one call: the same methods, each returning its
    value once computed (device arrays waited for), or raising DraftDown. A failure of `start` or
    `dispatch_tree` (async: they return nothing) is raised by the next call instead.
    wait=False (the device loop): calls return their arrays still in flight; only what raises
    at dispatch becomes DraftDown here, and the loop's read of the round's last draft array
    catches the rest (`DeviceLoop.read_draft`)."""

    def __init__(self, worker, wait: bool = True):
        self.worker = worker
        self.wait = wait
        self.failed: DraftDown | None = None

    def __getattr__(self, name):
        fn = getattr(self.worker, name)
        if not callable(fn):
            return fn

        def call(*args, **kwargs):
            if self.failed is not None:
                raise self.failed
            try:
                out = fn(*args, **kwargs)
                if out is not None and self.wait:
                    import jax
                    jax.block_until_ready([x for x in jax.tree_util.tree_leaves(out)
                                           if isinstance(x, jax.Array)])
                return out
            except Exception as e:  # noqa: BLE001 - any draft failure is contained
                self.failed = DraftDown(_DURING.get(name, name), e)
                self.failed.__cause__ = e
                if name not in _DEFERRED:
                    raise self.failed from e
        return call


def draft_name(engine) -> str:
    """How errors name the engine's draft: the remote process's model, the Model's name, or its
    class."""
    w = engine.worker
    name = getattr(w, "name", None) if getattr(w, "remote", False) else None
    if not name:
        name = getattr(engine.draft, "name", "") or type(engine.draft).__name__
    return str(name)


def fall_back(engine, down: DraftDown, batch, metrics, strict: bool) -> None:
    """Record the failure in `metrics.fallback`; raise DraftFailure if `strict`, else warn once
    (the caller then finishes the call with plain decoding)."""
    name = draft_name(engine)
    tokens = metrics.new_tokens = sum(len(g) for g in batch.generated)
    metrics.fallback = dict(draft=name, during=down.during,
                            error=f"{type(down.error).__name__}: {down.error}",
                            round=metrics.rounds, tokens_before=tokens,
                            committed=[len(g) for g in batch.generated[:batch.rows]])
    hint = ("engine.restart_draft() starts it again" if getattr(engine.worker, "remote", False)
            and getattr(engine.worker, "down", None) else "the next call tries the draft again")
    if strict:
        raise DraftFailure(f"the draft {name!r} failed during {down.during!r} after {tokens} "
                           f"tokens: {down.error} (the tokens so far are on .result; {hint})",
                           draft=name, during=down.during, cause=str(down.error),
                           result=batch.result(metrics)) from down.error
    warnings.warn(DraftFallbackWarning(
        f"ssd_jax: the draft {name!r} failed during {down.during!r} ({down.error}); this call "
        f"finishes with plain decoding on the target from its {tokens} committed tokens "
        f"(metrics.fallback; {hint}; Engine(strict=True) raises instead)"), stacklevel=3)


def restart(engine) -> float:
    """Start the engine's draft again; the seconds it took. A draft process: `RemoteDraft.restart`
    (spawned anew, or a joining one waited for). An in-process draft: placed afresh on its mesh
    (e.g. after running out of memory there). A proposer: nothing to do."""
    import time

    from ssd_jax.runtime.draft_worker import DraftWorker

    t0 = time.perf_counter()
    if getattr(engine.worker, "remote", False):
        engine.worker.restart()
    elif isinstance(engine.worker, DraftWorker):
        engine.worker = DraftWorker(engine.draft, engine.placement.draft,
                                    engine.target.cfg.vocab_size, engine._backend)
    return time.perf_counter() - t0
