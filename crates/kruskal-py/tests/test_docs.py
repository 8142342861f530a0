"""Every Python snippet of the README and of docs/*.md runs as written.

Each ```python block is run on its own, in a fresh interpreter, from a
folder that has the repository's `data/` (the snippets name its files as
a reader in the repository root would). A block that reads the model
`kruskal cpd --out target/model` writes finds one there, made by the
package. A block that fails, or that names something it never defines,
fails its test; the snippets' own asserts check what they claim."""

import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import kruskal
from conftest import DATA, REPO

# Modules a snippet may use that the package does not need: without them
# the block is skipped (CI installs them all).
OPTIONAL = ("pyttb", "tensorly", "matplotlib", "scipy", "sparse")


def python_blocks():
    """(file:line, code) of every ```python block."""
    files = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
    out = []
    for path in files:
        text = path.read_text()
        for match in re.finditer(r"^```python\n(.*?)^```", text, flags=re.S | re.M):
            line = text[: match.start()].count("\n") + 1
            out.append((f"{path.relative_to(REPO)}:{line}", match.group(1)))
    return out


BLOCKS = python_blocks()


def test_the_docs_have_python_blocks():
    # README: the model files and the API; docs/python.md: three recipes and
    # the worked example.
    assert len(BLOCKS) >= 6, [where for where, _ in BLOCKS]


def write_model(folder):
    """A model where `kruskal cpd --out target/model` writes one."""
    subs = np.array([[0, 0, 0], [1, 2, 1], [2, 1, 0], [0, 2, 1]])
    X = kruskal.SparseTensor(subs, np.array([1.0, 2.0, 3.0, 4.0]), (3, 3, 2))
    m = kruskal.cp_als(X, rank=2, iters=5, progress=False)
    folder.mkdir(parents=True)
    np.save(folder / "lambda.npy", m.weights)
    for n, f in enumerate(m.factors, start=1):
        np.save(folder / f"mode-{n}.npy", f)


@pytest.mark.parametrize("where,code", BLOCKS, ids=[where for where, _ in BLOCKS])
def test_snippet_runs_as_written(where, code, tmp_path):
    (tmp_path / "data").symlink_to(DATA, target_is_directory=True)
    if "target/model/" in code:
        write_model(tmp_path / "target" / "model")
    env = dict(os.environ, MPLBACKEND="Agg")
    run = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=300)
    missing = re.search(r"No module named '([\w.]+)'", run.stderr)
    if run.returncode != 0 and missing and missing.group(1).split(".")[0] in OPTIONAL:
        pytest.skip(f"{where} needs {missing.group(1)}")
    assert run.returncode == 0, f"{where} failed:\n{code}\n{run.stderr[-3000:]}"
