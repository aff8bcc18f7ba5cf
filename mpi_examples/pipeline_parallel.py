# mpiexec -n 2 python mpi_examples/pipeline_parallel.py [--steps 20 --microbatches 4]
"""Two-stage pipeline parallelism with point-to-point messages on the "commlib" torch backend.

Rank 0 holds the first half of an MLP, rank 1 the second half and the loss. Each step cuts the
batch into microbatches (GPipe): rank 0 runs every microbatch forward and ``isend``s the
activations; rank 1 receives each one, finishes forward and backward, and sends the gradient of
the activations back; rank 0 runs its backward with it. Messages carry the microbatch number as
their tag. Point-to-point runs on a communicator of its own, so it never gets in the way of the
collectives. At the end rank 1 sends its parameters to rank 0, which checks that the two stages
equal the same model trained in one process.
"""

import argparse

import torch
import torch.distributed as dist

import autograd_bridge

WIDTHS = (32, 64, 64, 10)


def model():
    torch.manual_seed(0)
    layers = [torch.nn.Linear(WIDTHS[0], WIDTHS[1]), torch.nn.ReLU(), torch.nn.Linear(WIDTHS[1], WIDTHS[2]),
              torch.nn.ReLU(), torch.nn.Linear(WIDTHS[2], WIDTHS[3])]
    return torch.nn.Sequential(torch.nn.Sequential(*layers[:2]), torch.nn.Sequential(*layers[2:]))


def batches(steps, microbatches, size=8):
    data = torch.Generator().manual_seed(1)
    return [[(torch.randn(size, WIDTHS[0], generator=data), torch.randint(0, WIDTHS[3], (size,), generator=data))
             for _ in range(microbatches)] for _ in range(steps)]


def train_stage(rank, stage, steps):
    optimizer = torch.optim.SGD(stage.parameters(), lr=0.05)
    for step in steps:
        optimizer.zero_grad()
        if rank == 0:
            outputs = [stage(x) for x, _ in step]
            sends = [dist.isend(out.detach(), 1, tag=k) for k, out in enumerate(outputs)]
            for k, out in enumerate(outputs):
                grad = torch.empty_like(out)
                dist.recv(grad, 1, tag=k)
                out.backward(grad)
            for work in sends:
                work.wait()
        else:
            for k, (_, labels) in enumerate(step):
                activation = torch.empty(labels.shape[0], WIDTHS[1])
                dist.recv(activation, 0, tag=k)
                activation.requires_grad_()
                loss = torch.nn.functional.cross_entropy(stage(activation), labels) / len(step)
                loss.backward()
                dist.send(activation.grad, 0, tag=k)
        optimizer.step()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--microbatches", type=int, default=4)
    args = parser.parse_args()
    torch.set_num_threads(1)
    autograd_bridge.init_process_group()
    rank = dist.get_rank()
    steps = batches(args.steps, args.microbatches)
    if rank < 2:
        stage = model()[rank]
        train_stage(rank, stage, steps)
        second = [p.detach().clone() for p in model()[1].parameters()]  # rank 1's, sent to rank 0
        for index, buf in enumerate(second):
            if rank == 1:
                dist.send(list(stage.parameters())[index].detach(), 0)
            else:
                dist.recv(buf, 1)
    if rank == 0:
        reference = model()  # the whole model, one process, the same microbatches
        optimizer = torch.optim.SGD(reference.parameters(), lr=0.05)
        for step in steps:
            optimizer.zero_grad()
            for x, labels in step:
                (torch.nn.functional.cross_entropy(reference(x), labels) / len(step)).backward()
            optimizer.step()
        trained = list(stage.parameters()) + second
        same = all(torch.equal(a, b) for a, b in zip(trained, reference.parameters()))
        print(f"pipeline of 2 stages, {args.steps} steps of {args.microbatches} microbatches: "
              f"same parameters as one process: {same}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
