# mpiexec -n 2 python mpi_examples/fsdp_transformer.py [--backend gloo] [--steps 30]
"""A small transformer language model trained with torch's FSDP2 on the "commlib" backend.

``autograd_bridge.init_process_group()`` makes commlib the default ``torch.distributed``
backend from the MPI ranks; from then on this is plain torch: a DeviceMesh over the ranks,
``fully_shard`` on every transformer block and at the root (each rank keeps 1/P of every
parameter and of its Adam state; the blocks' parameters are all-gathered for forward and
backward, their gradients reduce-scattered), and a training loop. ``--backend gloo`` runs the
same script on gloo: at P=2 the two print the same parameter digest (a sum of two floats does
not depend on its order).

The data is a toy language every rank samples differently: counting sequences (each token is
the previous one plus a per-sequence stride), which the model learns to continue.
"""

import argparse
import gc
import hashlib
import time

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

import autograd_bridge
import commlib
from autograd_bridge.backend.rendezvous import rendezvous_store


class LanguageModel(torch.nn.Module):
    def __init__(self, vocab, dim, layers, heads, context):
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, dim)
        self.position = torch.nn.Parameter(torch.randn(context, dim) * 0.02)
        self.blocks = torch.nn.ModuleList(
            torch.nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.norm = torch.nn.LayerNorm(dim)
        self.head = torch.nn.Linear(dim, vocab)
        self.register_buffer("causal", torch.nn.Transformer.generate_square_subsequent_mask(context))

    def forward(self, tokens):
        x = self.embed(tokens) + self.position[:tokens.shape[1]]
        for block in self.blocks:
            x = block(x, src_mask=self.causal[:tokens.shape[1], :tokens.shape[1]], is_causal=True)
        return self.head(self.norm(x))


def counting_batch(generator, batch, context, vocab):
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 4, (batch, 1), generator=generator)
    tokens = (start + stride * torch.arange(context + 1)) % vocab
    return tokens[:, :-1], tokens[:, 1:]


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=("commlib", "gloo"), default="commlib")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.backend == "commlib":
        autograd_bridge.init_process_group()
    else:  # the same MPI ranks, torch's gloo
        world = commlib.init()
        dist.init_process_group("gloo", store=rendezvous_store(), rank=world.rank, world_size=world.size)
    rank, size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (size,))

    vocab, context = 64, 32
    torch.manual_seed(0)  # the same initial model everywhere
    model = LanguageModel(vocab, args.dim, args.layers, heads=4, context=context)
    for block in model.blocks:
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    data = torch.Generator().manual_seed(1000 + rank)

    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        inputs, targets = counting_batch(data, 8, context, vocab)
        loss = torch.nn.functional.cross_entropy(model(inputs).reshape(-1, vocab), targets.reshape(-1))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        average = loss.detach().clone()
        dist.all_reduce(average)
        average /= size
        if rank == 0 and (step == 1 or step % 10 == 0 or step == args.steps):
            print(f"step {step:3d}  loss {average.item():.4f}", flush=True)
    elapsed = (time.perf_counter() - started) / args.steps

    digest = hashlib.sha256()
    for parameter in model.parameters():  # full_tensor(): an all-gather of the shards
        digest.update(parameter.full_tensor().detach().numpy().tobytes())
    if rank == 0:
        parameters = sum(p.numel() for p in model.parameters())
        print(f"{args.backend}: {parameters} parameters sharded over {size} ranks, {elapsed * 1e3:.1f} ms per step",
              flush=True)
        print(f"parameters sha256 {digest.hexdigest()}", flush=True)
    # Every rank done, and nothing left that holds a collective's tensors: gloo's worker threads
    # must not free Python objects while the interpreter shuts down (torch aborts then, rarely:
    # "terminate called without an active exception").
    dist.barrier()
    del model, optimizer, mesh
    gc.collect()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
