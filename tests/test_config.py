"""A generate call's arguments are checked from plain values, before any model work
(ssd_jax.runtime.config.check_request): each bad knob gets an error that names it."""
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
    with pytest.raises(ValueError, match="temperature"):  # SamplingParams checks itself
        SamplingParams(temperature=-1.0)
