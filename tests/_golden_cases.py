"""Golden token ids: tiny-model `Engine.generate` calls whose outputs were stored from main at the
commit recorded in tests/data/golden_ids.json, so that a rewrite of the round loop (issue #32:
per-row state on the device) can show it emits the same ids, call for call.

Every draw is keyed by (seed, request id, position, stream), so for a fixed seed the ids of a
call are a pure function of the models, the prompts and the arguments: a rewrite that keeps the
algorithm keeps them bit for bit (and in SD / SSD the accept counts, hits and lookups too, which
depend on the draft's proposals).

What the cases cover (CASES below, one name each):
- modes ar / sd / ssd; greedy, temperature 0.8, top-k, top-p, per-request mixed sampling (a list
  of SamplingParams, one per prompt), draft_sampling different from sampling;
- SSD backups neural / random / ngram / auto, Saguaro C < 1, fanout and fanout_backup, bfloat16
  proposal rows; K = 1, 2, 4;
- placements "split" and "colocated" (the tests' 2 CPU devices, tests/conftest.py), a "1+1"
  layout string;
- batch sizes 1, 3, 16 and 64; prompts of different lengths in one batch; eos_ids that end rows
  mid-call; stop strings (a byte-level tokenizer, tests/_byte_tokenizer.py); max_new_tokens that
  end mid-round (and 1: the prefill's token alone); request ids other than 0..B-1; seeds other
  than 0; an int8-quantized draft (ssd_jax.models.quant).

backend="xla" everywhere: the CPU kernel plug-in ("auto" on a one-device CPU mesh) picks its
code paths by the CPU's instruction set (AVX-512, bf16, AMX), so its float results, and through
a near tie a sampled id, can differ between machines. XLA's CPU code is also compiled for the
host, so the file records the CPU's feature flags and the jax version it was written with, and a
mismatch names both. compilation_cache=False: nothing read from or written to a disk cache.

backup="auto" picks neural or random per round from measured times, which no test can repeat;
here `deterministic_auto` replaces BackupChooser.choose by one that alternates random, neural,
random, ... per call (everything else is the engine's), as tests/statistical/test_engine_paths.py does.

`python tests/_golden_cases.py --write` (from the repository root) rewrites the file: only do
that at a commit whose outputs are the reference.
"""
from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

if __name__ == "__main__":  # the tests' device set-up (tests/conftest.py) before jax is imported
    os.environ.setdefault("JAX_PLATFORMS", "cpu")
    import jax
    jax.config.update("jax_num_cpu_devices", 2)
    jax.config.update("jax_enable_x64", False)

import jax
import numpy as np

from ssd_jax.algorithm.policy import BackupChooser
from ssd_jax.algorithm.sampling import SamplingParams as SP
from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import perturb, random_params
from ssd_jax.models.quant import quantize_model
from ssd_jax.runtime.config import SSDConfig
from ssd_jax.runtime.engine import Engine

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
from _byte_tokenizer import byte_tokenizer  # noqa: E402

GOLDEN = HERE / "data" / "golden_ids.json"
V = 260           # the byte tokenizer's 259 ids (+1): one vocabulary, so text cases share compiles
MAX_LEN = 64      # every call's cache is one 64-slot bucket (prompt <= 16 + 24 new + K + 2)
LOGPROB_TOL = 1e-4
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "avx512_vnni", "amx")


# ----------------------------------------------------------------------------- models / engines
def _pair() -> tuple[Model, Model]:
    """(target, draft): random 2-layer transformers with the byte tokenizer (default EOS 257),
    the draft a perturbed copy. Scale 4 and rel 0.05: at T = 0.8 the draft's proposals are
    accepted 0, 1 and 2 at a time and a fair share of SSD lookups hit."""
    cfg = tiny_config("qwen2", vocab_size=V, hidden_size=32, intermediate_size=64,
                      num_heads=2, num_kv_heads=1, head_dim=16, num_layers=2)
    tok = byte_tokenizer()
    target = Model(cfg, random_params(cfg, 7, scale=4.0), tok)
    draft = Model(cfg, perturb(target.params, jax.random.key(11), 0.05), tok)
    return target, draft


