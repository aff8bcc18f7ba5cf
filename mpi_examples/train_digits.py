# mpiexec -n 2 python mpi_examples/train_digits.py [--sync ddp|powersgd|localsgd|partial|diloco|...] [--epochs 10]
"""Train a small CNN on scikit-learn's 8x8 handwritten digits with our DDP, data sharded by rank.

Prints accuracy, time, bytes per step. ``--sync``: DDP, PowerSGD, local SGD, partial sync, DiLoCo, streaming DiLoCo
or DES-LOC (H = ``--period``) after ``--start`` steps of DDP (one epoch); ``--trace``; ``--checkpoint/--resume``: exact.
"""

import argparse
import contextlib
import hashlib
import os
import sys
import time

import numpy as np
import torch
from sklearn.datasets import load_digits
from torch import nn
from tqdm import tqdm

import commlib
from ddp import DistributedDataParallel as DDP
from ddp.averaging import PartialModelAverager, PeriodicModelAverager, average_parameters
from ddp.hooks import PostLocalSGDState, PowerSGDState, post_localSGD_hook, powerSGD_hook
from ddp.low_communication import METHODS, low_communication
from ddp.optim import PostLocalSGDOptimizer
from ddp.sampler import DistributedSampler
from ddp.tracing import NullTracer, Tracer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--epochs", 10), ("--batch-size", 32), ("--seed", 0), ("--period", 8), ("--rank", 4),
                          ("--start", None)):  # per rank; PowerSGD's rank (README); steps of DDP (default one epoch)
        p.add_argument(flag, type=int, default=default)
    p.add_argument("--sync", default="ddp", choices=["ddp", "powersgd", "localsgd", "partial", *METHODS])
    p.add_argument("--algorithm", default="auto", help=f"allreduce: auto or one of {commlib.algorithms()}")
    p.add_argument("--bucket-cap-mb", type=float, default=0.05, help="small: this small model gets 3 buckets")
    p.add_argument("--trace", help="write a Chrome/Perfetto trace of all ranks to this file")
    p.add_argument("--checkpoint", help="save model and optimizer here after every epoch")
    p.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (logs, tests)")
    args = p.parse_args(argv)
    if args.resume and not (args.checkpoint and os.path.exists(args.checkpoint)):
        p.error(f"--resume needs an existing --checkpoint file, got {args.checkpoint!r}")
    return args


def digits_split(test_samples=360):
    digits = load_digits()  # 1797 images, shipped inside scikit-learn: no download
    images, labels = torch.tensor(digits.images / 16.0, dtype=torch.float32).unsqueeze(1), torch.tensor(digits.target)
    order = torch.randperm(len(images), generator=torch.Generator().manual_seed(1797))  # same split on every rank
    test, train = order[:test_samples], order[test_samples:]
    return images[train], labels[train], images[test], labels[test]


@torch.no_grad()
def accuracy(net, images, labels, pg):
    mine = slice(pg.rank, None, pg.size)  # each rank scores every P-th test sample; the counts are summed
    counts = np.array([(net(images[mine]).argmax(1) == labels[mine]).sum().item(), len(labels[mine])])
    pg.allreduce(counts)
    return float(counts[0] / counts[1])


