"""commlib on GPU: collectives on CuPy arrays over NCCL, or host-staged over MPI.

Importing this package needs neither CuPy nor CUDA; the backend imports CuPy on the first GPU
collective of a group. See :mod:`commlib.gpu.backend` for the ordering and stream semantics. The
GPU transports themselves are with the others: :mod:`commlib.transports.nccl` and
:mod:`commlib.transports.host_staged`.
"""

from commlib.gpu.backend import GpuBackend, attach, configured_transport
from commlib.gpu.preflight import GpuSetupError

__all__ = ["GpuBackend", "attach", "configured_transport", "GpuSetupError"]
