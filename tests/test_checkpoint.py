"""The orbax conversion cache (models/checkpoint.py): a round trip, and a checkpoint saved by
another version of ModelConfig is not loaded (the caller converts again)."""
import json

import jax
import numpy as np

from ssd_jax.models import checkpoint
from ssd_jax.models.config import tiny_config
from ssd_jax.models.params import random_params


def test_round_trip_and_a_stale_config_is_not_loaded(tmp_path):
    cfg = tiny_config("llama")
    params = random_params(cfg, 0)
    path = tmp_path / "ckpt"
    checkpoint.save(path, params, cfg)
    got, got_cfg = checkpoint.restore(path)
    assert got_cfg == cfg
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    raw = json.loads((path / "config.json").read_text())
    raw["cpu_kernels"] = True  # a field an older ModelConfig had
    (path / "config.json").write_text(json.dumps(raw))
    assert checkpoint.restore(path) is None
    del raw["cpu_kernels"], raw["dtype"]
    (path / "config.json").write_text(json.dumps(raw))
    assert checkpoint.restore(path) is None
