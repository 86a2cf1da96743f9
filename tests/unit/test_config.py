"""A generate call's arguments are checked from plain values, before any model work
(ssd_jax.runtime.config.check_request): each bad knob gets an error that names it."""
import numpy as np
import pytest

from ssd_jax.algorithm.sampling import SamplingParams
from ssd_jax.runtime.config import SSDConfig, check_request


@pytest.mark.parametrize("kw, match", [
    (dict(mode="beam"), "unknown mode 'beam'"),
    (dict(max_new_tokens=0), "max_new_tokens must be an int >= 1"),
    (dict(max_new_tokens=2.5), "max_new_tokens must be an int >= 1"),
    (dict(k=0), "lookahead K must be an int >= 1, got 0"),
    (dict(k=True), "lookahead K must be an int >= 1"),
    (dict(sampling="greedy"), "sampling must be a ssd_jax.SamplingParams"),
    (dict(ssd=SSDConfig(fanout=(1, 1))), "K\\+1 = 3 entries"),
    (dict(ssd=SSDConfig(fanout=(1, 1, 1), fanout_backup=(3, 0, 1))), "equal positive sums"),
    (dict(ssd=SSDConfig(fanout=(0, 0, 0))), "equal positive sums"),
    (dict(ssd=SSDConfig(saguaro_c=2.0)), "saguaro_c must be in \\(0, 1\\], got 2.0"),
    (dict(ssd=SSDConfig(fanout="plan", saguaro_c=0.0)), "saguaro_c must be in \\(0, 1\\]"),
    (dict(ssd=SSDConfig(backup="oracle")), "unknown backup 'oracle'"),
    (dict(ssd=SSDConfig(fanout=(4, 1, 1)), vocab=4), "more candidates than a vocabulary of 4"),
    (dict(max_new_tokens=None), "max_new_tokens must be an int >= 1, got None"),
    (dict(max_new_tokens="8"), "max_new_tokens must be an int >= 1, got '8'"),
    (dict(k=None), "lookahead K must be an int >= 1, got None"),
    (dict(k=2.0), "lookahead K must be an int >= 1, got 2.0"),
    (dict(mode="ar", k=-1), "lookahead K must be an int >= 1, got -1"),
    (dict(draft_sampling="greedy"), "draft_sampling must be a ssd_jax.SamplingParams"),
    (dict(sampling=None), "sampling must be a ssd_jax.SamplingParams, got None"),
    (dict(ssd=None), "ssd must be a ssd_jax.SSDConfig, got NoneType"),
    (dict(ssd=SSDConfig(fanout=(1.5, 1, 1))), "fanout must be a sequence of ints"),
    (dict(ssd=SSDConfig(fanout=(1, 1, 1), fanout_backup=(True, 1, 1))), "fanout_backup must be"),
    (dict(ssd=SSDConfig(fanout=3)), "fanout must be a sequence of ints F_0..F_K, got 3"),
    (dict(ssd=SSDConfig(saguaro_c="0.5")), "saguaro_c must be in \\(0, 1\\], got '0.5'"),
    (dict(ssd=SSDConfig(saguaro_c=float("nan"))), "saguaro_c must be in"),
    (dict(ssd=SSDConfig(row_dtype="int8")), "row_dtype 'int8': use one of float32, bfloat16"),
    (dict(ssd=SSDConfig(row_dtype="nonsense")), "row_dtype 'nonsense'"),
    (dict(ssd=SSDConfig(cache_budget_bytes=0)), "cache_budget_bytes must be None or an int >= 1"),
    (dict(seed=2 ** 31), "seed must be an int in \\[-2147483648, 2147483647\\], got 2147483648"),
    (dict(seed=1.5), "seed must be an int"),
    (dict(seed="1"), "seed must be an int"),
    (dict(seed=True), "seed must be an int"),
    (dict(stop="\n\n"), "stop must be a list of strings \\(e.g. stop=\\['\\\\n\\\\n'\\]\\)"),
    (dict(stop=["ok", 3]), "stop must be a list of strings, got \\['ok', 3\\]"),
    (dict(stop=None), "stop must be a list of strings"),
    (dict(eos_ids=[99], vocab=64), "eos_ids must be token ids in \\[0, 64\\), got \\[99\\]"),
    (dict(eos_ids=[-1]), "eos_ids must be token ids"),
    (dict(eos_ids=5), "eos_ids must be token ids"),
    (dict(on_tokens="print"), "on_tokens must be a function or None, got str"),
    (dict(verifier=3), "verifier must be a function or None, got int"),
    (dict(chat="yes"), "chat must be True or False, got 'yes'"),
    (dict(max_len=12), "= 13 exceeds the cache length max_len=12"),
])
def test_each_bad_argument_is_named(kw, match):
    args = dict(mode="ssd", max_new_tokens=8, k=2, sampling=SamplingParams(),
                ssd=SSDConfig()) | kw
    with pytest.raises(ValueError, match=match):
        check_request(**args)


def test_good_arguments_pass():
    check_request("ssd", 8, 2, ssd=SSDConfig(fanout=(3, 2, 4)), vocab=4)  # at the caps
    check_request("ssd", 8, 2, ssd=SSDConfig(fanout="plan"))
    check_request("ar", 8, 0)  # K is not used by plain decoding
    check_request("ssd", 8, 2, seed=np.int64(-3), stop=("x", "\n"), eos_ids=np.asarray([0, 63]),
                  vocab=64, on_tokens=print, verifier=len, chat=np.bool_(True), max_len=13)
    check_request("ssd", 8, 2, ssd=SSDConfig(row_dtype="bfloat16", cache_budget_bytes=1 << 20))
    check_request("sd", 8, 2, ssd=None)  # SD takes no SSD knobs
    with pytest.raises(ValueError, match="temperature"):  # SamplingParams checks itself
        SamplingParams(temperature=-1.0)


@pytest.mark.parametrize("kw, match", [
    (dict(mode="sd", k=100), "K=100 is past the bound MAX_K=8"),
    (dict(mode="ssd", k=9), "MAX_K=8"),
    (dict(mode="ssd", k=2, ssd=SSDConfig(fanout=(40, 20, 5))), "MAX_FANOUT_WIDTH=64"),
    (dict(max_new_tokens=2 ** 17 + 1), "MAX_NEW_TOKENS"),
    (dict(max_len=2 ** 17 + 1), r"max_len must be an int in \[2, MAX_LEN=131072\]"),
    (dict(max_len=4.0), "max_len must be an int"),
])
def test_each_bound_is_named_before_any_load(kw, match):
    """Issue 35: `k=100` was accepted and still compiling after 600 s; every size a call asks for
    has a documented maximum (ssd_jax.runtime.config), checked from plain values."""
    args = dict(mode="ssd", max_new_tokens=8, k=4, ssd=SSDConfig())
    args.update(kw)
    with pytest.raises(ValueError, match=match):
        check_request(args.pop("mode"), args.pop("max_new_tokens"), args.pop("k"), **args)


def test_the_bounds_themselves_are_accepted():
    from ssd_jax.runtime.config import MAX_FANOUT_WIDTH, MAX_K, MAX_LEN, MAX_NEW_TOKENS
    check_request("ssd", 8, MAX_K, ssd=SSDConfig(fanout=(MAX_FANOUT_WIDTH - MAX_K,) + (1,) * MAX_K))
    check_request("ar", MAX_NEW_TOKENS - 12, MAX_K, max_len=MAX_LEN)
