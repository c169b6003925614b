"""`vlmreg bench broadcast` on CPU with gloo, as CI runs it: real sender and receiver processes."""

from __future__ import annotations

import json

from vlmreg.cli import main


def test_bench_broadcast_prints_verified_json(capsys):
    assert (
        main(["bench", "broadcast", "--family", "qwen3_vl", "--size", "tiny", "--backend", "gloo", "--iters", "3"]) == 0
    )
    result = json.loads(capsys.readouterr().out)
    assert result["verified"] is True
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
