"""The step store (ssd_jax/algorithm/aot.py): a second process reads every step's exported module
back instead of tracing it, and runs the same computation; what it cannot describe for certain
it never stores."""
import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.algorithm import aot, steps
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import CacheOverflowError, checked, init_cache
from ssd_jax.models.ops import XLA, xla_attend
from ssd_jax.models.params import random_params

# One process: AR (greedy), SD and SSD (sampled; SSD's rounds one by one and in chunks, the
# others in chunks, `Engine.round_chunks`) on a tiny random pair with
# the store on; per step what the store did and whether the step was traced (JAX's trace event
# names the function it traced: a step read back from the store is never traced); with argv[2]
# "then-off", the same calls again as plain jits (the store off) for the tokens to compare.
CHILD = textwrap.dedent("""
    import json, sys
    import jax
    from ssd_jax.algorithm import round_steps, steps, tree
    from ssd_jax.algorithm.sampling import SamplingParams
    from ssd_jax.models.config import tiny_config
    from ssd_jax.models.model import Model
    from ssd_jax.models.params import perturb, random_params
    from ssd_jax.runtime.engine import Engine, SSDConfig

    traced = []
    def on_duration(event, duration, **kw):
        if event == "/jax/core/compile/jaxpr_trace_duration":
            traced.append(str(kw.get("fun_name", "?")))
    jax.monitoring.register_event_duration_secs_listener(on_duration)

    cfg = tiny_config("llama", vocab_size=40)
    t = Model(cfg, random_params(cfg, 0, scale=1.0))
    d = Model(cfg, perturb(t.params, jax.random.key(2), 0.3))
    engine = Engine(t, d, max_len=64, compilation_cache=sys.argv[1], backend="xla",
                    step_store=True)
    before = len(traced)
    compiles = []
    def run():
        outs = []
        for m, s, chunks in (("ar", SamplingParams(), True), ("sd", SamplingParams(0.8), True),
                             ("ssd", SamplingParams(1.0, 0, 0.9), False),
                             ("ssd", SamplingParams(1.0, 0, 0.9), True)):
            engine.round_chunks = chunks
            out = engine.generate([[3, 1, 4, 1, 5], [2, 7]], mode=m, max_new_tokens=8, k=3,
                                  sampling=s, seed=5, ssd=SSDConfig(fanout=(1, 1, 1, 1)))
            outs.append(out.token_ids)
            compiles.append(out.metrics.compiles)
        return outs
    outs = run()
    fns = (steps.prefill, steps.prefill_cache, round_steps.decode_chunk, round_steps.sd_chunk,
           round_steps.ssd_chunk, steps.verify, steps.draft_chain, tree.draft_tree)
    res = {"tokens": outs, "traced": traced[before:], "compiles": compiles[:],
           "store": {f.__name__: [f.exported, f.loaded, f.plain_calls] for f in fns}}
    if sys.argv[2] == "then-off":  # the same calls again as plain jits, the store off
        from ssd_jax.algorithm import aot
        aot.set_store(None)
        res["plain_tokens"] = run()
        res["plain_store"] = {f.__name__: [f.exported, f.loaded, f.plain_calls] for f in fns}
    print("RESULT " + json.dumps(res))
""")
STEPS = ("prefill", "prefill_cache", "decode_chunk", "sd_chunk", "ssd_chunk", "verify",
         "draft_chain", "draft_tree")