# engine name -> (draft quantization, placement); each is built once and serves all its cases.
# A compile is keyed by the step, its shapes (B, K, fan-out, row dtype), greedy-or-sampled and
# the mesh: the target's steps are shared by every engine here (device 0), the draft's are not
# ("1+1" is "split" again and compiles nothing new). Compiles are most of the time, so the
# cases are grouped to share them: most at B = 3, K = 2, sampled, fan-out (2, 1, 1).
ENGINES = {
    "split": ("none", "split"),
    "layout_1+1": ("none", "1+1"),
    "colocated_int8": ("int8", "colocated"),  # both draft-side factors: one set of draft compiles
}


def make_engine(name: str) -> Engine:
    quant, placement = ENGINES[name]
    target, draft = _pair()
    return Engine(target, quantize_model(draft, quant), placement=placement, max_len=MAX_LEN,
                  backend="xla", compilation_cache=False)


# ----------------------------------------------------------------------------- prompts
def prompts(n: int, lens=(3, 5, 9), seed: int = 0) -> list[list[int]]:
    """n id prompts (ids < 256: bytes) of lengths cycling through `lens` (numpy's PCG64 stream:
    stable across versions)."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, lens[i % len(lens)]).tolist() for i in range(n)]


T08 = SP(temperature=0.8)
TOPK = SP(temperature=1.0, top_k=5)
TOPP = SP(temperature=0.9, top_p=0.8)
MIXED3 = [SP(), SP(temperature=0.8, top_k=8), SP(temperature=1.0, top_p=0.9)]
DRAFT_SP = SP(temperature=1.2, top_k=10)
F = SSDConfig(fanout=(2, 1, 1))
EOS = [3, 17, 40, 77, 101, 120, 150, 199, 230, 244, 251, 257]  # 12 of 260 ids: rows end early
RIDS16 = list(range(100, 132, 2))


def _case(mode, n=3, *, engine="split", seed=0, prompt_seed=0, lens=(3, 5, 9), **kw):
    kw.setdefault("max_new_tokens", 16)
    return dict(engine=engine, prompts=prompts(n, lens, prompt_seed),
                kwargs=dict(mode=mode, seed=seed, **kw))


# name -> dict(engine=ENGINES key, prompts=ids or texts, kwargs=generate's keyword arguments).
# CORE: B = 3, K = 2, sampled, fan-out (2, 1, 1) on "split": one set of compiles serves them all.
CORE: dict[str, dict] = {
    "ar_t08_b3": _case("ar", sampling=T08),
    "ar_mixed_b3_rids_seed5": _case("ar", sampling=MIXED3, request_ids=[7, 1000, 3], seed=5),
    "ar_topk_b3_mnt1": _case("ar", sampling=TOPK, max_new_tokens=1),
    "sd_t08_k2_b3": _case("sd", k=2, sampling=T08),
    "sd_topk_k2_b3_mnt13": _case("sd", k=2, sampling=TOPK, max_new_tokens=13),
    "sd_mixed_k2_b3": _case("sd", k=2, sampling=MIXED3),
    "sd_draft_sampling_k2_b3": _case("sd", k=2, sampling=T08, draft_sampling=DRAFT_SP),
    "sd_t08_k2_b3_seed9_rids": _case("sd", k=2, sampling=T08, seed=9, request_ids=[5, 4, 3]),
    "sd_t08_k2_b3_eos_mnt24": _case("sd", k=2, sampling=T08, eos_ids=EOS, max_new_tokens=24,
                                    prompt_seed=3),
    "ssd_t08_k2_b3_neural": _case("ssd", k=2, sampling=T08, ssd=F),
    "ssd_topp_k2_b3_mnt14": _case("ssd", k=2, sampling=TOPP, ssd=F, max_new_tokens=14),
    "ssd_t08_k2_b3_random": _case("ssd", k=2, sampling=T08,
                                  ssd=SSDConfig(fanout=(2, 1, 1), backup="random")),
    "ssd_t08_k2_b3_ngram": _case("ssd", k=2, sampling=T08,
                                 ssd=SSDConfig(fanout=(2, 1, 1), backup="ngram")),
    "ssd_t08_k2_b3_auto": _case("ssd", k=2, sampling=T08, max_new_tokens=24,
                                ssd=SSDConfig(fanout=(2, 1, 1), backup="auto")),
    "ssd_t08_k2_b3_saguaro05": _case("ssd", k=2, sampling=T08,
                                     ssd=SSDConfig(fanout=(2, 1, 1), saguaro_c=0.5)),
    # fanout_backup: the list backup="random" picks for itself (the same compiled tree)
    "ssd_t08_k2_b3_fanout_backup_saguaro07": _case(
        "ssd", k=2, sampling=T08,
        ssd=SSDConfig(fanout=(2, 1, 1), fanout_backup=(4, 0, 0), saguaro_c=0.7)),
    "ssd_mixed_draft_sampling_k2_b3_rids": _case("ssd", k=2, sampling=MIXED3,
                                                 draft_sampling=DRAFT_SP, ssd=F,
                                                 request_ids=[11, 2, 900]),
    "ssd_t08_k2_b3_eos_mnt24": _case("ssd", k=2, sampling=T08, eos_ids=EOS, max_new_tokens=24,
                                     prompt_seed=3, ssd=F),
    "layout_1+1_ssd_t08_k2_b3": _case("ssd", engine="layout_1+1", k=2, sampling=T08, ssd=F),
}

# --- text prompts and stop strings (the byte tokenizer; no compile of their own)
TEXT_PROMPTS = ["def f(x):", "hello", "ab ab ab, a"]
# rows 1 and 2 stop mid-call at these seeds, row 0 runs to its length: ";C" spans two byte
# tokens, "ab~" starts in the merged "ab" token (256)
STOP = [";C", "ab~"]
CORE.update({
    "text_sd_t08_k2_b3_stop": dict(engine="split", prompts=TEXT_PROMPTS, kwargs=dict(
        mode="sd", seed=0, k=2, sampling=T08, stop=STOP, max_new_tokens=20)),
    "text_ssd_t08_k2_b3_stop": dict(engine="split", prompts=TEXT_PROMPTS, kwargs=dict(
        mode="ssd", seed=0, k=2, sampling=T08, stop=STOP, max_new_tokens=20, ssd=F)),
})

# OWN_COMPILES: each group compiles steps of its own (a shape, the greedy path, a row dtype, the
# draft's mesh and weights); the test marks them slow.
LENS16 = (1, 4, 9, 16)
OWN_COMPILES: dict[str, dict] = {
    # bfloat16 proposal rows: the tree and the verify again
    "ssd_t08_k2_b3_bf16_rows": _case("ssd", k=2, sampling=T08,
                                     ssd=SSDConfig(fanout=(2, 1, 1), row_dtype="bfloat16")),
    # greedy (its own static path) at B = 16: prompts of 1..16 tokens, EOS, request ids
    "ar_greedy_b16_eos": _case("ar", n=16, eos_ids=EOS, prompt_seed=1, lens=LENS16),
    "sd_greedy_k2_b16_eos_rids": _case("sd", n=16, k=2, eos_ids=EOS, prompt_seed=1, lens=LENS16,
                                       request_ids=RIDS16),
    "ssd_greedy_k2_b16_eos_rids": _case("ssd", n=16, k=2, eos_ids=EOS, prompt_seed=1, lens=LENS16,
                                        request_ids=RIDS16, ssd=F),
    # K = 4 (ending mid-round), K = 1 at B = 1
    "sd_topk_k4_b3_mnt11": _case("sd", k=4, sampling=TOPK, max_new_tokens=11),
    "ssd_topk_k4_b3_mnt11": _case("ssd", k=4, sampling=TOPK, max_new_tokens=11,
                                  ssd=SSDConfig(fanout=(2, 1, 1, 1, 1))),
    "sd_topp_k1_b1": _case("sd", n=1, k=1, sampling=TOPP, lens=(6,)),
    # B = 64
    "sd_t08_k2_b64_eos_mnt8": _case("sd", n=64, k=2, sampling=T08, eos_ids=EOS, prompt_seed=2,
                                    max_new_tokens=8),
    # the draft int8 and on the target's device
    "colocated_int8_sd_t08_k2_b3": _case("sd", engine="colocated_int8", k=2, sampling=T08),
    "colocated_int8_ssd_t08_k2_b3": _case("ssd", engine="colocated_int8", k=2, sampling=T08,
                                          ssd=F),
}
CASES: dict[str, dict] = {**CORE, **OWN_COMPILES}


# ----------------------------------------------------------------------------- running
@contextlib.contextmanager
def deterministic_auto():
    """BackupChooser.choose alternating random, neural, random, ... per call of each chooser
    (backup="auto" otherwise follows measured times)."""
    orig = BackupChooser.choose

    def choose(self, *args, **kwargs):
        self._golden_calls = getattr(self, "_golden_calls", 0) + 1
        return "random" if self._golden_calls % 2 else "neural"

    BackupChooser.choose = choose
    try:
        yield
    finally:
        BackupChooser.choose = orig


def case_repr(name: str) -> str:
    """The case's definition as text: stored beside its outputs, so an edited case is told apart
    from a changed engine."""
    c = CASES[name]
    return repr((c["engine"], ENGINES[c["engine"]], c["prompts"], sorted(c["kwargs"].items())))


def run_case(engine: Engine, name: str) -> dict:
    """The outputs of case `name` on `engine` (made by make_engine(CASES[name]["engine"])), as
    stored in the golden file."""
    c = CASES[name]
    with deterministic_auto():
        out = engine.generate(c["prompts"], **c["kwargs"])
    m = out.metrics
    rec = dict(token_ids=[[int(t) for t in row] for row in out.token_ids],
               finish_reasons=list(out.finish_reasons),
               logprobs=[[round(float(x), 6) for x in row] for row in out.logprobs])
    if any(isinstance(p, str) for p in c["prompts"]) or c["kwargs"].get("stop"):
        rec["texts"] = list(out.texts)
    if c["kwargs"]["mode"] != "ar":
        rec["accept_hist"] = [int(x) for x in m.accept_hist]
    if c["kwargs"]["mode"] == "ssd":
        rec.update(hits=int(m.hits), lookups=int(m.lookups),
                   backups={k: int(v) for k, v in sorted(m.backups.items())})
    return rec


def cpu_features() -> dict[str, bool]:
    """Which of CPU_FLAGS /proc/cpuinfo lists ("amx": any amx_* flag)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags = set(line.split(":", 1)[1].split())
            break
    return {f: (any(x.startswith("amx") for x in flags) if f == "amx" else f in flags)
            for f in CPU_FLAGS}


