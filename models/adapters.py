"""Bring your own model: a Flax NNX module or plain functions over a params pytree, as a `Model`.

    from ssd_jax.models.adapters import from_functions, from_nnx
    target = from_nnx(MyLM(rngs=nnx.Rngs(0)))                 # nnx.split: graphdef + state
    draft = from_functions(params, forward=f, init_cache=c, vocab_size=V)
    engine = ssd_jax.Engine(target, draft)                     # ar | sd | ssd, exact

What the model must provide is `ssd_jax.models.protocol` (init_cache, a causal forward that
writes the cache, vocab_size; optionally SSD's branch step). The static part of each adapter is
hashable (functions by identity, an NNX graphdef by structure), so the engine's jitted steps
compile once per shape for it, as for the built-in transformer; the params pytree is traced.
`as_model` is the engine's check: anything else gets one TypeError naming what is missing.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

from ssd_jax.models.model import Model
from ssd_jax.models.protocol import DEFAULT_MAX_POSITIONS, is_builtin, missing_members

NNX_MEMBERS = ("vocab_size", "init_cache", "__call__")


@dataclasses.dataclass(frozen=True)
class FunctionModel:
    """The static description of a model given as plain functions (`from_functions`).

    forward(params, tokens [B, T], cache) -> (logits [B, T, V], cache); init_cache(batch,
    max_len) -> cache (leaves [B, ...], lengths [B] = 0); optional tree_step / init_branch with
    the signatures of `ssd_jax.models.protocol`. Hashable: keep the same function objects
    across calls (a new lambda is a new model, so a new compile)."""
    forward: Callable
    init_cache: Callable
    vocab_size: int
    tree_step: Callable | None = None
    init_branch: Callable | None = None
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    name: str = ""


@dataclasses.dataclass(frozen=True)
class NNXModel:
    """The static description of a Flax NNX module (`from_nnx`): its graphdef (hashable, equal
    for equal structure and static attributes); the state is the params pytree, merged back
    inside each jitted step. `module` (the live object, not compared) serves `init_cache` and
    `init_branch`, which build zero pytrees from static attributes."""
    graphdef: Any
    vocab_size: int
    has_tree_step: bool = False
    max_position_embeddings: int = DEFAULT_MAX_POSITIONS
    module: Any = dataclasses.field(default=None, compare=False, hash=False, repr=False)

    def forward(self, params, tokens, cache):
        """module(tokens [B, T], cache) -> (logits [B, T, V], cache), the module rebuilt from
        the params (its nnx.State)."""
        from flax import nnx
        return nnx.merge(self.graphdef, params)(tokens, cache)

    def init_cache(self, batch: int, max_len: int):
        """The module's `init_cache(batch, max_len)`."""
        return self.module.init_cache(batch, max_len)

    @property
    def tree_step(self):
        """The module's `tree_step` as a function over params, or None (the engine then
        branches with `protocol.branch_from_forward`)."""
        return self._tree_step if self.has_tree_step else None

    def _tree_step(self, params, *args):
        from flax import nnx
        return nnx.merge(self.graphdef, params).tree_step(*args)

    def init_branch(self, batch: int, branches: int, depth: int):
        """The module's `init_branch(batch, branches, depth)`."""
        return self.module.init_branch(batch, branches, depth)


def from_functions(params, *, forward: Callable, init_cache: Callable, vocab_size: int,
                   tree_step: Callable | None = None, init_branch: Callable | None = None,
                   tokenizer=None, name: str = "",
                   max_position_embeddings: int = DEFAULT_MAX_POSITIONS) -> Model:
    """A `Model` of plain functions over a params pytree (signatures: `FunctionModel`,
    `ssd_jax.models.protocol`). Raises TypeError naming what is missing or wrong."""
    cfg = FunctionModel(forward, init_cache, int(vocab_size), tree_step, init_branch,
                        int(max_position_embeddings), name)
    bad = [n for n in ("forward", "init_cache") if not callable(getattr(cfg, n))]
    bad += [n for n in ("tree_step", "init_branch") if getattr(cfg, n) is not None
            and not callable(getattr(cfg, n))]
    if bad:
        raise TypeError(f"from_functions: {', '.join(bad)} must be functions "
                        "(signatures: ssd_jax.models.protocol)")
    return Model(cfg, params, tokenizer, name)


def from_nnx(module, *, tokenizer=None, name: str = "",
             max_position_embeddings: int | None = None) -> Model:
    """A `Model` of a Flax NNX module that follows the protocol: `vocab_size` (int),
    `init_cache(batch, max_len)`, `__call__(tokens [B, T], cache) -> (logits [B, T, V], cache)`,
    optionally `tree_step(tokens, positions, cache, prefix_len, branch, step, valid)` with
    `init_branch(batch, branches, depth)` (`ssd_jax.models.protocol`). Its nnx.State becomes the
    params pytree (`nnx.split`). Raises TypeError naming the members it lacks."""
    from flax import nnx
    if not isinstance(module, nnx.Module):
        raise TypeError(f"from_nnx takes a flax.nnx.Module, got {type(module).__name__}")
    missing = [m for m in NNX_MEMBERS if not hasattr(module, m)]
    if hasattr(module, "tree_step") and not hasattr(module, "init_branch"):
        missing.append("init_branch (tree_step needs it)")
    if missing:
        raise TypeError(f"the NNX module {type(module).__name__} does not follow the model "
                        f"protocol (ssd_jax.models.protocol): missing {', '.join(missing)}")
    graphdef, state = nnx.split(module)
    mp = max_position_embeddings or getattr(module, "max_position_embeddings",
                                            DEFAULT_MAX_POSITIONS)
    cfg = NNXModel(graphdef, int(module.vocab_size), hasattr(module, "tree_step"), int(mp), module)
    return Model(cfg, state, tokenizer, name or type(module).__name__)


def as_model(obj, role: str = "target") -> Model:
    """`obj` as the engine's `Model`: a Model as it is (its cfg checked), an NNX module through
    `from_nnx`; anything else is one TypeError saying what a model must provide and what `obj`
    lacks. role: "target" or "draft", for the message."""
    if isinstance(obj, Model):
        missing = missing_members(obj.cfg)
        if missing:
            raise TypeError(f"the {role}'s cfg ({type(obj.cfg).__name__}) is neither a ModelConfig "
                            f"nor a model description (ssd_jax.models.protocol): missing "
                            f"{', '.join(missing)}")
        return obj
    try:
        from flax import nnx
        if isinstance(obj, nnx.Module):
            return from_nnx(obj)
    except ImportError:  # pragma: no cover - flax is a dependency
        pass
    kind = "a function" if callable(obj) and not isinstance(obj, type) else type(obj).__name__
    lacks = [m for m in ("cfg", "params") if not hasattr(obj, m)]
    raise TypeError(
        f"the {role} is {kind}, not a model: missing {', '.join(lacks) or 'a protocol cfg'}. "
        "Give ssd_jax.Model(cfg, params, tokenizer) (the built-in transformer: a ModelConfig and "
        "its Params), from_nnx(module) for a flax.nnx.Module with vocab_size, init_cache(batch, "
        "max_len) and __call__(tokens, cache) -> (logits, cache), or from_functions(params, "
        "forward=..., init_cache=..., vocab_size=...) for functions over a params pytree "
        "(ssd_jax.models.adapters; the protocol: ssd_jax.models.protocol)")


__all__ = ["FunctionModel", "NNXModel", "as_model", "from_functions", "from_nnx", "is_builtin"]
