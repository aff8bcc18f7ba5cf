# mpiexec -n 2 python mpi_examples/char_lm.py [--sync ddp localsgd diloco streaming-diloco desloc] [--png char_lm.png]
"""A character-level transformer on the Python standard library's own sources, once per ``--sync`` method.

The text ships with Python: nothing is downloaded. Each method starts from the same model and sees the same samples
(each rank its own): DDP, local SGD, DiLoCo, streaming DiLoCo, DES-LOC (ddp.low_communication.presets; H = --period),
AdamW inside, after --start steps of DDP. Prints the held-out loss of the final model (local methods: the ranks'
average), time and bytes per step after the start against the first method; draws all the loss curves in one PNG.
"""

import argparse
import contextlib
import json
import os
import pathlib
import sys
import time

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import commlib
from ddp import DistributedDataParallel as DDP
from ddp.averaging import PeriodicModelAverager, average_parameters
from ddp.hooks import PostLocalSGDState, post_localSGD_hook
from ddp.low_communication import METHODS, low_communication
from ddp.optim import PostLocalSGDOptimizer


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, default in (("--steps", 400), ("--batch-size", 16), ("--context", 64), ("--width", 64), ("--layers", 2),
                          ("--period", 16), ("--start", 20), ("--seed", 0), ("--chars", 1 << 20)):
        p.add_argument(flag, type=int, default=default)  # batch size: per rank; chars: of text, a tenth held out
    p.add_argument("--sync", nargs="+", default=["ddp", "localsgd", *METHODS], choices=["ddp", "localsgd", *METHODS])
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--png", default="char_lm.png", help="the loss curves (rank 0)")
    p.add_argument("--json", help="also write the table's rows and the curves here (rank 0)")
    return p.parse_args(argv)


