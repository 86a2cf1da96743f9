"""The speculation cache: fork keys exclude the drafted token, and a hit returns exactly what a
direct draft from that outcome makes with the same keys (tokens equal, proposal rows within 1e-5)."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ssd_jax.models import backends
from ssd_jax.models.config import tiny_config
from ssd_jax.models.kv_cache import init_cache
from ssd_jax.algorithm import steps
from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.algorithm.speculation_cache import SpeculationCache, check_budget, lookup
from ssd_jax.algorithm.tree import draft_tree

from _tiny import padded_model

IDS = 48
MODEL = padded_model(tiny_config("qwen2", vocab_size=IDS), 4, scale=1.0)
CFG = MODEL.cfg  # IDS ids in IDS + PAD rows
K = 3
FAN = (3, 2, 2, 1)
SAMPLING = SamplingParams(temperature=1.0)
TOP_N = tuple(f + 1 for f in FAN[:-1])
C = 0.5
SEED = jnp.int32(3)


# (draft sampling, Saguaro top-n, C) of the trees drafted here, both with Saguaro's scaling:
# sampled, and greedy, whose one-hot rows the tree keeps implicit (`one_hot_vocab`)
CASES = {"sampled": (SAMPLING, TOP_N, C), "greedy": (SamplingParams(temperature=0.0), TOP_N, C)}


def _drafted(case):
    sampling, top_n, c = CASES[case]
    params = MODEL.params
    prompts = np.array([[1, 2, 3, 4, 5, 6], [7, 8, 9, 0, 0, 0]], np.int32)
    lens = np.array([6, 3], np.int32)
    rids = jnp.asarray([10, 11], jnp.int32)
    cache = steps.prefill_cache(params, CFG, init_cache(CFG, 2, 64), jnp.asarray(prompts),
                                jnp.asarray(lens))
    # the speculation in flight: the draft's own chain from bonus b at position n
    n = jnp.asarray(lens)
    prev = jnp.asarray([prompts[0, 5], prompts[1, 2]])
    bonus = jnp.asarray([11, 12], jnp.int32)
    spec, rows, cache = steps.draft_chain(params, CFG, cache, prev, bonus, n, SEED, rids, sampling,
                                          IDS, K)
    tree, cache = draft_tree(params, CFG, cache, bonus, spec, n, jnp.asarray([True, True]),
                             jnp.asarray([False, False]), SEED, rids, sampling, IDS,
                             FAN, FAN, top_n, c)
    return params, prompts, lens, rids, np.asarray(bonus), np.asarray(spec), tree


@pytest.fixture(scope="module")
def setup():
    return _drafted("sampled")


@pytest.fixture(scope="module")
def greedy_setup():
    return _drafted("greedy")


def test_a_greedy_tree_keeps_its_one_hot_rows_implicit(setup, greedy_setup):
    *_, sampled = setup
    *_, greedy = greedy_setup
    assert sampled.one_hot_vocab == 0 and sampled.rows.shape == (2, sum(FAN), K, CFG.vocab_size)
    assert greedy.one_hot_vocab == CFG.vocab_size and greedy.rows.shape == (2, sum(FAN), K, 0)


def test_keys_exclude_the_drafted_token_and_follow_the_fan_out(setup):
    *_, spec, tree = setup
    keys = np.asarray(tree.keys)
    assert keys.shape == (2, sum(FAN), 2)
    for b in range(2):
        js = keys[b, :, 0]
        assert [int((js == j).sum()) for j in range(K + 1)] == list(FAN)
        for j, c in keys[b]:
            if j < K:
                assert c != spec[b, j], "a rejected token can never be the bonus"
        assert len({(int(j), int(c)) for j, c in keys[b]}) == sum(FAN)  # unique keys


@pytest.mark.parametrize("case", CASES)
def test_a_hit_equals_a_direct_draft_from_that_outcome(case, request):
    params, prompts, lens, rids, bonus, spec, tree = request.getfixturevalue(
        "setup" if case == "sampled" else "greedy_setup")
    sampling, top_n, sag_c = CASES[case]
    for b in range(2):
        for m in range(sum(FAN)):
            j, c = (int(x) for x in np.asarray(tree.keys)[b, m])
            # direct draft: committed = prompt + b + s_1..s_j, new bonus c at n + j + 1
            hist = [list(prompts[b, : lens[b]]) + [int(bonus[b])] + list(spec[b, :j]) for b in range(2)]
            L = max(len(h) for h in hist)
            toks = np.zeros((2, L), np.int32)
            for i, h in enumerate(hist):
                toks[i, : len(h)] = h
            hl = jnp.asarray([len(h) for h in hist], jnp.int32)
            cache = steps.prefill_cache(params, CFG, init_cache(CFG, 2, 64), jnp.asarray(toks), hl)
            prev = jnp.asarray([h[-1] for h in hist], jnp.int32)
            direct_tok, direct_rows, _ = steps.draft_chain(
                params, CFG, cache, prev, jnp.full((2,), c, jnp.int32), hl, SEED, rids, sampling,
                IDS, K, top_n, sag_c)
            outcome_k = np.full(2, j, np.int32)
            outcome_b = np.full(2, c, np.int32)
            hit, tokens, rows = lookup(tree, jnp.asarray(outcome_k), jnp.asarray(outcome_b))
            assert bool(hit[b])
            np.testing.assert_array_equal(np.asarray(tokens[b]), np.asarray(direct_tok[b]))
            np.testing.assert_allclose(np.asarray(rows[b]), np.asarray(direct_rows[b]), atol=1e-5)


@pytest.mark.parametrize("case", CASES)
def test_a_miss_returns_no_speculation(case, request):
    *_, tree = request.getfixturevalue("setup" if case == "sampled" else "greedy_setup")
    outcome_k = [0, K]
    hit, tokens, rows = lookup(tree, jnp.asarray(outcome_k, jnp.int32), jnp.asarray([47, 47], jnp.int32))
    keys = np.asarray(tree.keys)
    for b in range(2):
        expect = any((int(j), int(c)) == (outcome_k[b], 47) for j, c in keys[b])
        assert bool(hit[b]) == expect
        if not expect:
            assert not np.any(np.asarray(tokens[b])) and not np.any(np.asarray(rows[b]))
    # the pallas gather kernel agrees with the reference
    hk, tk, rk = lookup(tree, jnp.asarray([0, K], jnp.int32), jnp.asarray([47, 47], jnp.int32),
                        ops=backends.select("pallas"))
    np.testing.assert_array_equal(np.asarray(hk), np.asarray(hit))
    np.testing.assert_array_equal(np.asarray(rk), np.asarray(rows))


def test_row_dtype_and_budget():
    assert check_budget(1, 24, 7, 151936, "float32", None) == 24 * 7 * 151936 * 4  # 102 MB
    assert check_budget(1, 24, 7, 151936, "bfloat16", None) == 24 * 7 * 151936 * 2
    with pytest.raises(ValueError, match="bfloat16"):
        check_budget(1, 24, 7, 151936, "float32", 50 * 2**20)
    assert SpeculationCache.__dataclass_fields__.keys() >= {"keys", "tokens", "rows", "valid"}


@pytest.mark.parametrize("temperature,top_n,c,backend",
                         [(1.0, TOP_N, C, "xla"), (0.0, (2, 2, 2), 0.7, "cpu"),
                          (0.0, (), 1.0, "xla")])
def test_the_scanned_tree_is_the_unrolled_tree(setup, temperature, top_n, c, backend):
    # tree_loop="scan" traces one branch step inside lax.scan: the same keys, tokens and rows,
    # bit for bit, as the K unrolled steps, with Saguaro's top-n varying by depth (TOP_N, indexed
    # by the traced depth; sampled, plain-XLA table) or the same at every depth (a Python int;
    # greedy, the CPU plug-in's kernels inside the loop body, the rows implicit in both; and
    # greedy without Saguaro)
    params, prompts, lens, rids, bonus, spec, _ = setup
    ops = backends.select(backend, jax.devices()[:1])
    prepared = ops.prepare(params)
    sampling = SamplingParams(temperature=temperature)
    trees = []
    for loop in ("unroll", "scan"):
        cache = steps.prefill_cache(params, CFG, init_cache(CFG, 2, 64), jnp.asarray(prompts),
                                    jnp.asarray(lens))
        tree, _ = draft_tree(prepared, CFG, cache, jnp.asarray(bonus), jnp.asarray(spec),
                             jnp.asarray(lens), jnp.asarray([True, True]), jnp.asarray([False, False]),
                             SEED, rids, sampling, IDS, FAN, FAN, top_n, c, ops=ops,
                             tree_loop=loop)
        trees.append(tree)
    a, b = trees
    np.testing.assert_array_equal(np.asarray(a.keys), np.asarray(b.keys))
    np.testing.assert_array_equal(np.asarray(a.tokens), np.asarray(b.tokens))
    np.testing.assert_array_equal(np.asarray(a.rows), np.asarray(b.rows))


def test_an_unknown_tree_loop_is_refused(setup):
    params, prompts, lens, rids, bonus, spec, _ = setup
    cache = init_cache(CFG, 2, 64)
    with pytest.raises(ValueError, match="tree_loop must be one of"):
        draft_tree(params, CFG, cache, jnp.asarray(bonus), jnp.asarray(spec), jnp.asarray(lens),
                   jnp.asarray([True, True]), jnp.asarray([False, False]), SEED, rids, SAMPLING,
                   IDS, FAN, FAN, TOP_N, C, tree_loop="while")
