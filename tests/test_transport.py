"""The two-process transport (draft in its own process, jax.distributed + gloo, each pinned to a
core) gives the same tokens as the in-process engine, and really overlaps: every verify step waits
on a signal that only the draft's tree steps send while they run (a serialized design times out)."""
import json
import os
import subprocess
import sys

import pytest
from safetensors.numpy import save_file

from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import params_from_hf, perturb_hf_tensors, random_hf_tensors
from ssd_jax.runtime.engine import Engine, SSDConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CFG = tiny_config("qwen2", vocab_size=64)
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]


def write_hf(folder, tensors):
    os.makedirs(folder)
    save_file(tensors, os.path.join(folder, "model.safetensors"))
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CFG.to_hf(), f)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("two_process")
    t = random_hf_tensors(CFG, 0, scale=1.0)
    d = perturb_hf_tensors(t, 0.05, seed=1)
    write_hf(root / "target", t)
    write_hf(root / "draft", d)
    return root, t, d


def run_two_process(root, signal, quant="none", draft_vocab=None):
    env = dict(os.environ, JAX_PLATFORMS="cpu", SSD_JAX_TEST_SIGNAL=str(signal),
               PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "tests", "_two_process_target.py"),
                           str(root / "draft"), str(root / "target"), str(signal), quant,
                           *([str(draft_vocab)] if draft_vocab else [])],
                          capture_output=True, text=True, timeout=900, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_same_as_in_process(got: dict, eng: Engine):
    """The two-process run's SSD (both backups) and SD outputs equal `eng`'s in-process ones:
    tokens, cache hits and the SD accept histogram."""
    for backup in ("neural", "random"):
        want = eng.generate(PROMPTS, mode="ssd", max_new_tokens=20, k=3,
                            ssd=SSDConfig(fanout=(2, 2, 1, 1), backup=backup))
        assert got[backup]["tokens"] == want.token_ids, backup
        assert got[backup]["hits"] == want.metrics.hits, backup
    sd = eng.generate(PROMPTS, mode="sd", max_new_tokens=20, k=3)
    assert got["sd"]["tokens"] == sd.token_ids
    assert got["sd"]["accept_hist"] == list(sd.metrics.accept_hist)


def test_two_process_equals_in_process_and_overlaps(pair):
    root, t, d = pair
    got = run_two_process(root, root / "signal.txt")
    assert_same_as_in_process(got, Engine(Model(CFG, params_from_hf(t, CFG)),
                                          Model(CFG, params_from_hf(d, CFG)), compilation_cache=False))
    for backup in ("neural", "random"):
        assert 0 < got[backup]["hits"] < got[backup]["lookups"]
    # the overlap proof: every verify saw a tree step run while it was executing
    assert len(got["saw_tree"]) >= 4 and all(got["saw_tree"]), got["saw_tree"]


@pytest.mark.parametrize("quant,draft_vocab", [("int8", None), ("int8", 40), ("int4", None)])
def test_two_process_quantized_draft_equals_in_process(pair, quant, draft_vocab):
    """`start_two_process(..., quant="int8", draft_vocab=n)` prepares the draft in its process
    exactly as `ssd_jax.models.draft_head.prepare_draft` does in-process. An unquantized remote draft
    would give the same tokens but not the same counts (this pair: random-backup hits 18 vs 17, SD
    accept histogram [5, 5, 2, 10] vs [6, 5, 2, 10]); an uncut one differs from a cut one too."""
    from ssd_jax.models.draft_head import prepare_draft
    root, t, d = pair
    got = run_two_process(root, "-", quant=quant, draft_vocab=draft_vocab)
    assert_same_as_in_process(got, Engine(Model(CFG, params_from_hf(t, CFG)),
                                          prepare_draft(Model(CFG, params_from_hf(d, CFG)), quant,
                                                        draft_vocab),
                                          compilation_cache=False))
