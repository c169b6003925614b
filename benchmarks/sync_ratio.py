"""A training run's weight syncs against a raw NCCL broadcast of the same bytes between the same GPUs (issue 25 item 4).

Reads what `vlmreg bench broadcast` printed (``raw_seconds``: one flat broadcast of the sync's bytes, median) and the
run's ``metrics.jsonl``, and prints one JSON line per step: ``sync_s``, its ratio to the raw broadcast, and where the
sync's time went (``sync_ready_s``, ``sync_send_s``, ``sync_ack_s``, ``sync_early`` and the slowest worker's
``sync_worker_*``, or, where the answer is settled later, the previous sync's ``sync_prev_*`` on the next step's line:
docs/broadcast.md, "A sync into vLLM, step by step"); then a summary over the steps from
``--from-step`` on (the first syncs of a layout load and record copy plans; replays start at sync 4, the run's step 3)
with the goal's verdict (``sync_s <= 1.3 x raw``):

    python benchmarks/sync_ratio.py --raw raw.json --metrics RUN/metrics.jsonl --label "TP 1"
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

PARTS = (
    "sync_ready_s",
    "sync_send_s",
    "sync_ack_s",
    "sync_early",
    "sync_worker_wait_s",
    "sync_worker_receive_s",
    "sync_worker_copy_s",
    "sync_worker_tail_s",
    "sync_prev_settle_s",
    "sync_prev_worker_wait_s",
    "sync_prev_worker_receive_s",
    "sync_prev_worker_copy_s",
    "sync_prev_worker_tail_s",
)
GOAL = 1.3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--raw", required=True, help="the JSON `vlmreg bench broadcast` printed")
    parser.add_argument("--metrics", required=True, help="the run's metrics.jsonl")
    parser.add_argument("--label", default="", help="named in every line (the placement, say)")
    parser.add_argument("--from-step", type=int, default=3, help="first step of the summary (default 3)")
    args = parser.parse_args()
    raw = json.loads(Path(args.raw).read_text())
    reference = float(raw["raw_seconds"])
    steps = [json.loads(line) for line in Path(args.metrics).read_text().splitlines() if line.strip()]
    ratios: list[float] = []
    worker_ratios: list[float] = []  # where the answer is settled later: the workers' own time to written weights
    for record in steps:
        if "sync_s" not in record:
            continue
        ratio = record["sync_s"] / reference
        line = {"label": args.label, "step": record.get("step"), "sync_ms": round(1e3 * record["sync_s"], 2)}
        line.update(raw_ms=round(1e3 * reference, 2), ratio=round(ratio, 3))
        for name in (n for n in PARTS if n in record):  # seconds as ms; sync_early is 1 or 0
            line[name.removesuffix("_s") + "_ms" if name.endswith("_s") else name] = (
                round(1e3 * record[name], 2) if name.endswith("_s") else record[name]
            )
        print(json.dumps(line))
        if record.get("step", 0) >= args.from_step:
            ratios.append(ratio)
        if record.get("step", 0) > args.from_step and "sync_prev_worker_receive_s" in record:
            # the sync before: its slowest worker's receive (header to last byte) and tail (to weights written)
            done = record["sync_prev_worker_receive_s"] + record.get("sync_prev_worker_tail_s", 0.0)
            worker_ratios.append(done / reference)
    summary = {
        "label": args.label,
        "raw_ms": round(1e3 * reference, 2),
        "sender_ratio": raw.get("ratio"),  # vlmreg's Sender alone over the raw broadcast, same bench
        "receivers": raw.get("receivers"),
        "bytes": raw.get("bytes"),
        "steps": len(ratios),
    }
    if ratios:
        summary.update(
            ratio_min=round(min(ratios), 3),
            ratio_median=round(statistics.median(ratios), 3),
            ratio_max=round(max(ratios), 3),
        )
        summary["goal"] = f"<= {GOAL}x: {'met' if max(ratios) <= GOAL else 'not met'}"
    if worker_ratios:
        summary.update(
            workers_done_ratio_min=round(min(worker_ratios), 3),
            workers_done_ratio_max=round(max(worker_ratios), 3),
        )
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
