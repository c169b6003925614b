"""Packed and padded micro-batches give the per-token logprobs of each sample run alone through transformers.

The reference is the model's own forward on one sample (transformers computes positions itself), so this
also checks each family's position provider and packed-sequence handling. Within 1e-5 in fp32.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from PIL import Image

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore, image_part, text_part
from vlmreg.data.prompts import encode_messages
from vlmreg.train.batching import make_microbatches, plan_microbatches
from vlmreg.train.logprobs import selected_logprobs
from vlmreg.train.samples import TrainingSample

FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def setup_family(family: str, device: str = "cpu"):
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": device}}))
    if loaded.resolved.descriptor.prepare_model:
        loaded.resolved.descriptor.prepare_model(loaded.model)
    loaded.model.eval()
    store = ImageStore()
    conversations = [
        [{"role": "user", "content": [image_part(store.add(Image.new("RGB", (64, 64), "red"))), text_part("What colour is it?")]}],
        [{"role": "user", "content": [image_part(store.add(Image.new("RGB", (96, 64), "blue"))),
                                      image_part(store.add(Image.new("RGB", (64, 128), "green"))), text_part("Two images")]}],
        [{"role": "user", "content": "no image here, only text"}],
        [{"role": "user", "content": [image_part(store.add(Image.new("RGB", (64, 64), "red"))), text_part("the red one again")]}],
    ]
    samples = []
    for k, conversation in enumerate(conversations):
        prompt = encode_messages(conversation, loaded.processor, store)
        completion = torch.randint(10, 1000, (6 + k,)).tolist()
        ids = prompt.input_ids + completion
        mask = [False] * len(prompt.input_ids) + [True] * len(completion)
        samples.append(TrainingSample(ids, mask, [0.0] * len(ids), prompt.image_ids, prompt.image_tokens, 1.0, k, f"sample {k}"))
    return loaded, store, samples


def per_sample(loaded, store, samples, *, packed: bool, budget: int = 4096) -> dict[int, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for mb in make_microbatches(samples, loaded.resolved, loaded.processor, store, budget=budget, packed=packed, device=loaded.device):
            logp, _ = selected_logprobs(loaded.resolved, mb.inputs, mb.targets, mb.loss_mask)
            owner = mb.sample_index[mb.loss_mask]
            for i in owner.unique().tolist():
                out[i] = logp[owner == i]
    return out


def reference(loaded, store, samples) -> dict[int, torch.Tensor]:
    """Each sample alone through the full model, positions left to transformers."""
    out = {}
    with torch.no_grad():
        for i, s in enumerate(samples):
            mb = make_microbatches([s], loaded.resolved, loaded.processor, store, budget=4096, packed=False, device=loaded.device)[0]
            inputs = {k: v for k, v in mb.inputs.items() if k != "position_ids"}
            logits = loaded.model(**inputs, use_cache=False).logits.float()
            out[i] = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None]).squeeze(-1)[mb.loss_mask]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded_equals_alone(family):
    loaded, store, samples = setup_family(family)
    alone = reference(loaded, store, samples)
    packed = per_sample(loaded, store, samples, packed=True)
    padded = per_sample(loaded, store, samples, packed=False)
    split = per_sample(loaded, store, samples, packed=True, budget=max(len(s) for s in samples))  # several micro-batches
    for i in range(len(samples)):
        for got in (packed[i], padded[i], split[i]):
            assert got.shape == alone[i].shape
            assert torch.allclose(got, alone[i], atol=1e-5), (family, i, float((got - alone[i]).abs().max()))


def test_the_position_provider_matters():
    loaded, store, samples = setup_family("qwen3_vl")
    alone = reference(loaded, store, samples)
    plain = attrs.evolve(loaded.resolved, descriptor=attrs.evolve(loaded.resolved.descriptor, position_ids=None))
    wrong = per_sample(attrs.evolve(loaded, resolved=plain), store, samples, packed=True)
    assert float((wrong[0] - alone[0]).abs().max()) > 1e-3  # 1-D positions are wrong for M-RoPE image tokens


def test_linear_attention_needs_segmenting_to_pack():
    loaded, store, samples = setup_family("qwen3_5")  # prepare_model already applied: segments are kept apart
    packed = per_sample(loaded, store, samples, packed=True)
    assert len(packed) == len(samples)


def test_plan_respects_the_budget():
    lengths = [50, 40, 30, 30, 20, 10]
    for packed in (True, False):
        plan = plan_microbatches(lengths, 100, packed=packed)
        assert sorted(i for b in plan for i in b) == list(range(6))
        for members in plan:
            used = sum(lengths[i] for i in members) if packed else max(lengths[i] for i in members) * len(members)
            assert used <= 100
    assert len(plan_microbatches(lengths, 100, packed=True)) == 2
