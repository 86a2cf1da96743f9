"""A loaded model: what the engine needs of a target or a draft."""
from __future__ import annotations

import dataclasses
from typing import Any

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import Params


@dataclasses.dataclass
class Model:
    """A target or draft as the engine takes it: its static description `cfg`, its params pytree,
    tokenizer (None for token-id-only use) and a display name.

    cfg is the built-in transformer's `ModelConfig` (params: `Params`), or any model description
    of `ssd_jax.models.protocol` (params: any pytree), as `ssd_jax.models.adapters.from_nnx` /
    `from_functions` make. A ModelConfig with other params is a TypeError here, at once."""

    cfg: ModelConfig | Any
    params: Params | Any
    tokenizer: Any = None  # ssd_jax.models.tokenizer.Tokenizer, or None for token-id-only use
    name: str = ""

    def __post_init__(self):
        if isinstance(self.cfg, ModelConfig) and not isinstance(self.params, Params):
            raise TypeError(
                f"Model(cfg, params): a ModelConfig (the built-in transformer) takes "
                f"ssd_jax.models.params.Params (random_params, params_from_hf, load_model), got "
                f"{type(self.params).__name__}; for a model of your own over a pytree use "
                f"ssd_jax.models.adapters.from_functions or from_nnx (ssd_jax.models.protocol)")

    def logical_params(self):
        """The params with every backend layout turned back into its logical value (a weight the
        cpu backend packed into bf16 strips or int8 tiles when an `Engine` took this Model over
        becomes its array / `Int8Weight` again): what `ssd_jax.forward` with the default XLA ops
        and `jax.grad` take. Laid-out weights come back as new arrays (the engine keeps its own);
        the rest are the params' own leaves. A tensor-parallel layout stays: `forward` reads it
        with `self.cfg`."""
        from ssd_jax.models.ops import identity
        return identity(self.params)
