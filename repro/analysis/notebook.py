"""Execute the analysis notebooks headless with nbclient, papermill-style parameter injection.

The first cell of each notebook is tagged `parameters`; the runner inserts a cell after it that
assigns the caller's values (tagged `injected-parameters`), then executes every cell in
the notebook's own folder. A failing cell raises NotebookError naming the notebook and the cell.
"""

from __future__ import annotations

from pathlib import Path

from repro.tracking.store import project_root

NOTEBOOKS = ("scaling", "zero_shot", "bert")
TABLES = {"scaling": ("scaling_table.md", "scaling_appendix_d.md", "scaling_baseline.md"), "zero_shot": ("zero_shot_table.md", "gpt2_table2.md"),
          "bert": ("bert_table.md",)}
FIGURES = {"scaling": ("fig_scaling.png",), "zero_shot": ("fig6_valid_ppl.png",), "bert": ("fig7_layernorm_order.png",)}


class NotebookError(RuntimeError):
    """A notebook cell failed; the message names the notebook, the cell and the error."""


def notebook_path(name: str) -> Path:
    """analysis/<name>.ipynb of the repository."""
    return project_root() / "analysis" / f"{name}.ipynb"


def inject_parameters(nb, params: dict) -> None:
    """Insert a cell assigning `params` right after the cell tagged `parameters` (else at the top)."""
    import nbformat

    source = "# Injected by repro report\n" + "\n".join(f"{k} = {v!r}" for k, v in params.items())
    cell = nbformat.v4.new_code_cell(source, metadata={"tags": ["injected-parameters"]})
    tagged = [i for i, c in enumerate(nb.cells) if "parameters" in c.get("metadata", {}).get("tags", [])]
    nb.cells.insert(tagged[0] + 1 if tagged else 0, cell)


def execute(path: Path, params: dict, timeout: int = 900, failed_copy: Path | None = None):
    """Run every cell of the notebook at `path` with `params` injected; returns the executed notebook."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    if not path.exists():
        raise NotebookError(f"notebook {path} does not exist")
    nb = nbformat.read(path, as_version=4)
    inject_parameters(nb, params)
    client = NotebookClient(nb, timeout=timeout, kernel_name="python3",
                            resources={"metadata": {"path": str(path.parent)}})
    try:
        client.execute()
    except CellExecutionError as err:
        where = _keep_failed(nb, failed_copy) if failed_copy else ""
        raise NotebookError(f"{path.name} failed{where}:\n{str(err).strip()[-2000:]}") from None
    return nb


def _keep_failed(nb, failed_copy: Path) -> str:
    """Write the failed notebook's executed copy; the error's note on where it is, or why it is not
    (the cell's error stays the news)."""
    import nbformat

    try:
        failed_copy.parent.mkdir(parents=True, exist_ok=True)
        nbformat.write(nb, failed_copy)
    except OSError as err:
        return f" (its executed copy could not be written to {failed_copy}: {err})"
    return f" (executed copy: {failed_copy})"
