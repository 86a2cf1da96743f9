"""Outputs researchers expect (issue 23, item 3), on tiny random models: `jax.jit(forward)` with
the config as a static pytree, metrics as a pytree with a schema'd JSON, `load_model` of a Hub id
from a local HF cache (and its dtype default). Streaming, chat messages and the CLI's outputs
are in test_stream.py, test_chat.py and test_cli.py."""
import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from safetensors.numpy import save_file

from ssd_jax.models import hub, registry
from ssd_jax.models.config import ModelConfig, tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.models.load import auto_dtype, load_model
from ssd_jax.models.params import random_hf_tensors, random_params
from ssd_jax.models.transformer import forward
from ssd_jax.runtime.metrics import SCHEMA, Metrics, RoundTimes

CFG = tiny_config("qwen2", vocab_size=48)


# ------------------------------------------------------------------------------- static config
def test_jit_of_forward_takes_the_config_without_static_argnames():
    params = random_params(CFG, 0)
    tokens = jnp.array([[1, 2, 3, 4]], jnp.int32)
    want, _ = jax.jit(forward, static_argnames=("cfg",))(params, CFG, tokens, init_cache(CFG, 1, 8))
    traces = []

    def counted(params, cfg, tokens, cache):
        traces.append(cfg)
        return forward(params, cfg, tokens, cache)

    f = jax.jit(counted)
    got, cache = f(params, CFG, tokens, init_cache(CFG, 1, 8))
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert traces == [CFG] and isinstance(traces[0], ModelConfig)  # the config itself, not a tracer
    assert np.asarray(cache.lengths).tolist() == [4]
    f(params, dataclasses.replace(CFG), tokens, init_cache(CFG, 1, 8))  # an equal config: no retrace
    assert len(traces) == 1
    assert jax.tree.leaves(CFG) == []  # no leaves: nothing of it is traced


# ------------------------------------------------------------------------------- metrics
def _metrics() -> Metrics:
    m = Metrics(mode="ssd", backend={"target": "xla", "draft": "xla"}, fanout=(1, 1, 2))
    m.init_hist(2)
    m.accept_hist[:] = [1, 2, 3]
    m.hits, m.lookups, m.backups = 4, 6, {"neural": 2}
    m.add_round(RoundTimes(verify_s=0.5, draft_s=0.25, round_s=1.0, hit=1, lookups=1, active=1,
                           tokens=3, compiled=True))
    m.add_round(RoundTimes(verify_s=0.25, draft_s=0.125, round_s=0.5, hit=0, lookups=1, active=1,
                           tokens=2))
    m.compile_s, m.prefill_s, m.new_tokens = 3.0, 0.75, 5
    return m


def test_metrics_are_a_pytree_of_their_numbers():
    m = _metrics()
    doubled = jax.tree.map(lambda x: x * 2, m)
    assert isinstance(doubled, Metrics) and isinstance(doubled.timeline[0], RoundTimes)
    assert doubled.accept_hist == [2, 4, 6] and doubled.backups == {"neural": 4}
    assert doubled.timeline[1].verify_s == 0.5 and doubled.decode_s == 1.0
    assert doubled.hit_rate == m.hit_rate  # hits and lookups both doubled
    # the description is static: not mapped, and part of the structure
    assert (doubled.mode, doubled.k, doubled.fanout, doubled.backend) == ("ssd", 2, (1, 1, 2),
                                                                        m.backend)
    assert jax.tree.structure(doubled) == jax.tree.structure(m)
    other = dataclasses.replace(m, mode="sd")
    assert jax.tree.structure(other) != jax.tree.structure(m)
    hash(jax.tree.structure(m))  # hashable: usable as a jit argument's structure
    # a mean over runs of one configuration
    mean = jax.tree.map(lambda *xs: float(np.mean(xs)), m, doubled)
    assert mean.compile_s == 4.5 and mean.accept_hist == [1.5, 3.0, 4.5]
    leaves = jax.tree.leaves(m)
    assert all(isinstance(x, (int, float, bool)) for x in leaves) and 3.0 in leaves


