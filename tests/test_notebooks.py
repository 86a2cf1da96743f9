"""Every notebook under notebooks/ runs top to bottom on tiny random models (SSD_JAX_REAL=0) in a
fresh kernel of this interpreter, without an error."""
import os
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[1] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_speculation_cache.ipynb",
            "03_saguaro_sampling.ipynb", "04_bring_your_own_model.ipynb"} <= names, names


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_on_tiny_models(path, tmp_path):
    nb = nbformat.read(path, as_version=4)
    first = next(c for c in nb.cells if c.cell_type == "code")
    assert 'REAL = os.environ.get("SSD_JAX_REAL", "0") == "1"' in first.source
    # JAX's persistent compile cache stays as the user has it (on by default): the tiny runs are
    # compile-bound, a warm cache makes a re-run several times faster
    env = dict(os.environ, SSD_JAX_REAL="0", JAX_PLATFORMS="cpu", MPLBACKEND="Agg",
               PYTHONPATH=os.pathsep.join([str(path.parents[1]), os.environ.get("PYTHONPATH", "")]))
    env.pop("XLA_FLAGS", None)
    # a kernelspec whose argv[0] is "python" (ipykernel's "python3") starts sys.executable
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute(env=env)  # raises CellExecutionError on the first failing cell
    errors = [o for c in nb.cells if c.cell_type == "code" for o in c.get("outputs", [])
              if o.get("output_type") == "error"]
    assert not errors, errors
