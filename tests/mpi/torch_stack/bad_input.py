"""What the backend cannot do is refused on every rank, before anything is sent.

Each case is a call every rank makes alike (through ``torch.distributed``, or through the group
object where torch's own front end would refuse first): an op a dtype cannot be reduced with, a
dtype with no arithmetic, a device or layout the backend does not serve. Each must raise
``InvalidUsageError`` naming the collective's op, the dtype and the device; the tensors must be
untouched (same bits), and the group must still work afterwards (nothing was half sent).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllreduceOptions, ReduceOptions, ReduceScatterOptions

from commlib import InvalidUsageError
from tests.mpi.torch_stack.common import same_bits

RED = dist.ReduceOp


def _opts(kind, op):
    opts = kind()
    opts.reduceOp = op
    return opts


def _cases(world):
    """name -> (tensors the call may touch, the call, words the error must contain)."""
    complex_t = torch.randn(6, dtype=torch.complex64)
    ints, floats, flags = torch.arange(6, dtype=torch.int32), torch.randn(6), torch.tensor([True, False])
    eight = torch.randn(6).to(torch.float8_e4m3fn)
    meta = torch.empty(6, device="meta")
    sparse = torch.sparse_coo_tensor(torch.tensor([[0, 2]]), torch.ones(2), (6,))
    csr = torch.eye(3).to_sparse_csr()
    quantized = torch.quantize_per_tensor(torch.randn(6), 0.1, 0, torch.qint8)
    out = torch.zeros(3)
    int_out, int_in = torch.zeros(3, dtype=torch.int32), torch.arange(3 * world.size(), dtype=torch.int32)
    premul = dist._make_nccl_premul_sum(0.5)
    return {
        "MIN on complex": ([complex_t], lambda: world.allreduce([complex_t], _opts(AllreduceOptions, RED.MIN)),
                           ("MIN", "complex64", "cpu")),
        "PRODUCT on complex": ([complex_t], lambda: world.allreduce([complex_t], _opts(AllreduceOptions, RED.PRODUCT)),
                               ("PRODUCT", "complex64", "cpu")),
        "AVG on int32": ([ints], lambda: dist.all_reduce(ints, op=RED.AVG), ("AVG", "int32", "cpu")),
        "AVG on bool": ([flags], lambda: dist.all_reduce(flags, op=RED.AVG), ("AVG", "bool", "cpu")),
        "BAND on float32": ([floats], lambda: dist.all_reduce(floats, op=RED.BAND), ("BAND", "float32", "cpu")),
        "SUM on float8": ([eight], lambda: dist.all_reduce(eight), ("SUM", "float8_e4m3fn", "cpu")),
        "async SUM on float8": ([eight], lambda: dist.all_reduce(eight, async_op=True),
                                ("SUM", "float8_e4m3fn", "cpu")),
        "PREMUL_SUM on int32": ([ints], lambda: world.allreduce([ints], _opts(AllreduceOptions, premul)),
                                ("PREMUL_SUM", "int32", "cpu")),
        "reduce with BOR": ([ints], lambda: world.reduce([ints], _opts(ReduceOptions, RED.BOR)),
                            ("BOR", "int32", "cpu")),
        "reduce_scatter with BXOR": ([int_out, int_in], lambda: world.reduce_scatter_single(
            int_out, int_in, _opts(ReduceScatterOptions, RED.BXOR)), ("BXOR", "int32", "cpu")),
        "all_reduce on meta": ([], lambda: dist.all_reduce(meta), ("all_reduce", "float32", "meta")),
        "broadcast on meta": ([], lambda: dist.broadcast(meta, src=0), ("broadcast", "float32", "meta")),
        "all_gather of a sparse input": ([out], lambda: world.all_gather_single(out, sparse),
                                         ("all_gather", "sparse_coo", "float32", "cpu")),
        "sparse all_reduce with MAX": ([sparse], lambda: dist.all_reduce(sparse, op=RED.MAX),
                                       ("MAX", "float32", "cpu")),
        "all_reduce of a sparse CSR tensor": ([csr], lambda: world.allreduce([csr], AllreduceOptions()),
                                              ("all_reduce", "sparse_csr", "float32", "cpu")),
        "all_reduce of a quantized tensor": ([], lambda: world.allreduce([quantized], AllreduceOptions()),
                                             ("all_reduce", "qint8", "cpu")),
    }


def _bits(tensor):
    return tensor.view(torch.uint8) if tensor.dtype.itemsize == 1 else tensor


def check_bad_input(checker):
    world = dist.group.WORLD
    before = world.commlib_group.seq
    for name, (touched, call, words) in _cases(world).items():
        copies = [t.clone() for t in touched]
        error = checker.raises(InvalidUsageError, call, f"bad input: {name}")
        if error is not None:
            missing = [word for word in words if word not in str(error)]
            checker.check(not missing, lambda name=name, missing=missing, error=error:
                          f"bad input: {name}: {missing} not in the error: {error}")
        for index, (tensor, copy) in enumerate(zip(touched, copies)):
            what = f"bad input: {name}: tensor {index}"
            if tensor.layout is torch.strided:
                same_bits(checker, _bits(tensor), _bits(copy), what)
            else:
                checker.check(torch.equal(tensor.to_dense(), copy.to_dense()), f"{what} changed")
    checker.check(world.commlib_group.seq == before,
                  lambda: f"bad input: {world.commlib_group.seq - before} collectives ran for refused calls")
    after = torch.ones(4)
    dist.all_reduce(after)
    expected = torch.full((4,), float(dist.get_world_size()))
    checker.equal(after.numpy(), expected.numpy(), "all_reduce after the refusals")
