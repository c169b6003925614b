"""The bundled paligemma family: the conformance suite, the prefix LM against the processor's own ``suffix`` encoding
and a plain forward, the published checkpoint layout on the wire."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

import vlmreg
from vlmreg.broadcast import apply_weights
from vlmreg.config import parse_config
from vlmreg.data import ImageStore
from vlmreg.data.prompts import ProcessorContractError, PromptEncoder
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model
from vlmreg.testing.parity import transformers_sdpa
from vlmreg.testing.weights import assert_same_state, loaded_back, sent_weights
from vlmreg.train import batching
from vlmreg.train.batching import make_microbatches
from vlmreg.train.samples import TrainingSample

FAMILY = "paligemma"
QUESTION = "what colour is the shape ?"


class TestPaligemmaConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-paligemma"


def image(colour: str = "red", size: tuple[int, int] = (48, 40)) -> Image.Image:
    return Image.new("RGB", size, colour)


def user(*images: str) -> list[dict]:
    parts = [{"type": "image", "image": i} for i in images]
    return [{"role": "user", "content": [*parts, {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def loaded():
    torch.manual_seed(0)
    run = parse_config(
        {"model": {"init": "random", "family": FAMILY, "dtype": "float32"}, "trainer": {"device": "cpu"}}
    )
    out = vlmreg.load(run)
    out.model.eval()
    return out


def sample(loaded, encoder: PromptEncoder, picture: Image.Image, answer: str) -> tuple[TrainingSample, str]:
    prompt = encoder.encode(user(encoder.store.add(picture)))
    completion = encoder.tokenizer(answer, add_special_tokens=False)["input_ids"] + [encoder.stop_ids[0]]
    tokens = prompt.input_ids + completion
    mask = [False] * len(prompt.input_ids) + [True] * len(completion)
    return TrainingSample(tokens, mask, [0.0] * len(tokens), prompt.image_ids, prompt.image_spans, 1.0, 0, "s"), (
        prompt.text
    )


def suffix_reference(loaded, text: str, picture: Image.Image, answer: str) -> tuple[dict, torch.Tensor]:
    """The processor's own training encoding (its ``suffix``: the answer, then ``<eos>``, marked 1 in
    ``token_type_ids``) and the answer's logprobs from one plain forward of the model on exactly those inputs."""
    inputs = loaded.processor(text=[text], images=[[picture]], suffix=[answer], return_tensors="pt")
    labels = inputs.pop("labels")
    with torch.no_grad(), transformers_sdpa(loaded.model):
        logits = loaded.model(**inputs, use_cache=False).logits.float()
    logp = torch.log_softmax(logits[0, :-1], -1).gather(-1, inputs["input_ids"][0, 1:, None]).squeeze(-1)
    return inputs, logp[labels[0, 1:] != -100]


def vlmreg_logprobs(loaded, encoder, samples):
    [mb] = make_microbatches(samples, loaded.resolved, encoder, budget=1 << 16, packed=True, device=loaded.device)
    with torch.no_grad():
        logp, _ = selected_logprobs(loaded.resolved, mb.inputs, mb.targets, mb.selection)
    return mb, logp


def test_training_inputs_and_logprobs_equal_the_processor_s_suffix_encoding(loaded):
    """The processor writes an answer as a ``suffix`` marked 1 in ``token_type_ids`` (causal), after the prompt marked
    0 (bidirectional): vlmreg's micro-batch is that encoding, and its logprobs a plain forward's on it, for two samples
    of different lengths in one padded micro-batch (``packed=True`` asked: the family is padded)."""
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    pictures, answers = [image("red"), image("blue", (20, 60))], ["red", "blue or green"]
    built = [sample(loaded, encoder, p, a) for p, a in zip(pictures, answers, strict=True)]
    mb, logp = vlmreg_logprobs(loaded, encoder, [s for s, _ in built])
    assert "cu_seq_lens_q" not in mb.inputs  # padded: a packed row cannot express the prefix
    owner = mb.pick(mb.sample_index)
    for k, ((_, text), picture, answer) in enumerate(zip(built, pictures, answers, strict=True)):
        reference, want = suffix_reference(loaded, text, picture, answer)
        width = reference["input_ids"].shape[1]
        assert mb.inputs["input_ids"][k, :width].tolist() == reference["input_ids"][0].tolist()
        assert mb.inputs["token_type_ids"][k, :width].tolist() == reference["token_type_ids"][0].tolist()
        assert mb.inputs["token_type_ids"].dtype == reference["token_type_ids"].dtype  # int64, as the processor's
        assert torch.allclose(logp[owner == k], want, atol=1e-5, rtol=0), (logp[owner == k] - want).abs().max()


