"""The package installs under one namespace: a wheel built from this tree, installed non-editable
into a fresh venv, holds only `ssd_jax` (models/ and pallas_kernels/ as ssd_jax.models and
ssd_jax.pallas_kernels, the CPU kernels' sources included) and imports from a folder that has a
`models` package of its own, which stays the user's."""
import json
import os
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                           "-q", "-w", str(out), str(ROOT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    (whl,) = out.glob("ssd_jax-*.whl")
    return whl


def test_the_wheel_holds_one_namespace_and_every_kernel_source(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"ssd_jax"}, tops
    assert "ssd_jax/models/transformer.py" in names
    assert "ssd_jax/pallas_kernels/tree_attention.py" in names
    kernels = ROOT / "models" / "cpu" / "kernels"
    sources = sorted(p.name for p in kernels.iterdir() if p.suffix in (".cc", ".h"))
    assert sources and all(f"ssd_jax/models/cpu/kernels/{s}" in names for s in sources), sources
    meta = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
    text = zipfile.ZipFile(wheel).read(meta).decode()
    assert "[ssd_jax.backends]" in text and "cpu = ssd_jax.models.cpu:backend" in text, text


def test_imports_beside_a_users_own_models_package(wheel, tmp_path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    done = subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           str(wheel)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-3000:]
    # the dependencies (jax, flax, ...) come from this interpreter's site-packages, as a plain
    # path: its editable-install hooks (.pth files) are not run there
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    project = tmp_path / "project"
    (project / "models").mkdir(parents=True)
    (project / "models" / "__init__.py").write_text("MINE = True\n")
    (project / "models" / "draft_head.py").write_text("WHOSE = 'the user'\n")
    code = (
        "import json, models, models.draft_head, ssd_jax\n"
        "from ssd_jax import Engine, SSDConfig, SamplingParams, load_model, rejection_sample\n"
        "from ssd_jax.models import draft_head as ours\n"
        "import ssd_jax.pallas_kernels as pk\n"
        "print(json.dumps({'user': models.draft_head.WHOSE, 'mine': models.MINE,\n"
        "  'ssd_jax': ssd_jax.__file__, 'ours': ours.__file__, 'pk': pk.__file__,\n"
        "  'engine': Engine.__module__}))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}
    done = subprocess.run([str(py), "-c", code], cwd=project, capture_output=True, text=True,
                          env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["user"] == "the user" and got["mine"] is True
    for key in ("ssd_jax", "ours", "pk"):
        assert got[key].startswith(site), got  # the installed copy, not this checkout
    assert got["engine"] == "ssd_jax.runtime.engine"
    done = subprocess.run([str(py), "-m", "ssd_jax", "--help"], cwd=project, capture_output=True,
                          text=True, env=env)
    assert done.returncode == 0 and "generate" in done.stdout, done.stderr[-2000:]
