"""Packed and padded micro-batches give the per-token logprobs of each sample run alone through transformers.

The reference is the model's own forward on one sample (transformers computes positions itself), so this
also checks each family's position provider and packed-sequence handling. Within 1e-5 in fp32.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from PIL import Image
from transformers import MistralConfig, MistralForCausalLM
from transformers.integrations.sdpa_attention import sdpa_attention_forward

import vlmreg
from vlmreg.config import parse_config
from vlmreg.data import ImageStore, image_part, text_part
from vlmreg.data.prompts import PromptEncoder
from vlmreg.modeling import attention
from vlmreg.modeling.attention import PACKED_TOKENS, packed_rows, register_varlen_attention, varlen_attention_forward
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.modeling.vision_calls import VISION_CALLS
from vlmreg.testing.parity import processor_inputs, transformers_sdpa
from vlmreg.train.batching import make_microbatches, plan_microbatches
from vlmreg.train.samples import TrainingSample

FAMILIES = ["qwen3_vl", "qwen3_vl_moe", "qwen3_5", "qwen3_5_moe"]


def mixed_conversations(store: ImageStore) -> list[list[dict]]:
    """Four prompts that differ in what packing must keep apart: one image, two of other sizes, none, a repeated one."""
    return [
        [
            {
                "role": "user",
                "content": [image_part(store.add(Image.new("RGB", (64, 64), "red"))), text_part("What colour is it?")],
            }
        ],
        [
            {
                "role": "user",
                "content": [
                    image_part(store.add(Image.new("RGB", (96, 64), "blue"))),
                    image_part(store.add(Image.new("RGB", (64, 128), "green"))),
                    text_part("Two images"),
                ],
            }
        ],
        [{"role": "user", "content": "no image here, only text"}],
        [
            {
                "role": "user",
                "content": [image_part(store.add(Image.new("RGB", (64, 64), "red"))), text_part("the red one again")],
            }
        ],
    ]


def setup_family(family: str, device: str = "cpu"):
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": device}}))
    if loaded.resolved.descriptor.prepare_model:
        loaded.resolved.descriptor.prepare_model(loaded.model)
    loaded.model.eval()
    store = ImageStore()
    encoder = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    conversations = mixed_conversations(store)
    samples = []
    for k, conversation in enumerate(conversations):
        prompt = encoder.encode(conversation)
        completion = torch.randint(10, 1000, (6 + k,)).tolist()
        ids = prompt.input_ids + completion
        mask = [False] * len(prompt.input_ids) + [True] * len(completion)
        samples.append(
            TrainingSample(ids, mask, [0.0] * len(ids), prompt.image_ids, prompt.image_spans, 1.0, k, f"sample {k}")
        )
    return loaded, encoder, samples


def per_sample(loaded, store, samples, *, packed: bool, budget: int = 4096) -> dict[int, torch.Tensor]:
    out = {}
    with torch.no_grad():
        for mb in make_microbatches(
            samples, loaded.resolved, store, budget=budget, packed=packed, device=loaded.device
        ):
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
            mb = make_microbatches([s], loaded.resolved, store, budget=4096, packed=False, device=loaded.device)[0]
            inputs = {k: v for k, v in mb.inputs.items() if k not in ("position_ids", VISION_CALLS)}
            logits = loaded.model(**inputs, use_cache=False).logits.float()
            out[i] = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None]).squeeze(-1)[mb.loss_mask]
    return out


@pytest.mark.parametrize("family", FAMILIES)
def test_packed_equals_padded_equals_alone(family):
    loaded, store, samples = setup_family(family)
    alone = reference(loaded, store, samples)
    packed = per_sample(loaded, store, samples, packed=True)
    padded = per_sample(loaded, store, samples, packed=False)
    # several micro-batches
    split = per_sample(loaded, store, samples, packed=True, budget=max(len(s) for s in samples))
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


def test_sliding_windows_are_honoured_in_packed_rows():
    """A decoder with sliding-window layers: each packed segment gets what transformers' own sdpa mask gives it
    alone."""

    config = MistralConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        sliding_window=4,
        max_position_embeddings=256,
    )
    torch.manual_seed(0)
    model = MistralForCausalLM(config).eval()
    lengths = [11, 7, 13]
    rows = [torch.randint(0, 128, (1, n)) for n in lengths]
    with torch.no_grad():
        model.set_attn_implementation("sdpa")
        alone = [model(input_ids=r).logits for r in rows]
        model.set_attn_implementation(register_varlen_attention())
        bounds = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
        positions = torch.cat([torch.arange(n) for n in lengths])[None]
        with packed_rows():
            packed = model(
                input_ids=torch.cat(rows, dim=1),
                position_ids=positions,
                cu_seq_lens_q=bounds,
                cu_seq_lens_k=bounds,
                max_length_q=max(lengths),
                max_length_k=max(lengths),
            ).logits
        # no mask given: transformers' own (windowed) mask still applies
        unpacked = [model(input_ids=r).logits for r in rows]
        # the same call with the windows removed differs: the check can fail
        for layer in model.model.layers:
            layer.self_attn.sliding_window = None
        model.config.sliding_window = None
        with packed_rows():
            wide = model(
                input_ids=torch.cat(rows, dim=1),
                position_ids=positions,
                cu_seq_lens_q=bounds,
                cu_seq_lens_k=bounds,
                max_length_q=max(lengths),
                max_length_k=max(lengths),
            ).logits
    reference = torch.cat(alone, dim=1)
    assert float((packed - reference).abs().max()) < 1e-5
    assert max(float((u - a).abs().max()) for u, a in zip(unpacked, alone, strict=True)) < 1e-5
    assert float((wide - reference).abs().max()) > 1e-3


def test_segments_of_other_rows_fall_back_to_sdpa_without_reading_the_gpu():
    """transformers 5.17 hands a vision tower's per-image attention calls the text model's keyword arguments: the
    text's segment table must not be applied to an image's patches. The trainer's token count (a host int) tells them
    apart; against transformers' own sdpa function."""

    torch.manual_seed(0)
    module = torch.nn.Module()
    module.is_causal = False
    q, k, v = (torch.randn(1, 2, 6, 8) for _ in range(3))  # one image: 6 patches
    text = {
        "cu_seq_lens_q": torch.tensor([0, 5, 12], dtype=torch.int32),
        "cu_seq_lens_k": torch.tensor([0, 5, 12], dtype=torch.int32),
        "max_length_q": 7,
        "max_length_k": 7,
        PACKED_TOKENS: 12,
        "is_causal": False,
    }
    ours, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.25, **text)
    theirs, _ = sdpa_attention_forward(module, q, k, v, None, scaling=0.25, is_causal=False)
    torch.testing.assert_close(ours, theirs)
    # the text's own rows (12 tokens) are split into its two segments
    q, k, v = (torch.randn(1, 2, 12, 8) for _ in range(3))
    packed, _ = varlen_attention_forward(module, q, k, v, None, scaling=0.25, **text)
    first, _ = sdpa_attention_forward(
        module, q[:, :, :5], k[:, :, :5], v[:, :, :5], None, scaling=0.25, is_causal=False
    )
    torch.testing.assert_close(packed[:, :5], first)