def test_metrics_json_has_a_schema_and_reads_back():
    m = _metrics()
    d = json.loads(m.to_json())
    assert d["schema"] == SCHEMA == 1
    assert d["tokens_per_s"] == 2 / 0.5  # derived rates are written too
    back = Metrics.from_json(m.to_json())
    assert back == m
    assert Metrics.from_dict(m.to_dict()) == m
    # NaN (written as null) and a missing speed-up read back
    empty = Metrics(mode="ar")
    empty.decode_s = float("nan")
    again = Metrics.from_dict(json.loads(json.dumps(empty.to_dict())))
    assert np.isnan(again.decode_s) and again.predicted_speedup is None
    with pytest.raises(ValueError, match="schema None"):
        Metrics.from_dict({k: v for k, v in d.items() if k != "schema"})
    with pytest.raises(ValueError, match="schema 2"):
        Metrics.from_dict({**d, "schema": 2})


# ------------------------------------------------------------------------------- the HF hub cache
def _hf_folder(folder):
    folder.mkdir(parents=True)
    save_file(random_hf_tensors(CFG, 0), str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CFG.to_hf()))
    return folder


def _hub_layout(hf_home, repo_id, source, commit="0123abcd"):
    """huggingface_hub's cache layout: models--Org--Name/{refs/main, snapshots/<commit>/...}."""
    org, name = repo_id.split("/")
    repo = hf_home / "hub" / f"models--{org}--{name}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit + "\n")
    shutil.copytree(source, repo / "snapshots" / commit)
    return repo / "snapshots" / commit


def test_load_model_resolves_a_hub_id_from_the_local_cache(tmp_path, monkeypatch):
    src = _hf_folder(tmp_path / "src")
    hf_home = tmp_path / "hf"
    snap = _hub_layout(hf_home, "TinyOrg/tiny-qwen", src)
    monkeypatch.setenv("HF_HOME", str(hf_home))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)  # a relative "TinyOrg/tiny-qwen" folder does not exist here
    assert hub.resolve("TinyOrg/tiny-qwen") == snap
    m = load_model("TinyOrg/tiny-qwen", "float32", use_cache=False, with_tokenizer=False)
    ref = load_model(src, "float32", use_cache=False, with_tokenizer=False)
    assert m.cfg == ref.cfg and m.name == "TinyOrg/tiny-qwen"
    for a, b in zip(jax.tree.leaves(m.params), jax.tree.leaves(ref.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # HF_HUB_CACHE wins over HF_HOME, as in huggingface_hub
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))
    with pytest.raises(hub.HubCacheError, match="elsewhere"):
        hub.resolve("TinyOrg/tiny-qwen")


def test_a_hub_id_not_in_the_cache_says_where_it_looked(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.chdir(tmp_path)
    want = str(tmp_path / "hf" / "hub" / "models--NoOrg--absent" / "snapshots")
    with pytest.raises(registry.FetchError) as e:
        load_model("NoOrg/absent")
    assert want in str(e.value) and "huggingface-cli download NoOrg/absent" in str(e.value)
    # a snapshot without config.json (an interrupted download)
    src = tmp_path / "partial"
    src.mkdir()
    (src / "model.safetensors").write_bytes(b"")
    _hub_layout(tmp_path / "hf", "NoOrg/partial", src)
    with pytest.raises(hub.HubCacheError, match="no config.json"):
        hub.resolve("NoOrg/partial")
    # two snapshots and no refs/main: which one is ambiguous, and said so
    repo = tmp_path / "hf" / "hub" / "models--NoOrg--two"
    for c in ("aaa", "bbb"):
        _hf_folder(repo / "snapshots" / c)
    with pytest.raises(hub.HubCacheError, match="2 snapshots"):
        hub.resolve("NoOrg/two")
    assert hub.resolve_hub_id("NoOrg/two", revision="bbb") == repo / "snapshots" / "bbb"
    # not a hub id: the registry's own error
    with pytest.raises(registry.FetchError, match="neither a default model"):
        hub.resolve(str(tmp_path / "a" / "b" / "c"))
    assert not hub.is_hub_id("../x") and not hub.is_hub_id("a/b/c") and hub.is_hub_id("Qwen/Qwen3-0.6B")


def test_load_model_dtype_defaults_to_the_clis_auto(tmp_path):
    from ssd_jax.runtime.defaults import choose
    src = _hf_folder(tmp_path / "m")
    assert auto_dtype() == choose()["dtype"]
    m = load_model(src, use_cache=False, with_tokenizer=False)
    assert m.cfg.dtype == choose()["dtype"]
    leaf = jax.tree.leaves(m.params)[0]
    assert leaf.dtype == jnp.dtype(choose()["dtype"])
    with pytest.raises(ValueError, match="unsupported dtype 'fp8'"):
        load_model(src, "fp8")
