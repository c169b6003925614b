"""benchmarks/engine_trace.py: the figures it reads off a torch profiler trace, against a trace torch itself wrote and
against intervals worked out by hand."""

from __future__ import annotations

import gzip
import importlib.util
import json
import time
from pathlib import Path
from types import ModuleType

import torch
from torch.profiler import ProfilerActivity, profile, record_function

SCRIPT = Path(__file__).resolve().parents[2] / "benchmarks" / "engine_trace.py"


def load_script() -> ModuleType:
    spec = importlib.util.spec_from_file_location("engine_trace_benchmark", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_trace_torch_wrote_gives_its_annotations_and_their_times(tmp_path: Path, capsys) -> None:
    trace = load_script()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            with record_function("decode_step"):
                time.sleep(0.02)
                torch.ones(64, 64) @ torch.ones(64, 64)
    path = tmp_path / "worker.pt.trace.json"
    prof.export_chrome_trace(str(path))
    (tmp_path / "gz").mkdir()
    with gzip.open(tmp_path / "gz" / "worker.pt.trace.json.gz", "wb") as packed:
        packed.write(path.read_bytes())

    assert trace.main([str(tmp_path)]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(lines) == 2  # the plain file and the gzipped copy, found under the folder
    for line in lines:
        assert line["gpu_events"] == 0
        step = next(a for a in line["annotations"] if a["name"] == "decode_step")
        assert step["count"] == 3
        assert 60 <= step["total_ms"] < 400  # three sleeps of 20 ms


def test_gpu_busy_time_is_the_union_of_streams_and_gaps_are_what_lies_between() -> None:
    trace = load_script()
    events = [  # microseconds; two streams overlapping, then a 500 us gap, a 50 us gap (launch latency), one more
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 0, "dur": 1000},
        {"ph": "X", "cat": "kernel", "name": "attn", "ts": 800, "dur": 400},  # overlaps gemm: busy 0-1200
        {"ph": "X", "cat": "gpu_memcpy", "name": "copy", "ts": 1700, "dur": 300},  # gap 500, busy 1700-2000
        {"ph": "X", "cat": "kernel", "name": "gemm", "ts": 2050, "dur": 950},  # gap 50, busy 2050-3000
        {"ph": "X", "cat": "user_annotation", "name": "execute_model", "ts": 0, "dur": 3000},
        {"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 100, "dur": 900},
        {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5000},  # not a complete event: ignored
    ]
    out = trace.summarise(events)
    assert out["window_ms"] == 3.0
    assert out["gpu_busy_ms"] == 1.2 + 0.3 + 0.95
    assert out["gpu_busy_share"] == round(2.45 / 3.0, 4)
    assert out["gaps"] == {"over_0.1ms": 1, "total_ms": 0.5, "largest_ms": [0.5]}
    assert out["kernels"][0] == {"name": "gemm", "count": 2, "total_ms": 1.95}
    assert out["runtime"] == [{"name": "cudaStreamSynchronize", "count": 1, "total_ms": 0.9}]
    assert out["annotations"] == [{"name": "execute_model", "count": 1, "total_ms": 3.0}]


def test_no_trace_is_an_error_naming_where_it_looked(tmp_path: Path, capsys) -> None:
    assert load_script().main([str(tmp_path)]) == 1
    assert str(tmp_path) in capsys.readouterr().out
