"""A loaded model: what the engine needs of a target or a draft."""
from __future__ import annotations

import dataclasses
from typing import Any

from models.config import ModelConfig
from models.params import Params


@dataclasses.dataclass
class Model:
    cfg: ModelConfig
    params: Params
    tokenizer: Any = None  # models.tokenizer.Tokenizer, or None for token-id-only use
    name: str = ""
