"""The notebooks run top to bottom: their code cells are executed in order in one namespace.

Cells tagged ``parameters`` (the papermill convention) are followed by smaller values so
the run stays short on a CI CPU; everything else runs as written. Jupyter is not needed.
"""

import json
import os

import pytest

NOTEBOOKS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "notebooks")
FAST = {
    "quickstart.ipynb": {"MAX_NEW": 16},
    "speculative_generation.ipynb": {"MAX_NEW": 16},
    "train_draft.ipynb": {"STEPS": 20, "FILES": 4},
}
# A name the last cell defines: the run reached the end.
LAST = {"quickstart.ipynb": "positions", "speculative_generation.ipynb": "ablation", "train_draft.ipynb": "stats"}


def _code_cells(path):
    with open(path) as f:
        nb = json.load(f)
    assert nb["nbformat"] == 4
    for cell in nb["cells"]:
        assert cell["cell_type"] in ("code", "markdown", "raw")
        if cell["cell_type"] == "code":
            source = "".join(cell["source"])
            # Shell and magic lines (Colab installs) are not Python.
            lines = [line for line in source.splitlines() if not line.lstrip().startswith(("!", "%"))]
            yield "\n".join(lines), cell.get("metadata", {}).get("tags", [])


def test_every_notebook_is_listed():
    assert sorted(f for f in os.listdir(NOTEBOOKS) if f.endswith(".ipynb")) == sorted(FAST)


@pytest.mark.parametrize("name", sorted(FAST))
def test_notebook_runs_top_to_bottom(name):
    import matplotlib  # in the [test] extra: a missing install fails here, never skips

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    namespace = {"__name__": "__main__"}
    try:
        for i, (source, tags) in enumerate(_code_cells(os.path.join(NOTEBOOKS, name))):
            exec(compile(source, f"{name}[cell {i}]", "exec"), namespace)
            if "parameters" in tags:
                namespace.update(FAST[name])
    finally:
        plt.close("all")
    assert LAST[name] in namespace
