"""`vlmreg bench broadcast` on CPU with gloo, as CI runs it: real sender and receiver processes."""

from __future__ import annotations

import json
import random

from vlmreg.broadcast.bench import _intersect, _merged, _union
from vlmreg.cli import main


def test_bench_broadcast_prints_verified_json(capsys):
    args = ["bench", "broadcast", "--family", "qwen3_vl", "--size", "tiny", "--backend", "gloo", "--iters", "3"]
    assert main([*args, "--profile"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] is True  # the receivers took the profiled sync too, and still match
    profiled = result["profile"]  # on a CPU the profiler records no GPU kernels
    assert profiled["seconds"] > 0 and profiled["broadcast_s"] == 0 and set(profiled["kernels"].values()) == {0}
    assert profiled["top_kernels"] == []
    assert result["backend"] == "gloo" and result["device"] == "cpu" and result["dtype"] == "float32"
    assert result["bytes"] > 0 and result["tensors"] > 0 and result["buckets"] >= 1
    assert (
        result["seconds"] > 0
        and result["raw_seconds"] > 0
        and result["ratio"] == result["seconds"] / result["raw_seconds"]
    )


def test_bench_broadcast_rejects_an_unknown_size(capsys):
    assert main(["bench", "broadcast", "--family", "qwen3_vl", "--size", "70b"]) == 1
    assert "family qwen3_vl has no size '70b'; sizes: tiny, 2b" in " ".join(capsys.readouterr().err.split())


def test_bench_broadcast_rejects_a_negative_gather_ahead(capsys):
    assert main(["bench", "broadcast", "--family", "qwen3_vl", "--gather-ahead-mb", "-1"]) == 1
    assert "--gather-ahead-mb must be >= 0" in capsys.readouterr().err


def test_bench_broadcast_places_receivers_only_on_gpus(capsys):
    assert main(["bench", "broadcast", "--family", "qwen3_vl", "--receiver-gpu", "1"]) == 1
    assert "--receiver-gpu is for --backend nccl" in capsys.readouterr().err


def test_bench_broadcast_from_a_two_process_fsdp2_trainer_matches_the_model_before_sharding(capsys):
    """Rank 0 sends what the two ranks gather bucket by bucket; the receiver checks every tensor against rank 0's copy
    of the plan taken before the model was sharded (fused experts, split along their first dimension by FSDP2)."""
    args = ["bench", "broadcast", "--family", "qwen3_vl_moe", "--backend", "gloo", "--iters", "2", "--shards", "2"]
    # nothing gathered ahead: each tensor taken only when the packer reaches it (the sender's default, 2048 MiB ahead,
    # is the one tests/broadcast/test_shard_gather.py runs)
    assert main([*args, "--gather-ahead-mb", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] is True and result["shards"] == 2 and result["tensors"] > 0
    assert result["gather_ahead_mb"] == 0


def test_the_profile_s_overlap_is_the_measure_of_the_intervals_common_to_both_kinds():
    """Against counting, on a grid of 0.5-wide cells, the cells inside both unions."""
    rng = random.Random(0)
    for _ in range(200):
        a, b = (
            [(s, s + rng.randint(1, 6)) for s in (rng.randint(0, 40) for _ in range(rng.randint(0, 6)))] for _ in "ab"
        )
        cells = [x / 2 + 0.25 for x in range(100)]
        inside = lambda spans, x: any(lo <= x < hi for lo, hi in spans)  # noqa: E731
        assert _union(a) == sum(0.5 for x in cells if inside(a, x))
        common = _union(_intersect(_merged(a), _merged(b)))
        assert common == sum(0.5 for x in cells if inside(a, x) and inside(b, x))