def machine() -> dict:
    return dict(jax=jax.__version__, jaxlib=__import__("jaxlib").__version__,
                cpu_features=cpu_features())


def _git_commit() -> str:
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=HERE, capture_output=True,
                              text=True, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "ssd_jax", "models"],
                               cwd=HERE.parent, capture_output=True, text=True).stdout.strip()
        return head + (" (+ uncommitted changes)" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def by_engine() -> dict[str, list[str]]:
    groups: dict[str, list[str]] = {}
    for name, c in CASES.items():
        groups.setdefault(c["engine"], []).append(name)
    return groups


def dumps(data: dict) -> str:
    """JSON with one line per case field (a diff of the file shows which case and field moved)."""
    head = {k: v for k, v in data.items() if k != "cases"}
    lines = ["{"] + [f" {json.dumps(k)}: {json.dumps(v)}," for k, v in head.items()] + [' "cases": {']
    for i, (name, rec) in enumerate(data["cases"].items()):
        fields = [f"  {json.dumps(k)}: {json.dumps(v)}" for k, v in rec.items()]
        end = "," if i < len(data["cases"]) - 1 else ""
        lines += [f" {json.dumps(name)}: {{", ",\n".join(fields), f" }}{end}"]
    return "\n".join(lines + [" }", "}"]) + "\n"


def write(path: Path = GOLDEN) -> dict:
    import time
    cases = {}
    for eng_name, names in by_engine().items():
        eng = make_engine(eng_name)
        for name in names:
            t0 = time.perf_counter()
            cases[name] = dict(case=case_repr(name), **run_case(eng, name))
            print(f"{name}: {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    data = dict(commit=_git_commit(), **machine(), cases=cases)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(dumps(data))
    return data


if __name__ == "__main__":
    if sys.argv[1:] != ["--write"]:
        sys.exit("usage: python tests/_golden_cases.py --write   (rewrites tests/data/golden_ids.json)")
    write()
    print(f"wrote {GOLDEN}", file=sys.stderr)
