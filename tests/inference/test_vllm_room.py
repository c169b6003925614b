"""vLLM's share of its GPU leaves room for the staged sync (`vlmreg.inference.vllm_room`), on the case measured on an
H200: the Qwen3-VL-30B-A3B shape at 24 layers, whose worker could not allocate its 30.02 GiB staging buffer beside
vLLM's default share of 0.9 ("Tried to allocate 30.02 GiB. GPU 0 has a total capacity of 139.80 GiB"), and synced every
step at 0.55."""

from __future__ import annotations

import pytest
import torch

import vlmreg
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.inference.vllm_launch import vllm_command
from vlmreg.inference.vllm_room import MARGIN_BYTES, launch_fraction, room_for_syncs, staged_bytes
from vlmreg.sdk.errors import VlmregError
from vlmreg.testing import tiny_model

GIB = 2**30
H200 = int(139.80 * GIB)
STAGED = int(30.02 * GIB)  # the allocation that failed


def measured(setting):
    return launch_fraction(setting, 0.9, total_bytes=H200, staged=STAGED, weights=STAGED, gpu="2")


def test_the_default_share_is_lowered_where_the_measured_run_ran_out_of_memory():
    fraction, note = measured(None)
    assert (1 - 0.9) * H200 < STAGED  # what happened: 0.9 left 14 GiB for a 30 GiB buffer
    assert fraction < 0.9 and (1 - fraction) * H200 >= STAGED + MARGIN_BYTES
    assert fraction >= 0.55  # the share that ran is not refused
    assert note == (
        f"vLLM on GPU 2 gets {fraction:.2f} of its memory, not 0.9: its workers stage each sync whole (30.0 GiB) "
        "outside vLLM's share (set rollout.gpu_memory_fraction to choose)"
    )


def test_a_set_share_that_leaves_too_little_is_refused_naming_it_and_the_largest_that_fits():
    fits, _ = measured(None)
    with pytest.raises(VlmregError) as failure:
        measured(0.9)
    assert str(failure.value) == (
        "rollout.gpu_memory_fraction = 0.9 leaves 14.0 GiB of GPU 2 (139.8 GiB) beside vLLM, but its workers stage "
        f"each sync whole outside that share: 30.0 GiB and 2 GiB of margin; set it to at most {fits:.2f}, or leave "
        "it unset"
    )
    assert measured(0.55) == (0.55, None)  # the run that synced every step
    assert measured(fits) == (fits, None)


def test_a_small_model_keeps_the_default_and_a_gpu_that_cannot_hold_both_copies_is_refused():
    assert launch_fraction(None, 0.9, total_bytes=H200, staged=4 * GIB, weights=4 * GIB, gpu="1") == (0.9, None)
    with pytest.raises(VlmregError, match=r"GPU 1 \(80.0 GiB\) cannot hold vLLM's weights \(40.0 GiB"):
        launch_fraction(None, 0.9, total_bytes=80 * GIB, staged=40 * GIB, weights=40 * GIB, gpu="1")


def test_the_staged_bytes_are_every_weight_of_a_full_sync_as_the_model_holds_them():
    model = tiny_model("qwen3_vl", seed=0)
    resolved = vlmreg.resolve(model)
    expected = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if getattr(model.config, "tie_word_embeddings", False):  # the head shares the embedding: sent once
        expected -= model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    assert staged_bytes(resolved) == expected


def test_the_share_reaches_vllms_command_line_and_only_where_workers_stage_on_a_gpu_of_their_own():
    def rc(**rollout):
        data = {
            "model": {"init": "random", "family": "qwen3_vl"},
            "trainer": {"device": "cpu"},
            "rollout": {"engine": "openai", "server": "vllm", "launch": True, **rollout},
            "broadcast": {"transport": "ipc" if rollout.get("launch_gpu") == "same" else "nccl"},
        }
        return resolve_config(parse_config(data))

    command = vllm_command(rc(launch_gpu="next"), "/ckpt", 8000, "bfloat16", 4096, fraction=0.77)
    assert command[command.index("--gpu-memory-utilization") + 1] == "0.77"
    same = rc(launch_gpu="same")
    assert room_for_syncs(same, vlmreg.resolve(tiny_model("qwen3_vl")), torch.device("cpu"), print) is None
