"""The reference for a same-GPU weight sync: one device-to-device copy of the same bytes, and the same bytes as many
tensors copied with one grouped ``torch._foreach_copy_``, one by one, and by vlmreg's chunked-copy kernel (what a
replayed copy plan does on a GPU with Triton).

    python benchmarks/device_copy.py --gb 3.44 --tensors 310     # prints JSON: milliseconds, min and median of --iters
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from vlmreg.broadcast.copy_kernel import ChunkedCopies


def timed(fn, iters: int) -> list[float]:
    out = []
    for _ in range(iters + 2):
        torch.cuda.synchronize()
        started = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append(1e3 * (time.perf_counter() - started))
    return out[2:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gb", type=float, default=3.44, help="bytes to copy, in GB (1e9), as bf16")
    parser.add_argument(
        "--tensors", type=int, default=310, help="split into this many equal tensors for the grouped copy"
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--tune", action="store_true", help="also time the chunked kernel's chunk / block / warps variants"
    )
    args = parser.parse_args()
    count = int(args.gb * 1e9 / 2)
    source = torch.randn(count, device="cuda", dtype=torch.bfloat16)
    target = torch.empty_like(source)
    flat = timed(lambda: target.copy_(source), args.iters)
    sources, targets = list(source.chunk(args.tensors)), list(target.chunk(args.tensors))
    grouped = timed(lambda: torch._foreach_copy_(targets, sources), args.iters)
    each = timed(lambda: [t.copy_(s) for t, s in zip(targets, sources, strict=True)], args.iters)

    chunked = ChunkedCopies(list(zip(targets, sources, strict=True)))
    target.zero_()
    chunked.run()
    assert torch.equal(target, source)
    kernel = timed(chunked.run, args.iters)
    report = {"device": torch.cuda.get_device_name(), "gb": args.gb, "tensors": args.tensors}
    if args.tune:  # the kernel's chunk, block and warps
        for chunk_words in (8192, 32768, 131072):
            for block, warps in ((1024, 4), (2048, 8), (4096, 8), (4096, 16), (8192, 16)):
                if block > chunk_words:
                    continue
                variant = ChunkedCopies(
                    list(zip(targets, sources, strict=True)), chunk_words=chunk_words, block=block, warps=warps
                )
                report[f"kernel_{chunk_words}_{block}_{warps}_ms"] = round(min(timed(variant.run, args.iters)), 3)
    for name, values in (
        ("one_copy_ms", flat),
        ("foreach_copy_ms", grouped),
        ("per_tensor_copy_ms", each),
        ("chunked_kernel_ms", kernel),
    ):
        report[name] = {"min": round(min(values), 3), "median": round(statistics.median(values), 3)}
    print(json.dumps(report))


if __name__ == "__main__":
    main()
