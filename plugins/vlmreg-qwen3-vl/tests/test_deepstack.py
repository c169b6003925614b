"""DeepStack without host waits (`vlmreg_qwen_common.deepstack`) computes exactly what transformers' own does.

The reference is transformers' ``Qwen3VLTextModel._deepstack_process`` on the same model, inputs and weights:
logits and every gradient, with the vision tower frozen and trained.
"""

from __future__ import annotations

import copy

import pytest
import torch
from PIL import Image
from vlmreg_qwen_common.deepstack import add_deepstack_without_waiting

import vlmreg
from vlmreg.config import parse_config
from vlmreg.testing.parity import processor_inputs


def forward_backward(model, inputs, train_vision: bool):
    model.zero_grad(set_to_none=True)
    for p in model.model.visual.parameters():
        p.requires_grad_(train_vision)
    logits = model(**inputs, use_cache=False).logits
    (logits.float().square().mean()).backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return logits.detach(), grads


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("train_vision", [False, True])
def test_deepstack_without_waiting_equals_transformers_own(train_vision, device):
    torch.manual_seed(0)
    loaded = vlmreg.load(
        parse_config({"model": {"init": "random", "family": "qwen3_vl"}, "trainer": {"device": device}})
    )
    reference = loaded.model
    ours = copy.deepcopy(reference)
    assert add_deepstack_without_waiting(ours)
    calls = []
    real = ours.model.language_model._deepstack_process
    ours.model.language_model._deepstack_process = lambda *a: calls.append(1) or real(*a)
    images = [Image.new("RGB", (64, 64), "red"), Image.new("RGB", (96, 64), "blue")]
    conversation = [
        {"role": "user", "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": "?"}]}
    ]
    inputs = {k: v.to(device) for k, v in processor_inputs(loaded.processor, conversation, [40, 41, 42]).items()}
    want_logits, want_grads = forward_backward(reference, inputs, train_vision)
    got_logits, got_grads = forward_backward(ours, inputs, train_vision)
    assert calls, "the text model never called _deepstack_process: the test would prove nothing"
    torch.testing.assert_close(got_logits, want_logits, rtol=0, atol=0)
    assert got_grads.keys() == want_grads.keys()
    assert any("visual" in n for n in got_grads) == train_vision
    for name, grad in want_grads.items():
        torch.testing.assert_close(got_grads[name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_model_without_deepstack_is_left_alone():
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": "qwen3_5"}, "trainer": {"device": "cpu"}}))
    assert not add_deepstack_without_waiting(loaded.model)
    assert "_deepstack_process" not in vars(loaded.model.model.language_model)
