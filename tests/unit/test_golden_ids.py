"""Token ids as stored from main before the round loop's rewrite (issue #32): every case of
tests/_golden_cases.py (modes, sampling settings, SSD backups and knobs, K, placements, batch
sizes, EOS / stop / length endings, request ids, an int8 draft; its docstring has the list) runs
here and must give the stored token ids and finish reasons exactly, log-probs within
LOGPROB_TOL, and the same accept histogram (SD / SSD) and hits, lookups and backups (SSD).

A mismatch names the case, the first differing row and position, and the machine the file was
written on (jax version, CPU features) beside this one's: the steps are compiled for the host
CPU, so a different instruction set can move a float and, through a near tie, a sampled id.
All cases use backend="xla" (why: tests/_golden_cases.py). The engines are built once for the
module and the cases grouped on them so the compiled steps are shared: the CORE cases share one
set of compiles (about 50 s of CPU on a 2-core machine, most of it XLA compiling); each of the
OWN_COMPILES groups compiles its own steps (about 135 s more), so those are marked slow.

The reference is rewritten only on purpose: `python tests/_golden_cases.py --write`.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import _golden_cases as G


@pytest.fixture(scope="module")
def golden() -> dict:
    if not G.GOLDEN.exists():
        pytest.fail(f"{G.GOLDEN} is missing: `python tests/_golden_cases.py --write` at the "
                    "reference commit makes it")
    return json.loads(G.GOLDEN.read_text())


@pytest.fixture(scope="module")
def engines():
    built: dict = {}

    def get(name: str):
        if name not in built:
            built[name] = G.make_engine(name)
        return built[name]

    return get


def _where(golden: dict) -> str:
    here = G.machine()
    feats = lambda f: ",".join(k for k, v in sorted(f.items()) if v) or "none"  # noqa: E731
    return (f"the file was written at commit {golden.get('commit')} with jax {golden.get('jax')} "
            f"on a CPU with [{feats(golden.get('cpu_features', {}))}]; this machine runs jax "
            f"{here['jax']} on [{feats(here['cpu_features'])}]")


def _first_diff(want: list[list], got: list[list]) -> str | None:
    if len(want) != len(got):
        return f"{len(got)} rows, stored {len(want)}"
    for b, (w, g) in enumerate(zip(want, got)):
        for i, (x, y) in enumerate(zip(w, g)):
            if x != y:
                return (f"row {b} position {i}: {y}, stored {x} (row so far "
                        f"{g[:i + 1]} vs stored {w[:i + 1]})")
        if len(w) != len(g):
            return f"row {b}: {len(g)} tokens, stored {len(w)} (got {g}, stored {w})"
    return None


def test_every_case_is_stored(golden):
    assert sorted(golden["cases"]) == sorted(G.CASES), (
        f"cases without a stored output: {sorted(set(G.CASES) - set(golden['cases']))}; stored "
        f"cases no longer defined: {sorted(set(golden['cases']) - set(G.CASES))}")


@pytest.mark.parametrize("name", [n if n in G.CORE else pytest.param(n, marks=pytest.mark.slow)
                                  for n in G.CASES])
def test_golden_ids(name, golden, engines):
    want = golden["cases"].get(name)
    if want is None:
        pytest.fail(f"case {name} has no stored output (test_every_case_is_stored)")
    assert want["case"] == G.case_repr(name), (
        f"case {name} was edited since the file was written: the stored ids are of "
        f"{want['case']}")
    got = G.run_case(engines(G.CASES[name]["engine"]), name)
    where = _where(golden)

    diff = _first_diff(want["token_ids"], got["token_ids"])
    assert diff is None, f"{name}: token ids differ at {diff}; {where}"
    assert got["finish_reasons"] == want["finish_reasons"], (
        f"{name}: finish reasons {got['finish_reasons']}, stored {want['finish_reasons']}; {where}")
    if "texts" in want:
        assert got["texts"] == want["texts"], f"{name}: texts {got['texts']}, stored {want['texts']}"
    for b, (w, g) in enumerate(zip(want["logprobs"], got["logprobs"])):
        err = np.abs(np.asarray(g, np.float64) - np.asarray(w, np.float64))
        if err.size and err.max() > G.LOGPROB_TOL:
            i = int(np.argmax(err > G.LOGPROB_TOL))
            pytest.fail(f"{name}: logprob row {b} position {i}: {g[i]}, stored {w[i]} "
                        f"(tolerance {G.LOGPROB_TOL}); {where}")
    for key in ("accept_hist", "hits", "lookups", "backups"):
        if key in want:
            assert got[key] == want[key], f"{name}: metrics.{key} {got[key]}, stored {want[key]}; {where}"
