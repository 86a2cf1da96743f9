"""Target side of the two-process transport test (its own process, pinned to core 0 as the CLI
pins it; the draft process on core 1, connected over the authenticated socket).

argv: draft HF folder, target HF folder, signal file (or "-"), optionally the draft's quantization
("int8") and the width of its cut head (models/draft_head.py). Prints one JSON line: tokens of SSD
(two backups, the neural one timed too) and SD, hit counts, and — with a signal file — whether
every verify saw the draft's tree run while it was executing (the overlap proof), SSD with
backup="auto", and the T = 1 runs of `T1` (a batch of 16 with its own seed and request ids)."""
import json
import os
import sys
import time

import numpy as np

from ssd_jax.runtime.transport import start_two_process

HERE = os.path.dirname(os.path.abspath(__file__))
PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9], [10, 11, 12, 13, 14, 15, 16, 17]]
# the T = 1 batch (reported in the JSON; tests/faults/test_transport.py runs it in-process): 16 prompts of
# 2..8 tokens, 16 tokens each
T1 = dict(prompts=[[(7 * b + 3 * i) % 60 + 1 for i in range(2 + b % 7)] for b in range(16)],
          max_new_tokens=16, k=3, seed=11, request_ids=list(range(100, 116)))
draft_dir, target_dir, signal = sys.argv[1], sys.argv[2], sys.argv[3]
quant = sys.argv[4] if len(sys.argv) > 4 else "none"
draft_vocab = int(sys.argv[5]) if len(sys.argv) > 5 else None
remote = start_two_process(draft_dir, cores=(0, 1), quant=quant, draft_vocab=draft_vocab,
                           compilation_cache=False,  # as the Engine below
                           draft_main=os.path.join(HERE, "_two_process_draft.py") if signal != "-" else None)

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.experimental import io_callback  # noqa: E402

from ssd_jax.models.load import load_model  # noqa: E402
from ssd_jax.runtime.engine import Engine, SSDConfig  # noqa: E402
from ssd_jax.algorithm.verify import rejection_sample  # noqa: E402

saw_tree = []


def rendezvous(x):
    """Runs inside verify (after the target forward), once the test is armed: announce "verify
    running" (file V) and wait for a tree step to answer (file T) while this verify is still
    executing."""
    if not os.path.exists(signal + ".armed"):
        return np.float32(0)
    v, t = signal + ".V", signal + ".T"
    if os.path.exists(t):
        os.remove(t)
    open(v, "w").close()
    deadline = time.time() + 30
    ok = False
    while time.time() < deadline and not ok:
        ok = os.path.exists(t)
        time.sleep(0.002)
    os.remove(v)
    saw_tree.append(ok)
    return np.float32(0)


def signalled_verifier(p, q, spec, acc_keys, res_keys):
    zero = io_callback(rendezvous, jax.ShapeDtypeStruct((), jnp.float32), p[0, 0, 0])
    return rejection_sample(p + zero, q, spec, acc_keys, res_keys)


target = load_model(target_dir, "float32", with_tokenizer=False, use_cache=False)  # as the draft
eng = Engine(target, remote_draft=remote, compilation_cache=False)
out = {}
verifier = signalled_verifier if signal != "-" else None
# compile both sides first (with the verifier the proof uses), so the overlap proof below sees
# steady-state rounds, not compile time
for backup in ("neural", "random"):
    eng.generate(PROMPTS, mode="ssd", max_new_tokens=8, k=3, verifier=verifier,
                 ssd=SSDConfig(fanout=(2, 2, 1, 1), backup=backup))
if signal != "-":
    open(signal + ".armed", "w").close()
for backup in ("neural", "random"):
    r = eng.generate(PROMPTS, mode="ssd", max_new_tokens=20, k=3, verifier=verifier,
                     ssd=SSDConfig(fanout=(2, 2, 1, 1), backup=backup))
    out[backup] = dict(tokens=r.token_ids, hits=r.metrics.hits, lookups=r.metrics.lookups,
                       exchange_s=[t.exchange_s for t in r.metrics.timeline])
r = eng.generate(PROMPTS, mode="sd", max_new_tokens=20, k=3)
out["sd"] = dict(tokens=r.token_ids, accept_hist=list(r.metrics.accept_hist))
out["saw_tree"] = saw_tree
if signal != "-":
    os.remove(signal + ".armed")
    # backup="auto" with the draft in its own process: the choice crosses the wire each round and
    # the draft process resolves with auto's program (after the overlap proof: it compiles here)
    r = eng.generate(PROMPTS, mode="ssd", max_new_tokens=20, k=3,
                     ssd=SSDConfig(fanout=(2, 2, 1, 1), backup="auto"))
    out["auto"] = dict(tokens=r.token_ids, hits=r.metrics.hits, lookups=r.metrics.lookups,
                       backups=r.metrics.backups, fallback=r.metrics.fallback)
# timed rounds (timeline=True): each round's phases as the draft process timed them
r = eng.generate(PROMPTS, mode="ssd", max_new_tokens=20, k=3, ssd=SSDConfig(fanout=(2, 2, 1, 1)),
                 timeline=True)
out["timed"] = dict(tokens=r.token_ids, rounds=[[t.verify_s, t.draft_s, t.backup_s, t.exchange_s,
                                                 t.hit, t.lookups] for t in r.metrics.timeline])
from ssd_jax.algorithm.sampling import SamplingParams  # noqa: E402

t1 = dict(T1, sampling=SamplingParams(temperature=1.0))
for mode in (("ssd", "sd") if signal != "-" else ()):
    r = eng.generate(mode=mode, ssd=SSDConfig(fanout=(2, 2, 1, 1)), **t1)
    out[f"t1_{mode}"] = dict(tokens=r.token_ids, hits=r.metrics.hits,
                             accept_hist=list(r.metrics.accept_hist), fallback=r.metrics.fallback)
    out["t1_batch"] = T1
print(json.dumps(out))
remote.close()
