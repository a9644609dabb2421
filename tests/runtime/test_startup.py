"""startup: what a command does before its libraries are imported."""

from __future__ import annotations

import subprocess
import sys

import pytest
from conftest import REPO

# Imports Flax (whose nnx.reprlib asks IPython at import time) inside `without_ipython`, then
# IPython itself. On the path the test puts first, IPython is a package that says it ran.
PROBE = """
import sys
from fmnist_flax.runtime import startup
with startup.without_ipython():
    import flax.nnx
print("inside:", "IPython" in sys.modules and sys.modules["IPython"] is not None)
import IPython
"""


@pytest.mark.slow
def test_flax_imports_without_importing_ipython_and_ipython_imports_after(tmp_path):
    (tmp_path / "IPython").mkdir()
    (tmp_path / "IPython" / "__init__.py").write_text(
        "print('IPython imported')\ndef get_ipython():\n    return None\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", PROBE],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={"PYTHONPATH": f"{tmp_path}:{REPO}", "JAX_PLATFORMS": "cpu"},
        check=True,
    )
    assert result.stdout.splitlines() == ["inside: False", "IPython imported"]