def corpus(chars):
    """The standard library's top-level modules in name order, as bytes: the same text on every rank."""
    text = b"".join(path.read_bytes() for path in sorted(pathlib.Path(os.__file__).parent.glob("*.py")))
    data = torch.frombuffer(bytearray(text[:chars]), dtype=torch.uint8).long()
    return data[:len(data) * 9 // 10], data[len(data) * 9 // 10:]


class CharTransformer(nn.Module):
    def __init__(self, width, layers, context):
        super().__init__()
        self.embed, self.position = nn.Embedding(256, width), nn.Parameter(torch.zeros(context, width))
        layer = nn.TransformerEncoderLayer(width, 4, 4 * width, dropout=0.0, batch_first=True, norm_first=True)
        self.blocks, self.head = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(width, 256)
        self.causal = nn.Transformer.generate_square_subsequent_mask(context)  # not a buffer: DDP would broadcast it

    def forward(self, tokens):
        return self.head(self.blocks(self.embed(tokens) + self.position, mask=self.causal, is_causal=True))


def loss_on(net, data, starts, context):
    """The mean next-character loss of ``net`` on the windows of ``data`` beginning at ``starts``."""
    rows = torch.stack([data[s:s + context + 1] for s in starts.tolist()])
    return F.cross_entropy(net(rows[:, :-1]).flatten(0, 1), rows[:, 1:].flatten())


def train(name, args, pg, text, held_out):
    """(loss, seconds and bytes sent so far, per step; held-out loss of the final model) of one method."""
    torch.manual_seed(args.seed)
    model = DDP(CharTransformer(args.width, args.layers, args.context))
    optimizer, context, averager = torch.optim.AdamW(model.parameters(), lr=args.lr), contextlib.nullcontext(), None
    if name == "localsgd":
        model.register_comm_hook(PostLocalSGDState(None, None, args.start, post_local_gradient_allreduce=False),
                                 post_localSGD_hook)
        optimizer = PostLocalSGDOptimizer(optimizer, averager := PeriodicModelAverager(args.period, args.start))
    elif name in METHODS:  # they give the DDP model the post-local SGD hook themselves
        context = averager = low_communication(name, model, optimizer, args.period, warmup_steps=args.start)
    samples = torch.Generator().manual_seed(1000 * args.seed + pg.rank)
    losses, seconds, sent, ddp_bytes = [], [], [], 0
    with context:
        for _ in range(args.steps):
            starts = torch.randint(len(text) - args.context - 1, (args.batch_size,), generator=samples)
            began = time.perf_counter()
            optimizer.zero_grad()
            (loss := loss_on(model, text, starts, args.context)).backward()
            optimizer.step()
            seconds.append(time.perf_counter() - began)
            losses.append(loss.item())
            ddp_bytes += model.last_step_stats()["bytes_sent"]
            sent.append(ddp_bytes + (averager.bytes_sent if averager is not None else 0))
    if averager is not None:  # local steps end on the ranks' average (not counted: the same for every method)
        averager.finish()
        average_parameters(model.module.parameters(), pg)
    with torch.no_grad():  # 64 windows spread over the held-out text
        final = loss_on(model.module, held_out, torch.arange(64) * (len(held_out) // 65), args.context)
    return losses, seconds, sent, final.item()


def report(args, pg, results):
    first = results[args.sync[0]]
    print(f"# char_lm: {pg.size} ranks, {args.steps} steps of {args.batch_size} x {args.context} characters per rank, "
          f"width {args.width}, {args.layers} layers, H={args.period}, after {args.start} steps of DDP")
    print(f"{'sync':>17} {'held-out loss':>13} {'ratio':>7} {'ms/step':>8} {'ratio':>7} {'kB/step':>9} {'ratio':>7}")
    rows = [{"sync": name, "held_out_loss": loss, "ms_per_step": ms, "bytes_per_step": sent, "curve": curve.tolist(),
             "ratios": [loss / first[3], ms / first[1], sent / max(first[2], 1)]}
            for name, (curve, ms, sent, loss) in results.items()]
    for row in rows:  # ratios: to the first --sync method
        print(f"{row['sync']:>17} {row['held_out_loss']:>13.4f} {row['ratios'][0]:>7.3f} {row['ms_per_step']:>8.2f} "
              f"{row['ratios'][1]:>7.2f} {row['bytes_per_step'] / 1e3:>9.1f} {row['ratios'][2]:>7.4f}")
    if args.json:
        with open(args.json, "w") as out:
            json.dump({"args": vars(args), "ranks": pg.size, "rows": rows}, out)
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 4.5))
    window = max(1, args.steps // 40)  # a moving average: one batch's loss is noisy
    for row in rows:
        smooth = np.convolve(row["curve"], np.ones(window) / window, mode="valid")
        axes.plot((np.arange(smooth.size) + window) * args.batch_size * pg.size, smooth, label=row["sync"])
    axes.set(xlabel="samples (all ranks)", ylabel="training loss (nats per character, mean over ranks)",
             title=f"char_lm: {pg.size} ranks, H={args.period}, DDP for the first {args.start} steps")
    axes.legend()
    figure.savefig(args.png, dpi=120, bbox_inches="tight")
    print(f"wrote {args.png}")


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(1)  # the ranks share the machine's cores
    pg = commlib.init()
    text, held_out = corpus(args.chars)
    results = {}
    for name in args.sync:
        losses, seconds, sent, final = train(name, args, pg, text, held_out)
        start = min(args.start, args.steps - 1)  # the steps after it: the methods' steady state
        curve, ms = np.array(losses), np.array([1e3 * np.mean(seconds[start:])])
        pg.allreduce(curve, commlib.ReduceOp.AVG)
        pg.allreduce(ms, commlib.ReduceOp.MAX)  # the slowest rank sets the pace
        per_step = (sent[-1] - (sent[start - 1] if start else 0)) / (args.steps - start)
        results[name] = (curve, float(ms[0]), per_step, final)
    if pg.rank == 0:
        report(args, pg, results)


if __name__ == "__main__":
    sys.exit(main())
