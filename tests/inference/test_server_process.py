"""Where a server the trainer launches runs: its GPUs (`server_gpus`) and an environment without torchrun's variables
(`server_environment`)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from vlmreg.inference.server_process import server_environment, server_gpus
from vlmreg.sdk.errors import VlmregError


@pytest.mark.parametrize(
    ("where", "ranks", "tp", "visible", "expected"),
    [
        ("next", 1, 1, "0,1", "1"),
        ("same", 1, 1, "0,1", "0"),
        ("next", 2, 1, "0,1,2,3", "2"),  # torchrun with 2 ranks: GPUs 0 and 1 train, the server gets the third
        ("next", 2, 2, "0,1,2,3", "2,3"),  # tensor parallel 2 after them
        ("same", 2, 1, "0,1,2,3", "0"),  # beside rank 0
        ("next", 2, 1, "4,5,6", "6"),  # counted within the trainer's CUDA_VISIBLE_DEVICES
    ],
)
def test_a_launched_server_gets_the_gpus_after_every_trainer_rank(monkeypatch, where, ranks, tp, visible, expected):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    assert server_gpus(torch.device("cuda", 0), where, tp) == expected


def test_no_gpu_left_for_the_server_is_an_error_naming_the_setting(monkeypatch):
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    with pytest.raises(
        VlmregError, match=r"rollout.launch_gpu = 'next' .* after the trainer's 2 GPUs .*CUDA_VISIBLE_DEVICES=0,1"
    ):
        server_gpus(torch.device("cuda", 0), "next")


def test_a_launched_server_does_not_inherit_torchrun_s_variables(monkeypatch):
    for key, value in {
        "RANK": "0",
        "LOCAL_RANK": "0",
        "WORLD_SIZE": "2",
        "LOCAL_WORLD_SIZE": "2",
        "MASTER_PORT": "29500",
        "TORCHELASTIC_RUN_ID": "x",
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "GROUP_RANK": "0",
    }.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    env = server_environment(CUDA_VISIBLE_DEVICES="2")
    assert (
        not {"RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK"}
        & env.keys()
    )
    assert env["HF_HUB_OFFLINE"] == "1" and env["CUDA_VISIBLE_DEVICES"] == "2"


def test_a_server_started_from_a_torchrun_rank_can_form_its_own_process_group(monkeypatch, tmp_path):
    """Why the variables go: a process that inherits TORCHELASTIC_USE_AGENT_STORE takes the tcp:// address of its own
    process group for torchrun's agent store and waits, as a client, for a store nobody hosts (vLLM, launched from
    an FSDP trainer's rank 0, never became ready). With `server_environment` it forms its group at once."""
    script = tmp_path / "group.py"
    script.write_text(
        "import datetime, socket, torch.distributed as dist\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]; s.close()\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}', rank=0, world_size=1, "
        "timeout=datetime.timedelta(seconds=5))\nprint('formed')\n"
    )
    monkeypatch.setenv("TORCHELASTIC_USE_AGENT_STORE", "True")
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "0")
    inherited = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert inherited.returncode != 0 and "formed" not in inherited.stdout  # the mechanism, as torch has it
    cleaned = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=server_environment()
    )
    assert cleaned.returncode == 0 and "formed" in cleaned.stdout, cleaned.stderr[-2000:]
