"""notebooks/explore_checkpoints.ipynb runs top to bottom against a freshly trained checkpoint."""

import os
from pathlib import Path

import pytest

from tests.helpers.runs import best_checkpoint

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "explore_checkpoints.ipynb"


def test_the_notebook_is_committed_without_outputs():
    nbformat = pytest.importorskip("nbformat")
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    code = [cell for cell in notebook.cells if cell.cell_type == "code"]
    assert code
    for cell in code:
        assert cell.outputs == [] and cell.execution_count is None, cell.source[:60]


@pytest.mark.parametrize("network", ["tutorial_alexnet", pytest.param("resnet18", marks=pytest.mark.slow)])
def test_the_notebook_runs_against_a_trained_checkpoint(network, request, monkeypatch):
    nbformat = pytest.importorskip("nbformat")
    nbclient = pytest.importorskip("nbclient")
    if network == "tutorial_alexnet":
        ckpt = best_checkpoint(request.getfixturevalue("trained_run"))
    else:  # another backbone's run: its network is rebuilt from what the checkpoint says
        ckpt = request.getfixturevalue("backbone_run")(network) / "checkpoints" / "last.ckpt"
    root = ckpt.parents[4]  # the folder the run was trained in: root/runs/flowers/version_0/checkpoints/
    # The kernel inherits these: the checkpoint to open, and where the run's relative paths resolve.
    monkeypatch.setenv("FLOWERS_CKPT", str(ckpt))
    monkeypatch.setenv("FLOWERS_ROOT", str(root))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(NOTEBOOK.parents[1]), os.environ.get("PYTHONPATH", "")]))
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    client = nbclient.NotebookClient(notebook, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": str(root)}})
    client.execute()  # raises CellExecutionError, naming the cell, on any error
    printed = "".join(out.get("text", "") for cell in notebook.cells for out in cell.get("outputs", []))
    assert str(ckpt) in printed and "val accuracy" in printed and "last.ckpt" in printed
