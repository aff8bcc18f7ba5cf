# mpiexec -n 2 python mpi_examples/torch_backend.py [--steps 20]
"""torch's own DistributedDataParallel and ``torch.distributed`` calls, running on commlib.

``autograd_bridge.init_process_group()`` registers commlib as the ``torch.distributed`` backend
"commlib" and creates the default group from the MPI ranks (no MASTER_ADDR, no launcher other
than mpiexec). From then on, unmodified torch code works: here ``dist.all_reduce``,
``dist.broadcast`` and ``torch.nn.parallel.DistributedDataParallel`` fitting a linear model
whose data is split across the ranks.
"""

import argparse
import sys

import torch
import torch.distributed as dist

import autograd_bridge


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    torch.set_num_threads(1)
    autograd_bridge.init_process_group()
    rank, size = dist.get_rank(), dist.get_world_size()

    # Plain collectives: the sum of 1..P, and rank 0's tensor everywhere.
    total = torch.tensor([float(rank + 1)])
    dist.all_reduce(total)
    token = torch.tensor([rank * 10 + 7])
    dist.broadcast(token, src=0)
    collectives_ok = total.item() == size * (size + 1) / 2 and token.item() == 7

    # torch's DDP: every rank sees a different slice of y = 3x - 2 (+ noise) and they agree anyway.
    torch.manual_seed(rank)  # different initial weights: DDP broadcasts rank 0's at construction
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(1, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.linspace(-1, 1, 64 * size)[rank::size].unsqueeze(1)
    y = 3 * x - 2 + 0.01 * torch.randn_like(x)
    first_loss = None
    for _ in range(args.steps):
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        first_loss = loss.item() if first_loss is None else first_loss

    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    gathered = [torch.empty_like(weights) for _ in range(size)]
    dist.all_gather(gathered, weights)
    ranks_agree = all(torch.equal(g, gathered[0]) for g in gathered)
    learned = loss.item() < first_loss / 10
    if rank == 0:
        print(f"backend {dist.get_backend()!r}, {size} ranks: all_reduce/broadcast "
              f"{'ok' if collectives_ok else 'WRONG'}; DDP loss {first_loss:.4f} -> {loss.item():.4f}, "
              f"weight {weights[0]:.3f} bias {weights[1]:.3f}, identical on all ranks: {ranks_agree}")
    ok = collectives_ok and ranks_agree and learned
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
