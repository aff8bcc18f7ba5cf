"""The rendezvous and the socket transport import only what lies below them (every import, also
those inside functions): finding each other comes before moving bytes, and a transport never
borrows from the layers above it."""

import ast
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
ALLOWED = {
    "commlib/rendezvous": ("commlib.errors", "commlib.config", "commlib.platform", "commlib.rendezvous", "mpi4py"),
    "commlib/transports/socket": ("commlib.errors", "commlib.ops", "commlib.topology", "commlib.platform",
                                  "commlib.rendezvous", "commlib.shm", "commlib.reliability",
                                  "commlib.transports.interface", "commlib.transports.socket", "commlib.units",
                                  "numpy"),
}


def imports(path):
    tree = ast.parse(path.read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                raise AssertionError(f"{path}: relative import (the codebase imports absolutely)")
            yield node.module


@pytest.mark.parametrize("folder", sorted(ALLOWED))
def test_imports_point_down_only(folder):
    files = sorted((ROOT / folder).glob("*.py"))
    assert files
    bad = []
    for path in files:
        for name in imports(path):
            top = name.split(".")[0]
            if top in sys.stdlib_module_names or top == "__future__":
                continue
            if not any(name == allowed or name.startswith(allowed + ".") for allowed in ALLOWED[folder]):
                bad.append(f"{path.relative_to(ROOT)} imports {name}")
    assert not bad, bad


def test_importing_the_socket_transport_needs_neither_torch_nor_mpi_initialized():
    import subprocess

    code = ("import sys, commlib.transports.socket, commlib.rendezvous; "
            "bad = [m for m in ('torch', 'cupy') if m in sys.modules]; print(bad)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                            env={"PATH": "/usr/bin:/bin", "MPI4PY_RC_INITIALIZE": "0"}, cwd=ROOT)
    assert result.returncode == 0 and result.stdout.strip() == "[]", result.stderr
