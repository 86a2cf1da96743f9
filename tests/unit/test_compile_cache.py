"""The persistent compilation cache serves a second process: two fresh Python processes run the same
Engine calls (a tiny random model, AR and SSD) against one temporary cache directory; the first
compiles and writes every step, the second reads every one of them back and compiles none."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from ssd_jax.runtime import compile_cache

# One process's run: which jitted functions XLA compiled and which it read from the persistent
# cache. JAX records a cache hit inside its backend-compile event, so a hit is attributed to the
# function whose backend-compile event ends next (the Engine compiles on one thread). Only the
# compiles from the Engine's construction on count: it is what turns the cache on.
CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from ssd_jax.models.config import tiny_config
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import perturb, random_params
    from ssd_jax.runtime.engine import Engine, SSDConfig

    log, pending = [], []
    def on_event(event, **_):
        if event == "/jax/compilation_cache/cache_hits":
            pending.append("hit")
        elif event == "/jax/compilation_cache/cache_misses":
            pending.append("miss")
    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            log.append([kw.get("fun_name", "?"), pending[-1] if pending else "uncached"])
            pending.clear()
    jax.monitoring.register_event_listener(on_event)
    jax.monitoring.register_event_duration_secs_listener(on_duration)

    cfg = tiny_config("llama", vocab_size=40)
    t = Model(cfg, random_params(cfg, 0, scale=1.0))
    d = Model(cfg, perturb(t.params, jax.random.key(2), 0.3))
    before = len(log)  # the models were made before the Engine turned the cache on
    engine = Engine(t, d, max_len=64, compilation_cache=sys.argv[1], backend="xla")
    outs = [engine.generate([[3, 1, 4, 1, 5]], mode=m, max_new_tokens=8, k=3,
                            ssd=SSDConfig(fanout=(1, 1, 1, 1))).token_ids for m in ("ar", "ssd")]
    print("RESULT " + json.dumps({"log": log[before:], "tokens": outs}))
""")
STEPS = ("prefill", "prefill_cache", "decode_chunk", "draft_chain", "draft_tree", "verify")


def _run(cache_dir):
    env = dict(os.environ, SSD_JAX_COMPILE_CACHE_MIN_SECS="0")
    env.pop("SSD_JAX_COMPILE_CACHE", None)
    p = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir)], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stdout[-2000:] + p.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


def _by_step(log):
    """{step: [how each of its backend compiles went: "hit" | "miss" | "uncached"]}."""
    out = {}
    for fun, how in log:
        name = fun.removeprefix("jit(").removesuffix(")")
        if name in STEPS:
            out.setdefault(name, []).append(how)
    return out


@pytest.mark.slow
def test_second_process_reads_every_step_from_the_cache(tmp_path):
    first = _run(tmp_path)
    cold = _by_step(first["log"])
    assert set(cold) == set(STEPS), cold  # every step compiled in the first process
    assert all(h == ["miss"] for h in cold.values()), cold  # the directory was empty
    assert len(list(tmp_path.iterdir())) >= len(STEPS)
    second = _run(tmp_path)
    warm = _by_step(second["log"])
    assert warm == {s: ["hit"] for s in STEPS}, warm
    # nothing else compiled either: every compile of the Engine's set-up and calls was a hit
    assert all(h == "hit" for _, h in second["log"]), [x for x in second["log"] if x[1] != "hit"]
    assert second["tokens"] == first["tokens"]


def test_min_compile_secs_reads_its_variable(monkeypatch):
    monkeypatch.delenv("SSD_JAX_COMPILE_CACHE_MIN_SECS", raising=False)
    assert compile_cache.min_compile_secs() == compile_cache.DEFAULT_MIN_COMPILE_SECS
    monkeypatch.setenv("SSD_JAX_COMPILE_CACHE_MIN_SECS", "2.5")
    assert compile_cache.min_compile_secs() == 2.5
    for bad in ("-1", "soon", "nan"):
        monkeypatch.setenv("SSD_JAX_COMPILE_CACHE_MIN_SECS", bad)
        with pytest.raises(ValueError, match="SSD_JAX_COMPILE_CACHE_MIN_SECS"):
            compile_cache.min_compile_secs()


def _hf_pair(root):
    """A tiny target (a Model) and its draft saved as an HF folder `root/draft` (what a spawned
    draft process loads)."""
    from safetensors.numpy import save_file

    from ssd_jax.models.config import tiny_config
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import params_from_hf, perturb_hf_tensors, random_hf_tensors

    cfg = tiny_config("qwen2", vocab_size=64)
    t = random_hf_tensors(cfg, 0, scale=1.0)
    (root / "draft").mkdir()
    save_file(perturb_hf_tensors(t, 0.05, seed=1), str(root / "draft" / "model.safetensors"))
    (root / "draft" / "config.json").write_text(json.dumps(cfg.to_hf()))
    return Model(cfg, params_from_hf(t, cfg))


@pytest.mark.slow
@pytest.mark.parametrize("setting", ["dir", False])
def test_the_draft_process_keeps_its_compiles(tmp_path, setting):
    # The draft's tree and chain are the largest compiles of an SSD call; its process turns the
    # persistent cache on as the target's Engine does (here the target's cache is off, so every
    # entry in the directory is the draft process's own).
    from ssd_jax.runtime.engine import Engine, SSDConfig
    from ssd_jax.runtime.transport import start_two_process

    target = _hf_pair(tmp_path)
    cache = tmp_path / "cc"
    rd = start_two_process(str(tmp_path / "draft"), cores=None, timeout=300,
                           compilation_cache=str(cache) if setting == "dir" else False)
    try:
        eng = Engine(target, remote_draft=rd, compilation_cache=False)
        out = eng.generate([[1, 2, 3, 4, 5]], mode="ssd", max_new_tokens=8, k=3,
                           ssd=SSDConfig(fanout=(2, 1, 1, 1)))
        assert out.metrics.lookups > 0, out.metrics
    finally:
        rd.close()
    names = {p.name.split("-")[0] for p in cache.iterdir()} if cache.exists() else set()
    if setting == "dir":
        assert {"jit_draft_tree", "jit_draft_chain"} <= names, sorted(names)
    else:
        assert names == set(), sorted(names)
