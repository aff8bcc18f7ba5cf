"""``python -m commlib.costmodel fit | predict | ddp``: see :mod:`commlib.costmodel`."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Dict

from commlib.bench.record import read_record
from commlib.errors import InvalidUsageError
from commlib.units import parse_size

__all__ = ["main"]


def _predict(args) -> int:
    from commlib.selection.cost_model import CostModel

    model = CostModel.load(args.model)
    predicted = model.predict(args.bytes, args.hosts, args.ranks_per_host)
    choice, why = model.choose(args.bytes, args.hosts, args.ranks_per_host)
    if args.json:
        out: Dict[str, object] = {name: breakdown.total for name, breakdown in predicted.items()}
        out.update(choice=choice, why=why)
        print(json.dumps(out))
        return 0
    print(f"# {args.hosts} hosts x {args.ranks_per_host} ranks, {args.bytes} bytes; model {args.model} "
          f"(fitted on {model.fitted_on.get('hosts', '?')} hosts, {model.fitted_on.get('date', '?')})")
    print(f"{'algorithm':>18} {'predicted(us)':>14} {'latency':>10} {'intra':>10} {'inter':>10} {'reduce':>10}")
    for name, b in sorted(predicted.items(), key=lambda item: item[1].total):
        print(f"{name:>18} {b.total * 1e6:>14.1f} {b.latency * 1e6:>10.1f} {b.intra * 1e6:>10.1f} "
              f"{b.inter * 1e6:>10.1f} {b.reduce * 1e6:>10.1f}")
    print(f"auto picks {choice}: {why}")
    return 0


def _ddp(args) -> int:
    from commlib.costmodel.ddp_scaling import predict_scaling, profile_from_trace
    from commlib.selection.cost_model import CostModel

    model = CostModel.load(args.model)
    profile = profile_from_trace(args.trace)
    hosts = [int(h) for h in args.hosts.split(",")]
    if 1 not in hosts:
        hosts = [1] + hosts
    rows = predict_scaling(model, profile, hosts, args.ranks_per_host)
    single = predict_scaling(model, profile, [1], 1)[0]
    print(f"# DDP step from {args.trace} ({profile.steps} steps, rank 0): forward {profile.forward * 1e3:.2f} ms, "
          f"backward {profile.backward * 1e3:.2f} ms, optimizer {profile.optimizer * 1e3:.2f} ms, "
          f"{len(profile.nbytes)} buckets of {', '.join(str(b) for b in profile.nbytes)} bytes")
    print(f"# one rank: {single.step * 1e3:.2f} ms a step; weak scaling (the batch per rank fixed)")
    print(f"{'hosts':>6} {'ranks':>6} {'step(ms)':>9} {'comm(ms)':>9} {'exposed(ms)':>11} "
          f"{'efficiency':>10}  algorithms")
    for row in rows:
        efficiency = single.step / row.step
        print(f"{row.hosts:>6} {row.hosts * row.per_host:>6} {row.step * 1e3:>9.2f} {row.comm * 1e3:>9.2f} "
              f"{row.exposed * 1e3:>11.2f} {efficiency:>10.3f}  {','.join(sorted(set(row.algorithms))) or '-'}")
    if args.png:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        ranks = [row.hosts * row.per_host for row in rows]
        figure, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
        left.plot(ranks, [single.step / row.step for row in rows], marker="o")
        left.set_xscale("log", base=2)
        left.set_ylim(0, 1.05)
        left.set_xlabel("ranks")
        left.set_ylabel("scaling efficiency")
        left.set_title(f"{args.ranks_per_host} ranks per host")
        right.plot(ranks, [row.step * 1e3 for row in rows], marker="o", label="step")
        right.plot(ranks, [row.exposed * 1e3 for row in rows], marker="s", label="exposed comm")
        right.set_xscale("log", base=2)
        right.set_xlabel("ranks")
        right.set_ylabel("ms")
        right.legend()
        figure.tight_layout()
        figure.savefig(args.png, dpi=110)
        print(f"# wrote {args.png}")
    return 0


def _bench_rows(path):
    """The allreduce rows of a ``python -m commlib.bench --json`` record (the model is of allreduces)."""
    try:
        record = read_record(path)
    except ValueError as error:
        raise InvalidUsageError(f"bench rows {error}") from None
    if record["benchmark"] != "commlib.bench":
        raise InvalidUsageError(f"bench rows {path}: a record of {record['benchmark']}, expected commlib.bench's")
    for row in record["rows"]:
        if row.get("collective", "allreduce") != "allreduce":
            continue
        if not row.get("hosts"):
            raise InvalidUsageError(f"bench rows {path}: no 'hosts' field (rows from a bench that predates it)")
        yield row


def _validate(args) -> int:
    """Predictions against ``python -m commlib.bench --json`` rows (which say where ranks were)."""
    import statistics

    from commlib.selection.cost_model import CostModel

    model = CostModel.load(args.model)
    wanted = set(args.algorithms.split(","))
    errors = []
    print(f"{'shape':>6} {'size':>10} {'algorithm':>14} {'measured(us)':>13} {'predicted(us)':>14} {'error':>7}")
    for path in args.bench:
        for row in _bench_rows(path):
            if row["algorithm"] not in wanted or not args.min_bytes <= row["size"] <= args.max_bytes:
                continue
            hosts = row["hosts"]
            per_host = max(len(ranks) for ranks in hosts)
            measured = row["time(us)"]
            predicted = model.predict(row["size"], len(hosts), per_host)[row["algorithm"]].total * 1e6
            relative = predicted / measured - 1
            errors.append(abs(relative))
            print(f"{len(hosts)}x{per_host:<4} {row['size']:>10} {row['algorithm']:>14} {measured:>13.1f} "
                  f"{predicted:>14.1f} {relative:>+7.1%}")
    if not errors:
        raise InvalidUsageError("no bench row matched the algorithms and sizes asked for")
    print(f"# {len(errors)} predictions: median |error| {statistics.median(errors):.1%}, worst {max(errors):.1%}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m commlib.costmodel",
                                     description="alpha-beta-gamma cost model of commlib's allreduces across hosts")
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("fit", help="measure this job's links (under mpiexec) and write the model", add_help=False)
    predict = commands.add_parser("predict", help="every algorithm's predicted time, and auto's pick")
    predict.add_argument("--model", required=True)
    predict.add_argument("--hosts", type=int, required=True)
    predict.add_argument("--ranks-per-host", type=int, required=True)
    predict.add_argument("--bytes", type=parse_size, required=True, help="message size (64K, 4M, ...)")
    predict.add_argument("--json", action="store_true", help='{"algorithm": seconds, ..., "choice": name}')
    ddp = commands.add_parser("ddp", help="a DDP trace's step time and scaling efficiency at more ranks")
    ddp.add_argument("--model", required=True)
    ddp.add_argument("--trace", required=True, help="from mpi_examples/train_digits.py --trace")
    ddp.add_argument("--hosts", default="1,2,4,8,16,32", help="comma-separated host counts")
    ddp.add_argument("--ranks-per-host", type=int, default=8)
    ddp.add_argument("--png", help="also draw efficiency and step time against ranks")
    validate = commands.add_parser("validate", help="predictions against measured bench rows (--json)")
    validate.add_argument("--model", required=True)
    validate.add_argument("--bench", nargs="+", required=True, help="python -m commlib.bench --json files")
    validate.add_argument("--algorithms", default="ring,rabenseifner,hierarchical")
    validate.add_argument("--min-bytes", type=parse_size, default=64 << 10)
    validate.add_argument("--max-bytes", type=parse_size, default=64 << 20)
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["fit"]:
        from commlib.costmodel.fit import main as fit_main

        return fit_main(argv[1:])
    args = parser.parse_args(argv)
    try:
        return {"predict": _predict, "ddp": _ddp, "validate": _validate}[args.command](args)
    except InvalidUsageError as error:
        print(f"commlib.costmodel: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
