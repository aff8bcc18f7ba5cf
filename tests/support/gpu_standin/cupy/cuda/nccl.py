"""One-rank stand-in for cupy.cuda.nccl: same method signatures as nccl.pyx; copies bytes on the host."""
import ctypes
import os
available = True
NCCL_INT8, NCCL_UINT8, NCCL_INT32, NCCL_UINT32, NCCL_INT64, NCCL_UINT64 = 0, 1, 2, 3, 4, 5
NCCL_FLOAT16, NCCL_FLOAT32, NCCL_FLOAT64 = 6, 7, 8
NCCL_SUM, NCCL_PROD, NCCL_MAX, NCCL_MIN = 0, 1, 2, 3
SIZES = {0: 1, 1: 1, 2: 4, 3: 4, 4: 8, 5: 8, 6: 2, 7: 4, 8: 8}
class NcclError(RuntimeError): pass
def get_version(): return 22805
def get_unique_id(): return bytes(os.urandom(128))
_group = []
_in_group = [0]
def groupStart(): _in_group[0] += 1
def groupEnd():
    _in_group[0] -= 1
    if _in_group[0] == 0:
        sends = [g for g in _group if g[0] == "send"]; recvs = [g for g in _group if g[0] == "recv"]
        assert len(sends) == len(recvs), (sends, recvs)
        for (_, sp, sc, sd, speer), (_, rp, rc, rd, rpeer) in zip(sends, recvs):
            assert sc == rc and sd == rd and speer == 0 == rpeer
            ctypes.memmove(rp, sp, sc * SIZES[sd])
        _group.clear()
class NcclCommunicator:
    def __init__(self, ndev, commId, rank):
        assert ndev == 1 and rank == 0 and len(commId) == 128
        self.calls = []
    def _copy(self, s, r, n, dt):
        if s != r: ctypes.memmove(r, s, n * SIZES[dt])
    def allReduce(self, sendbuf, recvbuf, count, datatype, op, stream):
        assert isinstance(stream, int); self._copy(sendbuf, recvbuf, count, datatype)
    def reduce(self, sendbuf, recvbuf, count, datatype, op, root, stream):
        assert root == 0; self._copy(sendbuf, recvbuf, count, datatype)
    def broadcast(self, sendbuff, recvbuff, count, datatype, root, stream):
        self._copy(sendbuff, recvbuff, count, datatype)
    def reduceScatter(self, sendbuf, recvbuf, recvcount, datatype, op, stream):
        self._copy(sendbuf, recvbuf, recvcount, datatype)
    def allGather(self, sendbuf, recvbuf, count, datatype, stream):
        self._copy(sendbuf, recvbuf, count, datatype)
    def send(self, sendbuf, count, datatype, peer, stream):
        assert _in_group[0]; _group.append(("send", sendbuf, count, datatype, peer))
    def recv(self, recvbuf, count, datatype, peer, stream):
        assert _in_group[0]; _group.append(("recv", recvbuf, count, datatype, peer))
    def abort(self): self.aborted = True
    def destroy(self): self.destroyed = True
