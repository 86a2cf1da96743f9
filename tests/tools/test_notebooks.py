"""Every notebook under notebooks/ runs top to bottom on tiny random models (SSD_JAX_REAL=0) in a
fresh kernel of this interpreter, without an error, and prints real figures where its markdown
promises them (`CHECKS`: phase times above zero, a prediction, verdicts that follow from the
printed intervals)."""
import os
import re
from pathlib import Path

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")
pytest.importorskip("ipykernel")
pytest.importorskip("matplotlib")

NOTEBOOKS = sorted((Path(__file__).resolve().parents[2] / "notebooks").glob("*.ipynb"))


def test_notebooks_exist():
    names = {p.name for p in NOTEBOOKS}
    assert {"01_quickstart.ipynb", "02_speculation_cache.ipynb",
            "03_saguaro_sampling.ipynb", "04_bring_your_own_model.ipynb"} <= names, names


def test_the_notebooks_extra_serves_the_readmes_commands():
    """Every `jupyter <command>` notebooks/README.md tells a user to run is installed by
    `pip install -e ".[notebooks]"` (it named nbconvert, which the extra lacked)."""
    import tomllib
    root = Path(__file__).resolve().parents[2]
    extra = tomllib.loads((root / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["notebooks"]
    names = {re.split(r"[<>=!~\[ ]", req, maxsplit=1)[0].lower() for req in extra}
    commands = set(re.findall(r"\bjupyter (\w+)", (root / "notebooks" / "README.md").read_text()))
    package = {"lab": "jupyterlab", "nbconvert": "nbconvert", "notebook": "notebook",
               "execute": "nbclient"}
    assert commands and commands <= package.keys(), commands
    assert {package[c] for c in commands} <= names, (commands, names)


def _printed(nb) -> str:
    """Everything the executed notebook's code cells printed."""
    return "".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                   for o in c.get("outputs", []) if o.get("output_type") == "stream")


def _quickstart(text: str) -> None:
    """01 promises SSD's predicted speed-up and a colocated round's verify and tree seconds."""
    assert "no prediction" not in text, text
    pred = re.search(r"predicted by ALGORITHM.md §6 from this run's measured times and rates: "
                     r"([\d.]+)x", text)
    assert pred and float(pred.group(1)) > 0, text
    phases = re.search(r"verify ([\d.]+) s, tree ([\d.]+) s", text)
    assert phases and float(phases.group(1)) > 0 and float(phases.group(2)) > 0, text


def _saguaro(text: str) -> None:
    """03 prints each setting's tree seconds a round and, per temperature, a verdict on C = 1 against
    the lowest C that must follow from the intervals it prints beside it."""
    trees = [float(t) for t in re.findall(r"tree ([\d.]+) s/round", text)]
    assert len(trees) >= 6 and min(trees) > 0, text
    pairs = re.findall(r"tree ([\d.]+) vs ([\d.]+) s/round", text)
    assert pairs and all(float(a) > 0 and float(b) > 0 for a, b in pairs), text
    verdicts = re.findall(r"\[([\d.]+), ([\d.]+)\] at C = 1 vs [\d.]+ \[([\d.]+), ([\d.]+)\] "
                          r"at C = [\d.]+: (the intervals overlap|(?:higher|lower) at C)", text)
    assert len(verdicts) == 4, text  # hit rate and acceptance at two temperatures
    for lo1, hi1, lo2, hi2, verdict in verdicts:
        lo1, hi1, lo2, hi2 = map(float, (lo1, hi1, lo2, hi2))
        gap = max(lo1, lo2) - min(hi1, hi2)  # > 0: apart (printed to 2 decimals: 0.01 of slack)
        if abs(gap) > 0.01:
            assert (verdict == "the intervals overlap") == (gap < 0), (verdict, lo1, hi1, lo2, hi2)


CHECKS = {"01_quickstart": _quickstart, "03_saguaro_sampling": _saguaro}


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
    if path.stem in CHECKS:
        CHECKS[path.stem](_printed(nb))