def test_with_the_completion_marked_as_prompt_the_logprobs_differ(loaded, monkeypatch):
    """The reference can tell: marking the completion 0 (vlmreg before prefix_lm: every text token 0) lets each answer
    token see the ones after it, and the logprobs move far past the tolerance."""
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    picture = image("red")
    s, text = sample(loaded, encoder, picture, "blue or green")
    _, want = suffix_reference(loaded, text, picture, "blue or green")
    monkeypatch.setattr(batching, "prefix_lm_types", lambda samples, width: torch.zeros((len(samples), width)).long())
    _, logp = vlmreg_logprobs(loaded, encoder, [s])
    assert float((logp - want).abs().max()) > 1e-3


def test_positions_count_from_one_as_the_model_s_own():
    """PaliGemma's forward numbers positions ``arange + 1``; the family's provider gives the same for a prompt alone
    and, under right padding, for each row's real tokens."""
    descriptor = get_registry().get(FAMILY)
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0]])
    assert descriptor.position_ids(None, {"attention_mask": mask}).tolist()[0] == [1, 2, 3, 4]
    assert descriptor.position_ids(None, {"attention_mask": mask}).tolist()[1][:2] == [1, 2]


def test_two_images_are_the_processor_s_own_encoding_with_each_image_s_span(loaded):
    """The processor puts ``<bos>`` after the last image only: a prefix-LM prompt is its whole encoding, and each image
    owns its own run of image tokens."""
    store = ImageStore()
    encoder = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    first, second = image("red"), image("green", (64, 32))
    prompt = encoder.encode(user(store.add(first), store.add(second)))
    own = loaded.processor.apply_chat_template(
        user(first, second), add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    assert prompt.input_ids == own["input_ids"][0].tolist()
    image_id = loaded.processor.image_token_id
    assert [prompt.input_ids[a:b] for a, b in prompt.image_spans] == [[image_id] * 16, [image_id] * 16]
    assert prompt.image_spans == [(0, 16), (16, 32)] and prompt.input_ids[32] == loaded.processor.tokenizer.bos_token_id


def test_a_prompt_without_an_image_is_refused_naming_the_family_and_the_processor(loaded):
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    with pytest.raises(ProcessorContractError) as info:
        encoder.encode(user(), where="d.jsonl:3")
    message = str(info.value)
    assert message.startswith("d.jsonl:3: family paligemma (prefix_lm): its processor (PaliGemmaProcessor) refused")
    assert "`images` are expected" in message


def test_a_second_turn_is_refused_naming_prefix_lm(loaded):
    store = ImageStore()
    encoder = PromptEncoder(loaded.processor, store, loaded.resolved.descriptor)
    prompt = encoder.encode(user(store.add(image())))
    with pytest.raises(vlmreg.VlmregError, match="is a prefix-LM family \\(descriptor field prefix_lm\\)"):
        encoder.extend(prompt, [encoder.stop_ids[0]], user(), where="episode 0 turn 2")


def test_the_tiny_config_is_paligemma_2_s_gemma_2_decoder():
    config = get_registry().get(FAMILY).tiny_config()
    assert config.model_type == "paligemma" and config.text_config.model_type == "gemma2"
    assert config.text_config.layer_types == ["sliding_attention", "full_attention"]
    assert config.text_config.attn_logit_softcapping is not None  # what sdpa cannot do: vlmreg soft-caps itself
    assert config.vision_config.projection_dim == config.text_config.hidden_size
    assert config.text_config.num_image_tokens == 16


def test_sent_names_are_the_published_layout():
    """google/paligemma2-*: language_model.model.*, vision_tower.vision_model.*, multi_modal_projector.linear.*; the
    lm_head is tied to the embeddings and absent."""
    names = set(sent_weights(tiny_model(FAMILY)))
    assert "language_model.model.embed_tokens.weight" in names
    assert "language_model.model.layers.1.self_attn.q_proj.weight" in names
    assert "vision_tower.vision_model.encoder.layers.0.self_attn.q_proj.weight" in names
    assert {"multi_modal_projector.linear.weight", "multi_modal_projector.linear.bias"} <= names
    assert not [n for n in names if n.startswith(("model.", "lm_head", "language_model.lm_head"))]


def test_sent_tensors_are_save_pretrained_s_but_for_the_vision_wrapper(tmp_path: Path):
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved: dict[str, torch.Tensor] = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(file))
    wire = {
        name.replace("vision_tower.vision_model.", "vision_tower.", 1): t for name, t in sent_weights(model).items()
    }
    assert_same_state(wire, saved)


