"""Weights once: a load streams the file (its host peak does not grow with the model), builds each
leaf on its devices, and the engine holds one laid-out copy.

The peak is measured in a fresh process per load (VmHWM of /proc/self/status, after a baseline
taken once JAX is up), so one load's garbage cannot hide or inflate another's.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import jax
import numpy as np
import pytest

from ssd_jax.models import checkpoint
from ssd_jax.models.config import ModelConfig
from ssd_jax.models.load import load_model
from ssd_jax.models.loading.hf import load_hf_folder
from ssd_jax.models.model import Model
from ssd_jax.models.params import param_bytes, params_from_hf, random_hf_tensors

# one wide layer shape: ~23.6 M parameters a layer, 94 MB in float32
WIDE = dict(hidden_size=1024, num_attention_heads=8, num_key_value_heads=8, head_dim=128,
            intermediate_size=6144, vocab_size=512)


def _wide_folder(path, layers: int):
    """A llama HF folder of `layers` identical-shaped layers in float32, written a tensor at a
    time (the writer's memory stays one layer)."""
    from safetensors.numpy import save_file

    path.mkdir()
    E, I, V, H, D = (WIDE[k] for k in ("hidden_size", "intermediate_size", "vocab_size",
                                       "num_attention_heads", "head_dim"))
    rng = np.random.default_rng(0)
    index = {}
    for i in range(layers):
        p = f"model.layers.{i}."
        t = {p + "input_layernorm.weight": np.ones(E, np.float32),
             p + "post_attention_layernorm.weight": np.ones(E, np.float32)}
        for n, shape in (("self_attn.q_proj", (H * D, E)), ("self_attn.k_proj", (H * D, E)),
                         ("self_attn.v_proj", (H * D, E)), ("self_attn.o_proj", (E, H * D)),
                         ("mlp.gate_proj", (I, E)), ("mlp.up_proj", (I, E)), ("mlp.down_proj", (E, I))):
            t[p + n + ".weight"] = rng.standard_normal(shape, np.float32) * 0.02
        save_file(t, str(path / f"layer{i}.safetensors"))
        index.update({k: f"layer{i}.safetensors" for k in t})
    t = {"model.embed_tokens.weight": rng.standard_normal((V, E), np.float32),
         "model.norm.weight": np.ones(E, np.float32)}
    save_file(t, str(path / "outer.safetensors"))
    index.update({k: "outer.safetensors" for k in t})
    (path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": index}))
    (path / "config.json").write_text(json.dumps({
        "model_type": "llama", "num_hidden_layers": layers, "tie_word_embeddings": True,
        "rms_norm_eps": 1e-5, "rope_theta": 1e4, "max_position_embeddings": 256, **WIDE}))
    return path


_MEASURE = textwrap.dedent("""
    import json, sys
    import jax, numpy as np
    jax.config.update("jax_platforms", "cpu")
    from ssd_jax.models.load import load_model
    from ssd_jax.models.loading.hf import load_hf_folder
    from ssd_jax.models.config import ModelConfig
    from ssd_jax.models.params import params_from_hf, param_bytes

    def status(key):
        for line in open("/proc/self/status"):
            if line.startswith(key):
                return int(line.split()[1]) * 1024

    jax.block_until_ready(jax.numpy.ones(4) + 1)  # the runtime up before the baseline
    folder, how = sys.argv[1], sys.argv[2]
    base = status("VmRSS:")
    if how == "stream":
        params = load_model(folder, "float32", use_cache=False, with_tokenizer=False).params
    elif how == "first-load":  # converted and the conversion cache written (argv[3])
        params = load_model(folder, "float32", cache_dir=sys.argv[3], with_tokenizer=False).params
    else:  # the control: every tensor materialised as float32 first, as the old loader did
        config, src = load_hf_folder(folder)
        whole = {k: src[k] for k in src}
        params = params_from_hf(whole, ModelConfig.from_hf(config, "float32"))
        del whole
    jax.block_until_ready(params)
    print(json.dumps({"base": base, "peak": status("VmHWM:"), "weights": param_bytes(params)}))
""")


def _peak(folder, how: str, *args) -> dict:
    out = subprocess.run([sys.executable, "-c", _MEASURE, str(folder), how, *map(str, args)],
                         capture_output=True,
                         text=True, timeout=600, env={"JAX_PLATFORMS": "cpu", "PATH": "/usr/bin:/bin"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    r["above"] = r["peak"] - r["base"] - r["weights"]  # what the load held beyond its weights
    return r


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_load_peak_does_not_grow_with_the_layer_count(tmp_path):
    small, big = _wide_folder(tmp_path / "l2", 2), _wide_folder(tmp_path / "l8", 8)
    s, b = _peak(small, "stream"), _peak(big, "stream")
    grow = b["weights"] - s["weights"]  # 6 layers, 566 MB
    assert grow > 500e6
    # the whole load of 8 layers above its weights stays within 10% of the 2-layer load's peak
    assert b["above"] - s["above"] <= 0.10 * (s["peak"] - s["base"]), (s, b)
    # the measurement sees a model materialised on the host: the control's excess grows with it
    c = _peak(big, "materialise")
    assert c["above"] - b["above"] > 0.5 * (b["weights"] - WIDE_OUTER_BYTES), (b, c)


WIDE_OUTER_BYTES = 4 * (WIDE["vocab_size"] + 1) * WIDE["hidden_size"]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_first_load_with_its_cache_save_does_not_grow_with_the_layer_count(tmp_path):
    # A first load converts and writes the conversion cache (orbax, a group at a time): the
    # save holds no second copy of the layers either (checkpoint._groups; issue 33's
    # "first load converts with peak RSS <= 2 GB + its bf16 weights").
    small, big = _wide_folder(tmp_path / "l2", 2), _wide_folder(tmp_path / "l8", 8)
    s = _peak(small, "first-load", tmp_path / "cache2")
    b = _peak(big, "first-load", tmp_path / "cache8")
    assert b["weights"] - s["weights"] > 500e6
    for cache, layers in ((tmp_path / "cache2", 2), (tmp_path / "cache8", 8)):
        (ckpt,) = (cache / "converted").iterdir()  # written, complete and restorable
        params, cfg = checkpoint.restore(ckpt)
        assert cfg.num_layers == len(params.layers) == layers
    # a copy of the layers held through the save (as `_groups` once made) adds all 6 extra
    # layers' bytes; what is left is glibc arena creep of the writer's threads (~0.2x here,
    # MALLOC_ARENA_MAX=1 removes it; on the default target the save stays under the conversion's
    # own peak)
    assert b["above"] - s["above"] <= 0.5 * (b["weights"] - s["weights"]), (s, b)


# ------------------------------------------------------------------------------- to the devices
CFG = ModelConfig(arch="qwen2", vocab_size=96, hidden_size=64, intermediate_size=96, num_layers=2,
                  num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=True, dtype="float32",
                  tie_embeddings=True, max_position_embeddings=512, rope_theta=1e4)


def _folder(tmp_path, cfg=CFG, dtype=np.float32):
    from safetensors.numpy import save_file

    t = random_hf_tensors(cfg, 3)
    folder = tmp_path / "model"  # beside the cache, not holding it (its mtime keys the cache)
    folder.mkdir()
    save_file({k: v.astype(dtype) for k, v in t.items()}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({
        "model_type": cfg.arch, "hidden_size": cfg.hidden_size, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
        "intermediate_size": cfg.intermediate_size, "num_hidden_layers": cfg.num_layers,
        "vocab_size": cfg.vocab_size, "tie_word_embeddings": True, "rope_theta": 1e4,
        "max_position_embeddings": 512}))
    return folder, t


def test_streamed_params_equal_the_whole_dict_conversion(tmp_path):
    import ml_dtypes

    folder, t = _folder(tmp_path, dtype=ml_dtypes.bfloat16)
    config, src = load_hf_folder(folder)
    assert not isinstance(src, dict)  # a lazy source: nothing read yet
    for dt in ("float32", "bfloat16"):
        cfg = ModelConfig.from_hf(config, dt)
        got = params_from_hf(src, cfg)
        want = params_from_hf({k: src[k] for k in src}, cfg)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            assert a.dtype == b.dtype == np.dtype(dt) and a.shape == b.shape
            np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))
        # bf16 rounding on the host equals XLA's
        w = np.asarray(t["model.layers.0.mlp.down_proj.weight"]).T.astype(np.float32)
        ref = jax.numpy.asarray(np.asarray(src["model.layers.0.mlp.down_proj.weight"]).T, dtype=dt)
        np.testing.assert_array_equal(np.asarray(got.layers[0].w_down, np.float32), np.asarray(ref, np.float32))
        assert w.shape == ref.shape


def test_bad_tensor_is_named_before_anything_is_read(tmp_path):
    folder, t = _folder(tmp_path)
    config, src = load_hf_folder(folder)
    cfg = ModelConfig.from_hf(config, "float32").replace(intermediate_size=80)
    with pytest.raises(ValueError, match=r"mlp\.gate_proj\.weight has shape \(96, 64\), the config expects \(80, 64\)"):
        params_from_hf(src, cfg)
    t["model.layers.1.mlp.up_proj.weight"][3, 5] = np.nan
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight contains NaN"):
        params_from_hf(t, ModelConfig.from_hf(config, "float32"))


def test_load_to_a_tensor_parallel_mesh_puts_only_shards_on_each_device(tmp_path):
    from jax.sharding import Mesh, PartitionSpec as P

    from ssd_jax.runtime.sharding import shard_target

    folder, t = _folder(tmp_path)
    mesh = Mesh(np.array(jax.devices()[:2]), ("model",))
    ref = params_from_hf(t, CFG)
    want_cfg, want = shard_target(ref, CFG, mesh)
    for _ in range(2):  # the first converts and saves, the second restores
        m = load_model(folder, "float32", sharding=mesh, cache_dir=tmp_path / "cache",
                       with_tokenizer=False)
        assert m.cfg == want_cfg and m.params.tp_groups == 2
        w = m.params.layers[0].wqkv
        assert w.sharding.spec == P(None, "model")
        assert [s.data.shape for s in w.addressable_shards] == [(64, 64), (64, 64)]
        for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
            assert a.sharding.is_equivalent_to(b.sharding, a.ndim)
    assert len(list((tmp_path / "cache" / "converted").glob("*-tp2-*"))) == 1


def test_restore_places_on_the_sharding_asked_for(tmp_path):
    from jax.sharding import SingleDeviceSharding

    folder, _ = _folder(tmp_path)
    dev = SingleDeviceSharding(jax.devices()[1])
    first = load_model(folder, "bfloat16", sharding=dev, cache_dir=tmp_path, with_tokenizer=False)
    again = load_model(folder, "bfloat16", sharding=dev, cache_dir=tmp_path, with_tokenizer=False)
    for a, b in zip(jax.tree.leaves(first.params), jax.tree.leaves(again.params)):
        assert a.dtype == b.dtype == jax.numpy.bfloat16
        assert b.sharding == dev
        np.testing.assert_array_equal(np.asarray(a, np.float32), np.asarray(b, np.float32))


# ------------------------------------------------------------------------------------ one copy
def _device_bytes() -> dict:
    """{device id: bytes} of the live device buffers (two Array objects over one buffer, which
    jax.live_arrays can list, counted once)."""
    out: dict = {}
    seen = set()
    for a in jax.live_arrays():
        for s in a.addressable_shards:
            key = (s.device.id, s.data.unsafe_buffer_pointer())
            if key not in seen:
                seen.add(key)
                out[s.device.id] = out.get(s.device.id, 0) + s.data.nbytes
    return out


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_engine_holds_one_copy_of_the_weights(dtype):
    import gc

    from ssd_jax import forward
    from ssd_jax.models import checkpoint
    from ssd_jax.models.protocol import init_cache
    from ssd_jax.runtime.engine import Engine

    gc.collect()
    before = _device_bytes()
    cfg = CFG.replace(dtype=dtype, num_layers=4, hidden_size=128, intermediate_size=256)
    dcfg = cfg.replace(num_layers=1)
    target = Model(cfg, params_from_hf(random_hf_tensors(cfg, 1), cfg))
    draft = Model(dcfg, params_from_hf(random_hf_tensors(dcfg, 2), dcfg))
    engine = Engine(target, draft, compilation_cache=False)
    gc.collect()
    held = {d: n - before.get(d, 0) for d, n in _device_bytes().items()}
    tdev, ddev = (engine.placement.target_mesh.devices.flat[0].id,
                  engine.placement.draft_mesh.devices.flat[0].id)
    assert tdev != ddev
    # what each device holds: its model's laid-out weights (and nothing of the un-prepared ones)
    assert held.get(tdev, 0) <= 1.05 * param_bytes(engine.tparams)
    assert held.get(ddev, 0) <= 1.05 * param_bytes(engine.worker.params)
    assert param_bytes(engine.tparams) >= checkpoint.param_bytes(cfg)
    # the user's models are the engine's laid-out copy, usable as before
    assert engine.target is target and target.params is engine.tparams
    assert draft.params is engine.worker.params
    logits, _ = jax.jit(lambda p, t, c: forward(p, cfg, t, c, ops=engine.tops))(
        target.params, jax.numpy.zeros((1, 3), jax.numpy.int32), init_cache(cfg, 1, 8))
    assert logits.shape == (1, 3, cfg.vocab_size)
    # a second engine on the same model reuses its laid-out weights: no new copy on that device
    again = Engine(target, compilation_cache=False, placement="colocated")
    for a, b in zip(jax.tree.leaves(again.tparams), jax.tree.leaves(engine.tparams)):
        assert a.unsafe_buffer_pointer() == b.unsafe_buffer_pointer()


def test_engine_lays_out_a_layer_at_a_time_releasing_the_old_one():
    """A layout pass that copies every weight: while the engine runs it, the target's device
    holds the model once plus about one layer, never the old and the new model together."""
    import dataclasses
    import gc

    from ssd_jax.models import backends
    from ssd_jax.runtime.engine import Engine

    cfg = CFG.replace(num_layers=6, hidden_size=128, intermediate_size=256)
    gc.collect()
    base = _device_bytes().get(0, 0)
    target = Model(cfg, params_from_hf(random_hf_tensors(cfg, 1), cfg))
    whole = param_bytes(target.params)
    layer = param_bytes(target.params.layers[0])
    seen = []

    def copying_prepare(p):
        out = jax.tree.map(lambda x: x + 0, p)
        jax.block_until_ready(out)
        gc.collect()
        seen.append(_device_bytes().get(0, 0) - base)
        return out

    ops = dataclasses.replace(backends.select("xla"), prepare=copying_prepare)
    engine = Engine(target, backend=ops, placement="colocated", compilation_cache=False)
    assert len(seen) == cfg.num_layers + 1
    outer = whole - cfg.num_layers * layer
    assert max(seen) <= whole + layer + outer, (seen, whole, layer)
    gc.collect()
    assert _device_bytes().get(0, 0) - base <= 1.05 * whole
    assert target.params is engine.tparams
