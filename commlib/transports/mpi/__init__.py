"""The MPI transport: point-to-point transfers between ranks of one communicator
(:mod:`.transport`), the library's own collectives (:mod:`.natives`), their small-message fast
path (:mod:`.fast_path`) and the dtype/op tables (:mod:`.types`).
"""

from commlib.transports.mpi.transport import MPITransport, as_bytes

__all__ = ["MPITransport", "as_bytes"]
