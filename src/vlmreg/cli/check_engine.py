"""``vlmreg check --engine vllm FAMILY | DIR``: engine parity (`vlmreg.testing.engine_parity`) from the command line.

``--train STEPS`` adds a training run with vLLM (`vlmreg.testing.engine_train`), ``--no-parity`` leaves the comparisons
out (training only). Prints one ``PASS`` / ``FAIL`` / ``SKIP`` line per comparison, then the JSON summary on the last
line (``--json``:
the summary only). Exit 0 when every comparison passed, 1 when one failed, 2 when nothing could be compared (no
vLLM, no GPU, vLLM did not start, or the family declares vLLM cannot serve it).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

from vlmreg.sdk.errors import VlmregError

ENGINES = ("vllm",)


def add_options(p: argparse.ArgumentParser) -> None:
    """The options of engine parity, on ``vlmreg check``'s parser."""
    # deferred: `vlmreg` starts without it (copy, functools, random, ...)
    from vlmreg.testing.engine_parity import DEFAULT_SERVER_ARGS  # noqa: PLC0415

    group = p.add_argument_group("engine parity (--engine)")
    group.add_argument(
        "--engine",
        choices=ENGINES,
        help="serve TARGET (a checkpoint directory) or the --tiny FAMILY in this engine and "
        "compare its prompt ids and logprobs with the processor, vlmreg and a plain forward (needs a GPU and vLLM)",
    )
    group.add_argument(
        "--url",
        help="attach to this running OpenAI-compatible server (vLLM or vlmreg serve) instead of launching vLLM; "
        "it must serve TARGET",
    )
    group.add_argument(
        "--server-args",
        default=shlex.join(DEFAULT_SERVER_ARGS),
        metavar="ARGS",
        help=f"vLLM flags after the trainer's, one shell-quoted string (default: {shlex.join(DEFAULT_SERVER_ARGS)})",
    )
    group.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default="float32",
        help="the model's and vLLM's dtype (default float32)",
    )
    group.add_argument("--gpu-memory-fraction", type=float, default=0.1, help="vLLM's share of the GPU (default 0.1)")
    group.add_argument(
        "--logprob-tolerance",
        type=float,
        help="max |engine - plain forward| per token (default by dtype: fp32 2e-3, bf16 0.25, fp16 0.1)",
    )
    group.add_argument("--no-sync", action="store_true", help="skip the comparison after a weight sync into vLLM")
    group.add_argument(
        "--train",
        type=int,
        default=0,
        metavar="STEPS",
        help="also run `vlmreg train` for STEPS synced steps with vLLM (bf16) from the checkpoint written for the "
        "check, and check mismatch_kl every step",
    )
    group.add_argument(
        "--output-dir",
        type=Path,
        help="where vLLM's checkpoint, log and the training run go (default runs/engine-check-FAMILY)",
    )


def run(args: argparse.Namespace) -> int:
    # deferred: `vlmreg` starts without it (copy, functools, random, ...)
    from vlmreg.testing.engine_parity import check_engine, new_report  # noqa: PLC0415

    if (args.target is None) == (args.tiny is None):
        raise VlmregError("check --engine takes either a TARGET (a checkpoint directory) or --tiny FAMILY")
    if args.target is not None and not Path(args.target).is_dir():
        raise VlmregError(f"check --engine: {args.target} is not a checkpoint directory (an engine loads weights)")
    if args.train and args.url:
        raise VlmregError("check --engine: --train launches vLLM itself; drop --url")
    server_args = shlex.split(args.server_args)
    if args.no_parity and not args.train:
        raise VlmregError("check --engine --no-parity compares nothing; add --train STEPS")

    def say(message: str) -> None:
        print(message, file=sys.stderr, flush=True)

    if args.no_parity:  # training only (e.g. after a check in the same --output-dir, whose checkpoint it starts from)
        report = new_report(args.tiny, args.target, url=args.url, dtype=args.dtype, server_args=server_args)
    else:
        report = check_engine(
            args.tiny,
            args.target,
            url=args.url,
            dtype=args.dtype,
            server_args=server_args,
            gpu_memory_fraction=args.gpu_memory_fraction,
            output_dir=args.output_dir,
            sync=not args.no_sync,
            tolerance=args.logprob_tolerance,
            log=say,
        )
    if args.train and report.error is None:
        # deferred: start-up cost (loads subprocess)
        from vlmreg.testing.engine_train import run_training  # noqa: PLC0415

        output = Path(args.output_dir or Path("runs") / f"engine-check-{report.family}")
        exported = output / "vllm-model"  # the check's random init as written for vLLM (its logits sharpened)
        start = args.target or (str(exported) if (exported / "config.json").is_file() else None)
        report.comparisons += run_training(
            report.family,
            start,
            steps=args.train,
            server_args=server_args,
            gpu_memory_fraction=args.gpu_memory_fraction,
            output_dir=output,
        )
    summary = report.as_dict()
    if not args.json:
        for c in report.comparisons:
            print(f"{c.status} {c.name}: {c.detail}", flush=True)
        if report.error:
            print(f"FAIL {report.family}: {report.error}", flush=True)
        print(
            f"{'PASS' if report.ok else 'FAIL'} {report.family} through {report.engine}: {summary['passed']} passed, "
            f"{summary['failed']} failed{', not run' if report.error else ''}",
            flush=True,
        )
    print(json.dumps(summary), flush=True)
    if report.error:
        return 2
    return 0 if report.ok else 1