def test_sent_tensors_load_back_through_transformers_to_identical_weights(tmp_path: Path):
    model = tiny_model(FAMILY)
    assert_same_state(loaded_back(model, tmp_path).state_dict(), model.state_dict())


def test_apply_weights_maps_the_published_names_back():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, sent_weights(source.model)) == len(list(target.model.parameters()))
    assert_same_state(target.model.state_dict(), source.model.state_dict())


def test_unknown_names_are_refused():
    with pytest.raises(ValueError, match="not a PaliGemma checkpoint name"):
        list(get_registry().get(FAMILY).memory_weights([("model.language_model.norm.weight", None)]))


def test_trainer_logprobs_and_gradients_cap_the_logits_as_the_model_s_own_head(loaded):
    """Gemma 2 soft-caps its final logits (``final_logit_softcapping``): the trainer's chunked head caps them too.
    Against the model's own forward (all logits, its head) and autograd through it; a cap of 0.5 changes every
    logit, where the published 30 barely touches a random init's."""
    model = loaded.model
    text = model.config.get_text_config()
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    s, _ = sample(loaded, encoder, image("red"), "blue or green")
    [mb] = make_microbatches([s], loaded.resolved, encoder, budget=1 << 16, packed=False, device=loaded.device)
    saved = text.final_logit_softcapping
    text.final_logit_softcapping = 0.5
    try:
        mine, _ = selected_logprobs(loaded.resolved, mb.inputs, mb.targets, mb.selection)
        logits = model(**mb.inputs, use_cache=False).logits.float()
        own = torch.log_softmax(logits, -1).gather(-1, mb.targets[..., None]).squeeze(-1)[mb.loss_mask]
        assert torch.allclose(mine, own, atol=1e-5), (mine - own).abs().max()
        head = model.get_submodule("lm_head").weight
        (grad_mine,) = torch.autograd.grad(mine.sum(), head)
        (grad_own,) = torch.autograd.grad(own.sum(), head)
        assert torch.allclose(grad_mine, grad_own, atol=1e-5), (grad_mine - grad_own).abs().max()
        text.final_logit_softcapping = None
        uncapped, _ = selected_logprobs(loaded.resolved, mb.inputs, mb.targets, mb.selection)
        assert float((uncapped - own).abs().max()) > 1e-3  # the cap matters here: without it the check would fail
    finally:
        text.final_logit_softcapping = saved


def test_a_sample_without_generated_tokens_is_all_prefix_as_the_processor_writes_a_prompt_without_suffix(loaded):
    """A sample whose loss mask is all false (nothing generated: an empty completion) is marked 0 throughout, as the
    processor marks a prompt given no ``suffix``; beside it, a sample with an answer is marked 1 from its answer on."""
    encoder = PromptEncoder(loaded.processor, ImageStore(), loaded.resolved.descriptor)
    picture = image("red")
    answered, text = sample(loaded, encoder, picture, "red")
    start = answered.loss_mask.index(True)
    empty = TrainingSample(
        answered.input_ids[:start],
        [False] * start,
        [0.0] * start,
        answered.image_ids,
        answered.image_spans,
        1.0,
        1,
        "e",
    )
    reference = loaded.processor(text=[text], images=[[picture]], return_tensors="pt")["token_type_ids"][0]
    assert reference.sum() == 0 and len(reference) == start
    types = batching.prefix_lm_types([answered, empty], len(answered))
    assert types[1].tolist() == [*reference.tolist(), *[0] * (len(answered) - start)]
    assert types[0].tolist() == [0] * start + [1] * (len(answered) - start)
