"""experiments/notebooks/quickstart.ipynb runs top to bottom (on tiny settings) in a kernel.

Like papermill, the test inserts a cell after the one tagged `parameters` that overrides
its values; everything else runs as a reader would run it.
"""

import ast
import pathlib
import time

import nbformat
import pytest
from nbclient import NotebookClient

NOTEBOOK = pathlib.Path(__file__).resolve().parent.parent / "experiments" / "notebooks" / "quickstart.ipynb"
TINY = dict(WARM_START_STEPS=3, WARM_START_BATCH=8, GRPO_STEPS=2, PROMPTS_PER_STEP=2,
            GROUP_SIZE=4, EVAL_SIZE=8, PASS_AT_K_SAMPLES=2)


def parameters_cell(notebook) -> int:
  tagged = [i for i, c in enumerate(notebook.cells) if "parameters" in c.metadata.get("tags", [])]
  assert len(tagged) == 1, "the notebook needs exactly one cell tagged 'parameters'"
  return tagged[0]


@pytest.mark.slow
def test_quickstart_executes_on_tiny_settings(tmp_path):
  notebook = nbformat.read(NOTEBOOK, as_version=4)
  assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code"), (
      "commit the notebook without outputs")
  index = parameters_cell(notebook)
  names = {t.id for node in ast.parse(notebook.cells[index].source).body
           if isinstance(node, ast.Assign) for t in node.targets}
  overrides = dict(TINY, WORKDIR=str(tmp_path))
  assert set(overrides) <= names, f"not parameters of the notebook: {set(overrides) - names}"
  notebook.cells.insert(index + 1, nbformat.v4.new_code_cell(
      "\n".join(f"{name} = {value!r}" for name, value in overrides.items())))

  client = NotebookClient(notebook, timeout=900, kernel_name="python3",
                          resources={"metadata": {"path": str(NOTEBOOK.parent)}})
  started = time.perf_counter()
  client.execute()  # raises CellExecutionError, with the cell and traceback, on any error
  print(f"quickstart.ipynb on tiny settings: {time.perf_counter() - started:.1f} s")

  outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
  assert sum("image/png" in o.get("data", {}) for o in outputs) >= 2  # the inline curves
  assert any("| step | task |" in o.get("data", {}).get("text/markdown", "") for o in outputs)
  assert (tmp_path / "plot.png").exists() and (tmp_path / "eval" / "eval.json").exists()
  assert list(tmp_path.glob("events.out.tfevents.*"))
