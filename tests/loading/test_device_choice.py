"""The trainer's GPU always carries its index: a bare ``cuda`` resolves per thread (a helper thread's is GPU 0)."""

from __future__ import annotations

import pytest
import torch

from vlmreg.loading.load import choose_device
from vlmreg.sdk.errors import VlmregError


@pytest.fixture
def second_gpu_current(monkeypatch):
    # torchrun's rank 1 after torch.cuda.set_device(1): the state choose_device reads (no GPU needed to check it)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)


@pytest.mark.parametrize("setting", ["cuda", "auto"])
def test_a_bare_cuda_setting_names_the_current_gpu(second_gpu_current, setting):
    # the FSDP2 failure on 2 GPUs: rank 1's micro-batches, built on a helper thread for device "cuda", went to GPU 0
    assert choose_device(setting) == torch.device("cuda", 1)


def test_an_explicit_gpu_is_kept(second_gpu_current):
    assert choose_device("cuda:3") == torch.device("cuda", 3)


def test_cpu_stays_cpu():
    assert choose_device("cpu") == torch.device("cpu")


def test_cuda_without_a_gpu_names_the_setting(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(VlmregError, match="trainer.device = 'cuda:1'"):
        choose_device("cuda:1")
