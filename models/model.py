"""A loaded model: what the engine needs of a target or a draft."""
from __future__ import annotations

import dataclasses
from typing import Any

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.params import Params


@dataclasses.dataclass
class Model:
    """A target or draft as the engine takes it: its config, weights, tokenizer (None for
    token-id-only use) and a display name."""

    cfg: ModelConfig
    params: Params
    tokenizer: Any = None  # ssd_jax.models.tokenizer.Tokenizer, or None for token-id-only use
    name: str = ""