def efficient_sync(args, model, optimizer, start):  # the --sync method: a comm hook, an averager, DiLoCo or DES-LOC
    if args.sync == "ddp":
        return None, optimizer, None
    if args.sync == "powersgd":
        hook = PowerSGDState(None, matrix_approximation_rank=args.rank, start_powerSGD_iter=start)
        model.register_comm_hook(hook, powerSGD_hook)
        return hook, optimizer, None
    if args.sync in METHODS:  # the papers' settings around AdamW (DiLoCo's inner optimizer, an Adam for DES-LOC);
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3)  # they give DDP the post-local SGD hook themselves
        return (method := low_communication(args.sync, model, inner, args.period, warmup_steps=start)), inner, method
    hook = PostLocalSGDState(None, None, start_localSGD_iter=start, post_local_gradient_allreduce=False)
    model.register_comm_hook(hook, post_localSGD_hook)
    averager = (PeriodicModelAverager if args.sync == "localsgd" else PartialModelAverager)(args.period, start)
    return hook, PostLocalSGDOptimizer(optimizer, averager), averager


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    pg = commlib.init()
    tracer = Tracer(pg) if args.trace else NullTracer()
    x_train, y_train, x_test, y_test = digits_split()
    torch.manual_seed(args.seed)
    net = nn.Sequential(nn.Conv2d(1, 32, 3, padding=1), nn.ReLU(), nn.Conv2d(32, 64, 3, padding=1), nn.ReLU(),
                        nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * 4 * 4, 128), nn.ReLU(), nn.Linear(128, 10))
    model = DDP(net, bucket_cap_mb=args.bucket_cap_mb, first_bucket_cap_mb=args.bucket_cap_mb / 4,
                algorithm=args.algorithm, tracer=tracer if args.trace else None)
    sampler = DistributedSampler(len(y_train), process_group=pg, shuffle=True, seed=args.seed)
    sgd, warmup = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), -(-sampler.num_samples // args.batch_size)
    hook, optimizer, averager = efficient_sync(args, model, sgd, warmup if args.start is None else args.start)
    path = args.checkpoint if pg.rank == 0 else f"{args.checkpoint}.rank{pg.rank}"  # local steps: ranks differ
    state = torch.load(path, weights_only=False) if args.resume else {"epoch": 0, "step": 0, "sent": 0}
    if args.resume:  # the sampler's order depends only on (seed, epoch): nothing else to restore
        model.module.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        hook.load_state_dict(state["hook"]) if hook else None
    step, sent, per_step = state["step"], state["sent"], []  # bytes handed to collectives; (s, allreduce s, hidden s)
    with averager if args.sync in METHODS else contextlib.nullcontext():  # DiLoCo, DES-LOC: around the loop
        for epoch in range(state["epoch"], args.epochs):
            sampler.set_epoch(epoch)
            batches = torch.from_numpy(sampler.indices()).split(args.batch_size)
            bar = tqdm(batches, desc=f"epoch {epoch + 1}/{args.epochs}", unit="step", mininterval=0.5,
                       disable=pg.rank != 0 or args.no_progress, file=sys.stdout)
            start, seen, loss_sum = time.perf_counter(), 0, torch.zeros(())
            for batch in bar:
                tracer.set_step(step, step_start := time.perf_counter())
                with tracer.region("forward"):
                    optimizer.zero_grad()
                    loss = nn.functional.cross_entropy(model(x_train[batch]), y_train[batch])
                with tracer.region("backward"):
                    loss.backward()
                with tracer.region("optimizer"):
                    optimizer.step()
                sent += (stats := model.last_step_stats())["bytes_sent"]
                per_step.append((time.perf_counter() - step_start, stats["comm_s"], stats["overlapped_comm_s"]))
                loss_sum, step, seen = loss_sum + loss.detach(), step + 1, seen + len(batch) * pg.size
                bar.set_postfix(loss=f"{loss.item():.3f}", samples_s=f"{seen / (time.perf_counter() - start):.0f}")
            figures = np.array([loss_sum.item() / len(batches), accuracy(model.module, x_test, y_test, pg)])
            pg.allreduce(figures, commlib.ReduceOp.AVG)  # the mean train loss over ranks; accuracy is global already
            if pg.rank == 0:
                print(f"epoch {epoch + 1}: train loss {figures[0]:.4f}  test accuracy {100 * figures[1]:.2f}%  "
                      f"{seen / (time.perf_counter() - start):.0f} samples/s", flush=True)
            if args.checkpoint:  # every rank its own (error feedback, local steps), atomically
                torch.save({"model": model.module.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch + 1,
                            "step": step, "sent": sent, "hook": hook.state_dict() if hook else None}, path + ".tmp")
                os.replace(path + ".tmp", path)
    if averager is not None:  # local SGD ends on the average of the ranks' models
        averager.finish()  # a partial averager's averaging in flight
        average_parameters(model.module.parameters(), pg)
    final_accuracy, per_step = accuracy(model.module, x_test, y_test, pg), np.array(per_step).reshape(-1, 3)
    sent = (sent + (averager.bytes_sent if averager else 0)) / max(step, 1)
    comm = per_step[1:, 1:].mean(0) if len(per_step) > 1 else np.zeros(2)  # step 1 pays for warm-up
    pg.allreduce(comm, commlib.ReduceOp.AVG)  # (allreduce seconds per step, of them hidden behind backward)
    digest = hashlib.sha256(b"".join(t.numpy().tobytes() for t in model.module.state_dict().values())).hexdigest()
    if pg.rank == 0:  # one print: the example is at its line budget (tests/unit/test_examples.py)
        print(f"\n{pg.size} ranks, {len(per_step)} steps: test accuracy {100 * final_accuracy:.2f}% "
              f"({final_accuracy!r}) with --sync {args.sync}, {sent / 1e3:.1f} kB sent per step\ntime per step "
              f"{1e3 * np.median(per_step[:, 0]) if len(per_step) else 0:.2f} ms (median; {per_step[:, 0].sum():.2f} "
              f"s in all); allreduce {1e3 * comm[0]:.2f} ms per step, {100 * comm[1] / max(comm[0], 1e-12):.1f}% of "
              f"it hidden behind backward (mean over ranks)\nparameters sha256 {digest}")
    if args.trace and tracer.write(args.trace) is not None:  # gathered to rank 0, written there
        print(f"wrote {args.trace}: open in ui.perfetto.dev, or python -m ddp.timeline {args.trace} --png overlap.png")


if __name__ == "__main__":
    sys.exit(main())
