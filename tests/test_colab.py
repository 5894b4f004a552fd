"""Executes every notebook in colab/ top to bottom (one test per notebook).

A notebook whose stored outputs print `<a> after the warm start -> <b> after`
(quickstart's greedy accuracy) claims that RL learns: its stored outputs and a
fresh run must both show b > a.
"""

import pathlib
import re

import nbformat
import pytest
from nbclient import NotebookClient

ROOT = pathlib.Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted((ROOT / "colab").glob("*.ipynb"))
_LEARNS = re.compile(r"([0-9.]+) after the warm start -> ([0-9.]+) after")


def _text(nb: nbformat.NotebookNode) -> str:
  """The stdout of every code cell's outputs, concatenated."""
  return "".join(
    out.get("text", "")
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.get("outputs", [])
    if out.get("output_type") == "stream"
  )


def _accuracies(nb: nbformat.NotebookNode) -> list[tuple[float, float]]:
  return [(float(a), float(b)) for a, b in _LEARNS.findall(_text(nb))]


def test_quickstart_stored_outputs_show_learning():
  nb = nbformat.read(ROOT / "colab" / "quickstart.ipynb", as_version=4)
  ((start, end),) = _accuracies(nb)
  assert end > start, f"stored outputs: accuracy {start} after the warm start -> {end}"


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_runs_top_to_bottom(path):
  nb = nbformat.read(path, as_version=4)
  claims_learning = bool(_accuracies(nb))
  client = NotebookClient(
    nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT)}}
  )
  client.execute()  # raises CellExecutionError naming the failing cell
  errors = [
    out
    for cell in nb.cells
    if cell.cell_type == "code"
    for out in cell.get("outputs", [])
    if out.get("output_type") == "error"
  ]
  assert not errors, errors
  if claims_learning:
    ((start, end),) = _accuracies(nb)
    assert end > start, f"{path.name}: accuracy {start} after the warm start -> {end}"