@pytest.mark.parametrize("family", ["qwen3_vl", "glm4v"])
def test_a_vision_encoder_attends_over_its_images_in_one_call_per_block(family, monkeypatch):
    """With varlen attention the vision encoder gets a "flash"-named implementation, so transformers' packing towers
    pass every image's segment in one call (not one call per image), and the text's packing arguments never reach
    it; the logits equal transformers' sdpa forward."""

    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))
    encoder = loaded.resolved.vision_encoder
    assert encoder.config._attn_implementation == attention.VISION_VARLEN
    calls = []
    real = attention.varlen_attention_forward
    monkeypatch.setattr(attention, "varlen_attention_forward", lambda *a, **k: calls.append(k) or real(*a, **k))
    images = [
        Image.new("RGB", (64, 64), "red"),
        Image.new("RGB", (64, 96), "blue"),
        Image.new("RGB", (96, 64), "green"),
    ]
    conversation = [
        {
            "role": "user",
            "content": [*({"type": "image", "image": i} for i in images), {"type": "text", "text": "colours?"}],
        }
    ]
    inputs = processor_inputs(loaded.processor, conversation, [40, 41, 42])
    width = inputs["input_ids"].shape[1]
    text = torch.tensor([0, width], dtype=torch.int32)  # the text as one packed row: arguments the encoder must not see
    with torch.no_grad():
        ours = loaded.model(
            **inputs,
            cu_seq_lens_q=text,
            cu_seq_lens_k=text,
            max_length_q=width,
            max_length_k=width,
            **{attention.PACKED_TOKENS: width},
        ).logits
        with transformers_sdpa(loaded.model):
            reference = loaded.model(**inputs).logits
    assert encoder.config._attn_implementation == attention.VISION_VARLEN  # put back after the reference
    blocks = len(loaded.resolved.vision_blocks)
    vision = [k for k in calls if not torch.equal(k["cu_seq_lens_q"].cpu(), text)]
    assert len(vision) == blocks and all(len(k["cu_seq_lens_q"]) == len(images) + 1 for k in vision)
    assert all(k["is_causal"] is False for k in vision)
    torch.testing.assert_close(ours, reference, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("padded", [False, True])
def test_soft_capped_attention_equals_transformers_own_eager_gemma2(padded):
    """Gemma 2 soft-caps its attention logits, which sdpa cannot (transformers refuses sdpa for it): through vlmreg's
    attention a padded or unpadded batch gives transformers' own eager forward's logits, where sdpa's would drop the
    cap."""
    from transformers import Gemma2Config, Gemma2ForCausalLM  # noqa: PLC0415 - beside the test that needs it

    torch.manual_seed(0)
    config = Gemma2Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        query_pre_attn_scalar=8,
        sliding_window=4,
        attn_logit_softcapping=0.5,  # small: the cap changes every logit (the published models cap at 50)
        attn_implementation="eager",
    )
    model = Gemma2ForCausalLM(config).eval()
    with torch.no_grad():
        for layer in model.model.layers:  # logits of a random init are near 0, where the cap is the identity
            layer.self_attn.q_proj.weight.mul_(40)
    ids = torch.randint(0, 64, (2, 9))
    mask = torch.ones_like(ids)
    if padded:
        mask[1, 6:] = 0
    with torch.no_grad():
        reference = model(input_ids=ids, attention_mask=mask).logits
        model.set_attn_implementation(register_varlen_attention())
        mine = model(input_ids=ids, attention_mask=mask).logits
        capped = model.model.layers[0].self_attn.attn_logit_softcapping
        model.model.layers[0].self_attn.attn_logit_softcapping = None  # what sdpa computes: no cap
        uncapped = model(input_ids=ids, attention_mask=mask).logits
        model.model.layers[0].self_attn.attn_logit_softcapping = capped
    real = mask.bool()
    assert torch.allclose(mine[real], reference[real], atol=1e-5), (mine - reference)[real].abs().max()
    assert (uncapped[real] - reference[real]).abs().max() > 1e-3  # the cap matters here


def test_soft_capped_attention_refuses_a_packed_row():
    query = torch.zeros(1, 2, 4, 8)
    lengths = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="soft-capped at 50.0 in a packed row: .* declare the family packing=False"):
        varlen_attention_forward(
            torch.nn.Module(), query, query, query, None, cu_seq_lens_q=lengths, softcap=50.0, **{PACKED_TOKENS: 4}
        )
