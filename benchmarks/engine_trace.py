"""Summarise a torch profiler trace (Chrome trace JSON, as vLLM's ``--profiler-config`` writes for its engine's
worker): is a decode step's time on the GPU or between kernels, and what the CPU does meanwhile.

    python benchmarks/engine_trace.py DIR_OR_FILE...      one JSON line per trace file (*.pt.trace.json[.gz])

Per file:
- ``window_ms``: from the first GPU event's start to the last one's end (the profiled generation);
- ``gpu_busy_ms`` / ``gpu_busy_share``: the union of kernel, memcpy and memset intervals over every stream, and its
  share of the window; ``gaps``: the idle stretches between them (count over 0.1 ms, their total, the largest);
- ``kernels``: the GPU events by name (count, total ms), largest total first;
- ``annotations``: ``record_function`` ranges on the CPU (vLLM names its engine phases with them), by name;
- ``cpu_ops`` and ``runtime``: torch operators and CUDA runtime calls (``cudaGraphLaunch``, synchronisations: a CPU
  that waits in ``cudaStreamSynchronize`` or ``cudaEventSynchronize`` is waiting for the GPU), by name.
"""

from __future__ import annotations

import gzip
import json
import sys
from collections import defaultdict
from collections.abc import Iterable
from pathlib import Path
from typing import Any

GPU_CATEGORIES = frozenset({"kernel", "gpu_memcpy", "gpu_memset"})
#: idle GPU stretches shorter than this are launch latency, not a gap worth counting
GAP_US = 100.0


def load(path: Path) -> list[dict[str, Any]]:
    """The trace's events."""
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        data = json.load(handle)
    events = data["traceEvents"] if isinstance(data, dict) else data
    return list(events)


def union(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Merged, sorted ``(start, end)`` intervals."""
    merged: list[tuple[float, float]] = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged


def by_name(events: Iterable[dict[str, Any]], top: int) -> list[dict[str, Any]]:
    """Count and total milliseconds per event name, largest total first."""
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for event in events:
        entry = totals[event["name"]]
        entry[0] += 1
        entry[1] += float(event["dur"])
    rows = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return [{"name": name[:120], "count": int(n), "total_ms": round(us / 1000, 3)} for name, (n, us) in rows]


def summarise(events: list[dict[str, Any]], top: int = 12) -> dict[str, Any]:
    """The figures of one trace's events (see the module's docstring); only complete events (``ph == "X"``) count."""
    events = [e for e in events if e.get("ph") == "X" and "dur" in e and "ts" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATEGORIES]
    if not gpu:
        return {"gpu_events": 0, "annotations": by_name((e for e in events if e.get("cat") == "user_annotation"), top)}
    busy = union((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in gpu)
    window = busy[-1][1] - busy[0][0]
    busy_us = sum(end - start for start, end in busy)
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:], strict=False)]
    long_gaps = sorted((g for g in gaps if g > GAP_US), reverse=True)
    return {
        "gpu_events": len(gpu),
        "window_ms": round(window / 1000, 3),
        "gpu_busy_ms": round(busy_us / 1000, 3),
        "gpu_busy_share": round(busy_us / window, 4) if window else None,
        "gaps": {
            "over_0.1ms": len(long_gaps),
            "total_ms": round(sum(long_gaps) / 1000, 3),
            "largest_ms": [round(g / 1000, 3) for g in long_gaps[:8]],
        },
        "kernels": by_name(gpu, top),
        "annotations": by_name((e for e in events if e.get("cat") == "user_annotation"), top),
        "cpu_ops": by_name((e for e in events if e.get("cat") == "cpu_op"), top),
        "runtime": by_name((e for e in events if e.get("cat") in ("cuda_runtime", "cuda_driver")), top),
    }


def trace_files(paths: Iterable[str]) -> list[Path]:
    found: list[Path] = []
    for name in paths:
        path = Path(name)
        if path.is_dir():
            found += sorted(p for p in path.rglob("*") if p.name.endswith((".pt.trace.json", ".pt.trace.json.gz")))
        else:
            found.append(path)
    return found


def main(argv: list[str]) -> int:
    files = trace_files(argv)
    if not files:
        print(json.dumps({"error": f"no *.pt.trace.json[.gz] under {argv}"}))
        return 1
    for path in files:
        print(json.dumps({"file": str(path), "bytes": path.stat().st_size, **summarise(load(path))}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
