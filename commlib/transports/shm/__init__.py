"""The shared-memory transport: the ranks of one host read each other's memory directly."""

from commlib.transports.shm.layout import SegmentLayout
from commlib.transports.shm.transport import SharedMemoryTransport

__all__ = ["SharedMemoryTransport", "SegmentLayout"]