def _run(cache_dir, store):
    env = dict(os.environ, SSD_JAX_COMPILE_CACHE_MIN_SECS="0")
    env.pop("SSD_JAX_COMPILE_CACHE", None)
    env.pop("SSD_JAX_STEP_STORE", None)
    p = subprocess.run([sys.executable, "-c", CHILD, str(cache_dir), store], env=env,
                       capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    line = [x for x in p.stdout.splitlines() if x.startswith("RESULT ")]
    assert line, p.stdout[-2000:] + p.stderr[-2000:]
    return json.loads(line[-1][len("RESULT "):])


@pytest.mark.slow
def test_a_second_process_reads_every_step_back_and_traces_none(tmp_path):
    first = _run(tmp_path, "then-off")
    assert set(first["store"]) == set(STEPS)
    for name, (exported, loaded, plain) in first["store"].items():
        assert exported >= 1 and loaded == 0 and plain == 0, (name, first["store"])
    assert set(STEPS) <= set(first["traced"])  # the first process traced (to export) each one
    files = sorted(p.name.split("-")[0] for p in (tmp_path / "steps").iterdir())
    assert files == sorted(n for n, (e, _, _) in first["store"].items() for _ in range(e))
    # the store off: the steps are their plain jits (no export, no read), nothing more written
    assert first["plain_store"] == first["store"]
    assert len(list((tmp_path / "steps").iterdir())) == len(files)

    second = _run(tmp_path, "on")
    for name, (exported, loaded, plain) in second["store"].items():
        assert (exported, loaded, plain) == (0, first["store"][name][0], 0), (name, second)
    assert not set(STEPS) & set(second["traced"]), second["traced"]
    # the same tokens in both processes and as the plain jits: AR greedy, SD (in chunks of
    # rounds) and SSD sampled, its rounds one by one and in chunks (the same tokens either way);
    # so the exactness the engine tests prove for the jitted steps holds for stored ones
    assert first["tokens"] == second["tokens"] == first["plain_tokens"]
    assert first["tokens"][2] == first["tokens"][3]
    # out.metrics.compiles says where each program came from: the stored steps compiled from
    # their exports in the first process, read back from the persistent cache in the second
    for run, want in ((first, "step store"), (second, "step store, persistent cache")):
        stored = {name: p for call in run["compiles"] for name, p in call.items()
                  if name.startswith("jit(stored_")}
        assert {n[len("jit(stored_"):-1] for n in stored} == set(STEPS), sorted(stored)
        assert {p["source"] for p in stored.values()} == {want}, stored
    assert all(p["source"] == "persistent cache" for call in second["compiles"]
               for name, p in call.items() if p["count"] and not name.startswith("jit(stored_"))


CFG = tiny_config("llama", vocab_size=40)


def _decode_args(batch=1):
    params = random_params(CFG, 0)
    cache = init_cache(CFG, batch, 16).with_lengths(jnp.full((batch,), 3, jnp.int32))
    z = jnp.zeros((batch,), jnp.int32)
    return (params, CFG, cache, z + 7, jnp.ones((batch,), bool), jnp.int32(0), z,
            SamplingParams(), 40)


@pytest.fixture
def store(tmp_path):
    aot.set_store(tmp_path)
    yield tmp_path
    aot.set_store(None)


def _fresh(fn):
    """A new StoredJit of the same step: a table that starts empty, as in a new process."""
    return aot.StoredJit(fn.__wrapped__, fn.static_argnames, fn.donate_argnames)


def test_a_torn_file_is_exported_again_and_gives_the_same_step(store):
    want = steps.decode.jit(*_decode_args())
    one = _fresh(steps.decode)
    got = one(*_decode_args())
    assert (one.exported, one.loaded) == (1, 0)
    (path,) = store.iterdir()
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])  # a torn write
    two = _fresh(steps.decode)
    again = two(*_decode_args())
    assert (two.exported, two.plain_calls) == (1, 0)  # read failed, so exported over it
    three = _fresh(steps.decode)
    last = three(*_decode_args())
    assert (three.exported, three.loaded) == (0, 1)
    for out in (got, again, last):
        for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_new_shape_or_static_value_is_a_new_file(store):
    fn = _fresh(steps.decode)
    fn(*_decode_args(1))
    fn(*_decode_args(1))  # the same call: this process's table, no new file
    assert len(list(store.iterdir())) == 1
    fn(*_decode_args(2))  # a new batch: a new shape
    args = list(_decode_args(1))
    args[-1] = 32  # a new vocab_size (static)
    fn(*args)
    assert len(list(store.iterdir())) == 3 and fn.exported == 3


def test_what_it_cannot_describe_runs_as_a_plain_jit(store):
    own = dataclasses.replace(XLA, attend=lambda *a, **k: xla_attend(*a, **k))
    fn = _fresh(steps.decode)
    out = fn(*_decode_args(), ops=own)
    assert (fn.exported, fn.plain_calls) == (0, 1) and not list(store.iterdir())
    want = steps.decode.jit(*_decode_args())
    np.testing.assert_array_equal(np.asarray(out[0]), np.asarray(want[0]))


def test_describe_is_exact_about_what_traces_the_same():
    assert aot.describe(XLA) == aot.describe(dataclasses.replace(XLA))
    assert aot.describe(XLA) != aot.describe(dataclasses.replace(XLA, name="other"))
    assert aot.describe(CFG) == aot.describe(tiny_config("llama", vocab_size=40))
    assert aot.describe(CFG) != aot.describe(tiny_config("llama", vocab_size=41))
    assert aot.describe((1, 1.0, "x", None)) != aot.describe((1.0, 1, "x", None))  # types count
    assert aot.describe(steps.verify.__wrapped__) == "fn:ssd_jax.algorithm.steps.verify"
    k = 3
    assert aot.describe(lambda x: x) is None  # a lambda
    assert aot.describe(lambda x: x + k) is None  # a closure
    assert aot.describe(np.sum) is None  # someone else's code
    assert aot.describe(object()) is None
    assert aot.describe(dataclasses.replace(XLA, dense=np.dot)) is None


def test_inside_checked_the_store_steps_aside_and_the_check_still_fires(store):
    fn = _fresh(steps.decode)
    args = list(_decode_args())
    args[2] = args[2].with_lengths(jnp.full((1,), 16, jnp.int32))  # full: a decode overflows
    with pytest.raises(CacheOverflowError, match="exceed S = 16"):
        checked(fn)(*args)
    assert fn.plain_calls == 1 and not list(store.iterdir())


def test_a_source_edited_since_import_turns_the_store_off(store, monkeypatch):
    """The code running in this process is what was imported; a file changed on disk since
    would name other code, so nothing is stored under it."""
    aot.library_fingerprint.cache_clear()
    monkeypatch.setattr(aot, "_IMPORTED", aot._IMPORTED[:-1] + (("edited.py", 0, 0),))
    try:
        fn = _fresh(steps.decode)
        with pytest.warns(UserWarning, match="source changed on disk"):
            fn(*_decode_args())
        assert (fn.exported, fn.plain_calls) == (0, 1) and not list(store.iterdir())
    finally:
        aot.library_fingerprint.cache_clear()
