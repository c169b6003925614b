"""``vlmreg bench broadcast``: time the weight broadcaster against a raw broadcast of the same bytes; prints JSON."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="benchmarks that print JSON")
    benches = p.add_subparsers(dest="bench", metavar="BENCH", required=True)
    b = benches.add_parser("broadcast", help="one sync of the language model vs one flat broadcast of the same bytes")
    b.add_argument("--family", required=True, help="an installed family")
    b.add_argument("--size", default="tiny", help="tiny, or a named shape of the family (e.g. 2b)")
    b.add_argument(
        "--layers", type=int, default=None, help="keep only the shape's first N decoder layers (default: all)"
    )
    b.add_argument(
        "--backend", choices=("nccl", "gloo"), default="gloo", help="nccl: one GPU per process, bf16; gloo: CPU, fp32"
    )
    b.add_argument("--bucket-mb", type=int, default=512, help="bucket size in MiB (default 512)")
    b.add_argument("--ring-depth", type=int, default=2, help="buckets the sender packs ahead (default 2)")
    b.add_argument(
        "--gather-ahead-mb",
        type=int,
        default=None,
        help="with --shards: MiB of tensors gathered ahead of the packing (default: the sender's own, 2 GiB)",
    )
    b.add_argument(
        "--iters", type=int, default=10, help="timed iterations (median reported; 2 warm-up iterations first)"
    )
    b.add_argument("--receivers", type=int, default=1, help="receiving processes (default 1)")
    b.add_argument(
        "--shards",
        type=int,
        default=1,
        help="trainer processes holding the model as FSDP2 shards, rank 0 sending (default 1: one unsharded sender)",
    )
    b.add_argument(
        "--receiver-gpu",
        type=int,
        default=None,
        help="nccl: the first receiver's GPU (default: the one after the trainer's; 1 with --shards 2 on two GPUs)",
    )
    b.add_argument("--checksum", action="store_true", help="compute and verify per-bucket checksums")
    b.add_argument(
        "--profile",
        action="store_true",
        help="one more sync under torch's profiler: the sending GPU's broadcast, gather and copy time, their overlap",
    )
    b.add_argument("--timeout-s", type=float, default=120.0, help="how long a rank waits for the others")
    b.set_defaults(run=run)


def run(args: argparse.Namespace) -> int:
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.broadcast.bench import BenchOptions, run_bench  # noqa: PLC0415

    # deferred: start-up cost (loads rich)
    from vlmreg.cli.output import print_json  # noqa: PLC0415

    options = BenchOptions(
        family=args.family,
        size=args.size,
        layers=args.layers,
        backend=args.backend,
        bucket_mb=args.bucket_mb,
        ring_depth=args.ring_depth,
        **({} if args.gather_ahead_mb is None else {"gather_ahead_mb": args.gather_ahead_mb}),
        iters=args.iters,
        receivers=args.receivers,
        shards=args.shards,
        receiver_gpu=args.receiver_gpu,
        checksum=args.checksum,
        profile=args.profile,
        timeout_s=args.timeout_s,
    )
    print_json(run_bench(options))
    return 0
