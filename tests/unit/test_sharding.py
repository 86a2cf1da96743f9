"""Scale-out (docs/SCALE_OUT.md): a tensor-parallel target and a data-parallel draft on virtual CPU
devices give the unsharded results, and the compiled verify step of a sharded target all-reduces
activations without gathering weights.

The CPU device count is fixed once JAX starts, so the multi-device cases run in subprocesses
(tests/_sharding_worker.py, 8 devices); the placement and arithmetic checks run here (2 devices).
"""
import functools
import json
import os
import subprocess
import sys

import jax
import pytest

from ssd_jax.runtime.placement import make_placement
from ssd_jax.runtime.sharding import bytes_per_round, ssd_round_time, tokens_per_round

WORKER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "_sharding_worker.py")


@functools.lru_cache(maxsize=None)
def _worker(case: str, devices: int = 8) -> dict:
    env = dict(os.environ, JAX_PLATFORMS="cpu",
               XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} "
                         f"--xla_force_host_platform_device_count={devices}".strip())
    p = subprocess.run([sys.executable, WORKER, case, "--devices", str(devices)], env=env,
                       capture_output=True, text=True, timeout=900)
    lines = [l for l in p.stdout.splitlines() if l.startswith("RESULT ")]
    assert p.returncode == 0 and lines, f"worker {case} failed:\n{p.stdout[-3000:]}\n{p.stderr[-5000:]}"
    return json.loads(lines[-1][len("RESULT "):])


