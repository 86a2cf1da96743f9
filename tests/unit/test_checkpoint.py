"""The orbax conversion cache (models/checkpoint.py): a round trip with its manifest, and a
checkpoint saved by another version of ModelConfig is not loaded (the caller converts again).
Corrupt, half-written and full-disk caches: tests/faults/test_faults_io.py."""
import json

import jax
import numpy as np
import pytest

from ssd_jax.models import checkpoint
from ssd_jax.models.config import tiny_config
from ssd_jax.models.params import random_params


def test_round_trip_and_a_stale_config_is_not_loaded(tmp_path):
    cfg = tiny_config("llama")
    params = random_params(cfg, 0)
    path = tmp_path / "ckpt"
    checkpoint.save(path, params, cfg)
    assert checkpoint.problem(path) is None
    manifest = json.loads((path / checkpoint.MANIFEST).read_text())
    assert "config.json" in manifest["files"] and manifest["format"] == checkpoint.FORMAT
    got, got_cfg = checkpoint.restore(path)
    assert got_cfg == cfg
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert list(tmp_path.iterdir()) == [path]  # no temporary left beside it

    def rewrite(raw):  # as an older version would have written it: a valid manifest
        (path / "config.json").write_text(json.dumps(raw))
        checkpoint._write_manifest(path)
        assert checkpoint.problem(path) is None

    raw = json.loads((path / "config.json").read_text())
    rewrite(dict(raw, cpu_kernels=True))  # a field an older ModelConfig had
    with pytest.warns(UserWarning, match="another ModelConfig"):
        assert checkpoint.restore(path) is None
    del raw["dtype"]
    rewrite(raw)
    with pytest.warns(UserWarning, match="another ModelConfig"):
        assert checkpoint.restore(path) is None


@pytest.mark.parametrize("arch, dtype", [("llama", "float32"), ("qwen2", "bfloat16"),
                                         ("qwen3", "float32")])
def test_param_bytes_is_what_a_conversion_writes(arch, dtype):
    cfg = tiny_config(arch, dtype=dtype)
    params = random_params(cfg, 0)
    assert checkpoint.param_bytes(cfg) == sum(x.nbytes for x in jax.tree_util.tree_leaves(params))


def test_two_processes_converting_the_same_model_both_succeed(tmp_path, monkeypatch):
    # The draft's process and the target's may convert one model into one cache folder at the
    # same time; whichever renames second finds the first's complete cache and keeps it.
    cfg = tiny_config("llama")
    params = random_params(cfg, 0)
    path = tmp_path / "ckpt"
    real_replace = checkpoint.os.replace

    def other_process_wins(src, dst):
        monkeypatch.setattr(checkpoint.os, "replace", real_replace)
        checkpoint.save(path, params, cfg)  # the other process, finishing first
        real_replace(src, dst)  # ours now meets a non-empty folder: OSError ENOTEMPTY

    monkeypatch.setattr(checkpoint.os, "replace", other_process_wins)
    checkpoint.save(path, params, cfg)
    assert checkpoint.problem(path) is None
    assert list(tmp_path.iterdir()) == [path]  # our temporary is gone
    got, _ = checkpoint.restore(path)
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_save_holds_no_second_copy_of_the_params(tmp_path, monkeypatch):
    # The cache is written a group at a time from the params' own arrays: at each group's save the
    # device holds the params and nothing more (a deep copy of the layers, as dataclasses.asdict
    # made, held the weights twice through the whole save of a first load; issue 33).
    cfg = tiny_config("qwen2", num_layers=4)
    params = random_params(cfg, 0)
    jax.block_until_ready(params)
    leaves = {id(x) for x in jax.tree_util.tree_leaves(params)}
    groups = checkpoint._groups(params)
    assert {id(x) for g in groups.values() for x in g.values()} == leaves
    del groups

    def live() -> int:  # bytes of distinct device buffers (orbax keeps aliases of what it saved)
        return sum({x.unsafe_buffer_pointer(): x.nbytes for x in jax.live_arrays()}.values())

    before, seen = live(), []
    real = checkpoint.ocp.StandardCheckpointer.save

    def spy(self, directory, item, *a, **kw):
        seen.append(live())
        return real(self, directory, item, *a, **kw)

    monkeypatch.setattr(checkpoint.ocp.StandardCheckpointer, "save", spy)
    checkpoint.save(tmp_path / "ckpt", params, cfg)
    assert len(seen) == cfg.num_layers + 3  # embed, final norm, head, each layer
    assert max(seen) <= before, (before, seen)
    got, _ = checkpoint.restore(tmp_path / "ckpt")
    for a, b in zip(jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
