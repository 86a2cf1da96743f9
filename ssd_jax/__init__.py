"""ssd_jax: speculative speculative decoding (SSD, the Saguaro algorithm) in JAX.

The public API, importable from the package itself::

    import ssd_jax
    engine = ssd_jax.Engine(ssd_jax.load_model("qwen2.5-coder-1.5b"),
                            ssd_jax.load_model("qwen2.5-coder-0.5b"))
    out = engine.generate(["def fib(n):"], mode="ssd", max_new_tokens=64)

The package is laid out in rooms whose imports run one way (docs/ARCHITECTURE.md):
`ssd_jax.models` (what a transformer is) and `ssd_jax.pallas_kernels` (GPU kernels) at the
bottom, `ssd_jax.algorithm` (pure functions of the algorithm) above them, `ssd_jax.runtime`
(engine, meshes, processes) above that, `ssd_jax.tools` (CLI, bench) and `ssd_jax.testing` (the
exactness harness) on top. Names are resolved lazily, so `import ssd_jax` stays cheap.
"""
from __future__ import annotations

import importlib

__version__ = "0.2.0"

# public name -> module that defines it
_EXPORTS = {
    # running it
    "Engine": "ssd_jax.runtime.engine",
    "SSDConfig": "ssd_jax.runtime.config",
    "GenerationResult": "ssd_jax.runtime.batch",
    "StreamDelta": "ssd_jax.runtime.stream",
    "TextStream": "ssd_jax.runtime.stream",
    "Metrics": "ssd_jax.runtime.metrics",
    "Proposer": "ssd_jax.runtime.proposer",
    "PromptLookupProposer": "ssd_jax.runtime.proposer",
    "start_two_process": "ssd_jax.runtime.transport",
    "DraftFailure": "ssd_jax.runtime.fallback",
    "DraftFallbackWarning": "ssd_jax.runtime.fallback",
    "MappingLimitWarning": "ssd_jax.runtime.mappings",
    "TransportError": "ssd_jax.runtime.wire",
    # models
    "load_model": "ssd_jax.models.load",
    "load_draft": "ssd_jax.models.load",
    "Model": "ssd_jax.models.model",
    "ModelConfig": "ssd_jax.models.config",
    "Params": "ssd_jax.models.params",
    "KVCache": "ssd_jax.models.kv_cache",
    "init_cache": "ssd_jax.models.kv_cache",
    "forward": "ssd_jax.models.transformer",
    "tree_step": "ssd_jax.models.transformer",
    "quantize_model": "ssd_jax.models.quant",
    # a model of one's own (models/protocol.py): a Flax NNX module, or functions over a pytree
    "from_nnx": "ssd_jax.models.adapters",
    "from_functions": "ssd_jax.models.adapters",
    # backends: the op tables the forward runs on
    "Ops": "ssd_jax.models.ops",
    "select_backend": ("ssd_jax.models.backends", "select"),
    # the algorithm's pure functions
    "SamplingParams": "ssd_jax.algorithm.sampling",
    "rejection_sample": "ssd_jax.algorithm.verify",
    "VerifyResult": "ssd_jax.algorithm.verify",
    "draft_tree": "ssd_jax.algorithm.tree",
    "SpeculationCache": "ssd_jax.algorithm.speculation_cache",
    "lookup": "ssd_jax.algorithm.speculation_cache",
    "saguaro_propose": ("ssd_jax.algorithm.saguaro", "propose"),
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str):
    try:
        where = _EXPORTS[name]
    except KeyError:
        raise AttributeError(f"module 'ssd_jax' has no attribute {name!r}") from None
    module, attr = where if isinstance(where, tuple) else (where, name)
    value = getattr(importlib.import_module(module), attr)
    globals()[name] = value  # resolved once
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