# ---------------------------------------------------------------------------------- subprocesses
def test_tp_logits_equal_unsharded():
    r = _worker("logits")
    runs = {k: v for k, v in r.items() if k != "errors"}
    assert len(runs) == 6
    for name, v in runs.items():
        assert v["rel"] <= 1e-5, (name, v["rel"])
        assert v["wqkv_spec"] == "P(None, 'model')" and v["cache_spec"] == "P(None, None, 'model')"
    # each shard holds whole heads: (H + 2 KVH) D / tp columns, KVH / tp cache heads
    assert runs["qwen2_h8_kv4_tp2"]["wqkv_shard"] == [64, (8 + 8) * 16 // 2]
    assert runs["qwen2_h8_kv4_tp4"]["cache_shard"] == [2, 32, 1, 16]
    assert runs["llama_h8_kv8_tp4"]["cache_shard"] == [2, 32, 2, 16]
    # GQA with 2 KV heads at TP 4: KV heads replicated to 4, one per shard
    assert runs["qwen3_h8_kv2_tp4"]["cache_kvh"] == 4
    assert runs["qwen3_h8_kv2_tp4"]["wqkv_shard"] == [64, (2 + 2) * 16]


def test_tp_constraints_raise_clear_errors():
    errs = _worker("logits")["errors"]
    assert "num_kv_heads (3)" in errs["kv3_tp2"] and "multiple of 2" in errs["kv3_tp2"]
    assert "num_heads (8) divisible by 3" in errs["h8_tp3"]


def test_engine_greedy_outputs_equal_unsharded():
    r = _worker("engine")
    ref = r["ar"]["1+1"]
    for layout in ("2+1", "4+1"):
        assert r["ar"][layout] == ref, f"AR with a TP target {layout}"
    for layout in ("1+1", "4+1", "4+2"):
        assert r["ssd"][layout] == ref, f"SSD {layout}"
    assert r["sd"]["4+2"] == ref
    assert r["ssd_b1"]["4+2"] == ref[:1]  # batch 1 on a 2-device draft: replicated, same output
    # a 2-device draft gives the same speculation as one: same hits, same output
    m = r["metrics"]
    assert m["4+2"] == m["4+1"] == m["1+1"]
    assert 0 < m["1+1"]["hits"] < m["1+1"]["lookups"]  # hits and misses (backups) both ran
    assert r["draft_cache_spec"] == "P('data',)" and r["draft_cache_devices"] == 2
    assert r["draft_cache_spec_b1"] == "P()"
    assert r["target_cache_spec"] == "P(None, None, 'model')"
    assert r["target_wqkv_spec"] == "P(None, 'model')"


def test_compiled_verify_all_reduces_and_gathers_no_weights():
    r = _worker("hlo")
    weight_shapes = {tuple(s) for s in r["weight_shapes"]}
    min_weight = r["min_weight_elems"]
    B, K1, E = 2, 4, 128  # the worker's batch, K + 1 and hidden size
    for tp in (2, 4):
        t = r[f"tp{tp}"]
        ops = t["ops"]
        assert t["parsed_counts"] == t["raw_counts"]  # every collective in the text was parsed
        # Megatron TP: one all-reduce of the [B, K+1, E] residual after wo and after w_down per layer
        resid = [o for o in ops if o["op"] == "all-reduce" and o["shape"] == [B, K1, E]]
        assert len(resid) == 2 * t["num_layers"], ops
        for o in ops:
            elems = 1
            for d in o["shape"]:
                elems *= d
            if o["op"] != "all-reduce":
                assert tuple(o["shape"]) not in weight_shapes and elems < min_weight, (tp, o)
        gathers = [o for o in ops if o["op"] == "all-gather"]
        assert all(o["shape"][-1] <= tp for o in gathers), gathers  # only vocab-parallel argmax partials


def test_data_parallel_draft_never_communicates():
    """A batch-sharded draft decodes each shard's own sequences: its compiled programs (prefill,
    drafting, the SSD tree, resolve with its lookup and backups, SD's report) hold no
    collective. Per-sequence writes and takes are vmapped so the batch stays a batching
    dimension GSPMD keeps local; the counters are per row and the neural backup runs without
    `any` over the rows (`round_steps.resolve`'s local_rows)."""
    r = _worker("dp_draft", devices=3)
    assert r["draft_cache_spec"] == "P('data',)"
    assert 0 < r["hits"] < r["lookups"]  # the lookup and the backups both ran
    progs = r["programs"]
    for name in ("prefill_cache", "draft_chain", "draft_tree", "resolve", "pass_report",
                 "unpack"):
        assert f"jit_{name}" in progs, sorted(progs)
    assert {n: c for n, c in progs.items() if c} == {}, progs


# What the coordination service or gloo print when the transport between the two processes
# fails, not our code: a peer's heartbeat timing out, gloo's "Received data size doesn't match".
# Seen about once in ten full runs on the loaded 2-core VM, always with no RESULT from either
# process (never tokens that differ).
_TRANSPORT_FAILURES = ("heartbeat timeout", "Received data size", "Barrier failed", "gloo::")


def _multi_controller_pair() -> list[tuple[int, str, str]]:
    """(returncode, stdout, stderr) of both processes of one multi-controller run."""
    import socket

    with socket.socket() as sock:
        sock.bind(("localhost", 0))
        port = sock.getsockname()[1]
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    procs = [subprocess.Popen([sys.executable, WORKER, "multihost", "--devices", "2",
                               "--process-id", str(i), "--port", str(port)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for i in range(2)]
    runs = []
    try:
        for p in procs:
            try:
                out, err = p.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
            runs.append((p.returncode, out, err))
    finally:  # one that failed leaves its peer waiting in a collective: end it too
        for q in procs:
            if q.poll() is None:
                q.kill()
                q.wait()
    return runs


@pytest.mark.slow
def test_two_process_multi_controller_smoke():
    """jax.distributed on two CPU processes (2 devices each, gloo): layout 2+2 with one device of
    each process per mesh; AR, SD and SSD give the single-process tokens on both processes, on
    the device loop (every step waited for, reads of global values), the draft never falling
    back. A run whose processes die in the transport (`_TRANSPORT_FAILURES`, neither printing a
    result) is run once more, with a warning that shows both processes' logs; a second failure
    fails."""
    import warnings

    def report(runs):
        return "\n".join(f"process {i} (exit {rc}):\n{out[-1500:]}\n{err[-3000:]}"
                         for i, (rc, out, err) in enumerate(runs))

    for attempt in (1, 2):
        runs = _multi_controller_pair()
        lines = [[l for l in out.splitlines() if l.startswith("RESULT ")] for _, out, _ in runs]
        if all(rc == 0 and ls for (rc, _, _), ls in zip(runs, lines)):
            break
        transport = not any(lines) and any(m in err for _, _, err in runs
                                           for m in _TRANSPORT_FAILURES)
        if attempt == 2 or not transport:
            pytest.fail(f"the multi-controller run failed (attempt {attempt}):\n{report(runs)}")
        warnings.warn(f"multi-controller run retried after a transport failure:\n{report(runs)}")
    res = [json.loads(ls[-1][len("RESULT "):]) for ls in lines]
    ref = [row[:8] for row in _worker("engine")["ar"]["1+1"][:2]]
    for i, r in enumerate(res):
        assert r["process"] == i and r["devices"] == 4 and r["local"] == 2
        assert r["ar"] == ref and r["sd"] == ref and r["ssd"] == ref
        # the draft ran every round (no fallback), SSD looked its outcomes up, drafts were accepted
        assert r["fallback"] == [None, None] and r["sd_rounds"] > 0, r
        assert r["lookups"] > 0 and r["accepted"] > 0, r
        assert r["draft_cache_spec"] == "P('data',)"
    assert res[0] == dict(res[1], process=0)  # both processes saw the same call


# ---------------------------------------------------------------------------------- in-process
def test_make_placement_layouts():
    devs = jax.devices()
    assert len(devs) == 2
    p = make_placement("split")
    assert p.split and p.layout == "1+1" and p.target_mesh.axis_names == ("model",)
    assert not make_placement("colocated").split
    p = make_placement("1+1")
    assert p.split and p.tp == 1 and p.dp == 1
    p = make_placement("colocated", target_devices=2)
    assert p.tp == 2 and p.dp == 1 and not p.split
    assert p.target_rows(64).spec == jax.sharding.PartitionSpec(None, None, "model")
    assert p.target_rows(63).spec == jax.sharding.PartitionSpec()
    assert make_placement("colocated", draft_devices=2).draft_rows(4).spec == \
        jax.sharding.PartitionSpec("data")
    assert make_placement("colocated", draft_devices=2).draft_rows(3).spec == jax.sharding.PartitionSpec()
    assert make_placement("split", devs[:1]).split is False  # one device: shared, as before
    with pytest.raises(ValueError, match="needs 5 devices"):
        make_placement("4+1")
    with pytest.raises(ValueError, match="conflicts"):
        make_placement("1+1", target_devices=2)
    with pytest.raises(ValueError, match="unknown placement"):
        make_placement("4x1")


def test_move_reshards_between_meshes_on_the_same_devices_without_device_put(monkeypatch):
    """`placement.move`, the device loop's every-round moves: between a TP target and a DP draft
    over the same two devices an array is resharded by a jitted identity (no `jax.device_put`,
    whose Python path costs ~250 calls a sharded array); the values and the target layout are
    `to_mesh`'s. Across device sets, from the host and onto one device it is `to_mesh`."""
    import jax.numpy as jnp
    import numpy as np

    from ssd_jax.runtime import placement as pl
    p = make_placement("colocated", target_devices=2, draft_devices=2)
    x = pl.to_mesh(jnp.arange(4 * 3 * 8, dtype=jnp.float32).reshape(4, 3, 8), p.draft_rows(4))
    one = make_placement("split")  # two meshes of one device each
    other = pl.to_mesh(jnp.zeros(3), one.draft_rows(3))
    puts, real = [], jax.device_put
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: puts.append(a) or real(*a, **k))
    for want in (p.target_rows(8), p.target_rows(8).update(spec=jax.sharding.PartitionSpec())):
        y = pl.move(x, want)
        assert y.sharding == want and np.array_equal(np.asarray(y), np.asarray(x))
    assert puts == []
    assert pl.move(x, p.draft_rows(4)) is x  # already there
    assert pl.move(np.zeros(3), one.target_rows(8)).sharding == one.target_rows(8)  # from the host
    assert pl.move(other, one.target_rows(8)).sharding == one.target_rows(8)  # across devices
    assert len(puts) == 2


def test_bytes_per_round():
    V, K = 151936, 7
    one = bytes_per_round(1, K, V, "float32")
    assert one["draft_to_target"] == K * V * 4 + K * 4 and one["target_to_draft"] == 8
    bf = bytes_per_round(16, K, V, "bfloat16", target_devices=4, draft_devices=2)
    assert bf["draft_to_target"] == 16 * K * V * 2 + 4 * 16 * K * 4
    assert bf["per_target_device_in"] == bf["draft_to_target"] // 4
    assert bf["per_draft_device_out"] == bf["draft_to_target"] // 2
    assert bf["target_to_draft"] == 16 * 8  # batch-sharded outcome: each row crosses once
    rep = bytes_per_round(1, K, V, "float32", target_devices=4, rows_sharded=False)
    assert rep["draft_to_target"] == 4 * one["draft_to_target"]


def test_round_time_arithmetic():
    assert tokens_per_round(1.0, 7) == 8.0
    assert abs(tokens_per_round(0.5, 1) - 1.5) < 1e-12
    assert ssd_round_time(18.3, 12.0, 10.5, 1.0) == 18.3
    assert abs(ssd_round_time(18.3, 12.0, 10.5, 0.9) - (18.3 + 1.05)) < 1e-9
    assert abs(ssd_round_time(10.0, 12.0, 5.0, 0.9, batch=2) - (12.0 + 0.19 * 5.0)) < 1e-9
