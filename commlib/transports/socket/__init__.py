"""The socket transport: TCP between ranks without MPI (torchrun, spawn), authenticated with the
job secret, under the transport contract (see :mod:`.transport`)."""

from commlib.transports.socket.options import SocketOptions, TLSFiles
from commlib.transports.socket.transport import SocketTransport, topology_of_hosts

__all__ = ["SocketTransport", "SocketOptions", "TLSFiles", "topology_of_hosts"]
