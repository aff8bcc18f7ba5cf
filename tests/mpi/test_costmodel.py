"""The cost model's fit under mpiexec writes a model that predict reads (the model itself:
tests/unit/test_costmodel.py)."""

import subprocess
import sys

import pytest

from commlib.costmodel import CostModel, formulas
from tests.support.mpirun import ROOT, mpiexec_path
from tests.unit.test_costmodel import run_cli


@pytest.mark.mpi
def test_fit_under_mpiexec_writes_a_model_predict_reads(tmp_path):
    out = tmp_path / "fitted.json"
    result = subprocess.run([mpiexec_path(), "-n", "2", sys.executable, "-m", "commlib.costmodel", "fit",
                             "--out", str(out), "--repeats", "3"], cwd=str(ROOT), capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    model = CostModel.load(out)
    assert model.fitted_on["hosts"] == 1 and model.fitted_on["ranks_per_host"] == [2]
    assert model.links.alpha_intra > 0 and model.links.gamma > 0
    # beta is the slope between the two largest sizes' medians (commlib/costmodel/fit.py): on a
    # loaded machine the larger can measure faster, and the fit floors the slope at 0.
    assert model.links.beta_intra >= 0
    assert set(model.samples["intra"]) == {"8", "1024", "65536", "1048576", "4194304"}
    assert set(model.samples["calls_8B"]) == set(formulas.FORMULAS)
    assert {name for name, _ in model.links.call_overhead} == set(formulas.FORMULAS) - {"native"}
    assert model.links.native_alpha == model.samples["calls_8B"]["native"]
    assert "intra: alpha" in result.stdout
    assert run_cli("predict", "--model", out, "--hosts", 2, "--ranks-per-host", 2, "--bytes", "1M").returncode == 0
