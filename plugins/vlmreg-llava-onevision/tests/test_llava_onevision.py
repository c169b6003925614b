"""The bundled llava_onevision family: the conformance suite, anyres token counts per image, the published checkpoint
layout on the wire, processors."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import peft
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import LlavaOnevisionConfig, LlavaOnevisionForConditionalGeneration, LlavaOnevisionProcessor
from transformers.models.llava_onevision.image_processing_pil_llava_onevision import LlavaOnevisionImageProcessorPil
from transformers.utils import is_torchvision_available
from vlmreg_llava_onevision import processor as p
from vlmreg_llava_onevision.processor import PerImageAnyresImageProcessor

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.config import parse_config
from vlmreg.loading.build import build_model
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model
from vlmreg.testing.weights import assert_same_state, loaded_back, sent_weights

FAMILY = "llava_onevision"
QUESTION = "what colour is the image ?"


class TestLlavaOnevisionConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-llava-onevision"


# --- images: anyres tiles and tokens -----------------------------------------------------------------------------


def _expected_tokens(width: int, height: int, tiles_h: int, tiles_w: int, side: int = 3, max_tiles: int = 9) -> int:
    """LLaVA-OneVision's count, written out from the paper's recipe: the whole image (side x side features), then the
    tiles' side*tiles x side*tiles grid with the padding rows or columns removed, shrunk when over max_tiles tiles, one
    image_newline after each remaining row."""
    rows, cols = side * tiles_h, side * tiles_w
    if width / height > cols / rows:  # wider than the grid: padding above and below
        kept = int(round(height * cols / width, 7))
        rows -= 2 * ((rows - kept) // 2)
    else:
        kept = int(round(width * rows / height, 7))
        cols -= 2 * ((cols - kept) // 2)
    ratio = math.sqrt(rows * cols / (max_tiles * side * side))
    if ratio > 1.1:
        rows, cols = int(rows // ratio), int(cols // ratio)
    return side * side + rows * cols + rows


def _encode(processor, sizes, fill="red"):
    content = [{"type": "image"} for _ in sizes] + [{"type": "text", "text": QUESTION}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    return processor(text=[text], images=[[Image.new("RGB", s, fill) for s in sizes]], return_tensors="pt")


def _tokens_per_image(ids: list[int], image_id: int) -> list[int]:
    runs, count = [], 0
    for t in [*ids, -1]:
        if t == image_id:
            count += 1
        elif count:
            runs.append(count)
            count = 0
    return runs


#: (width, height) -> (tiles high, tiles wide) chosen from the tiny pinpoints
TILINGS = {(64, 64): (2, 2), (32, 64): (2, 1), (96, 32): (1, 3), (24, 24): (1, 1), (40, 30): (2, 2), (70, 20): (1, 3)}


def test_each_image_gets_its_anyres_token_count():
    """Mixed sizes in one prompt: each image's <image> run is its own anyres count (51, 33, 39, ...), the pixel
    tensors hold 1 + tiles per image, and the model's packed features fit the tokens exactly (a forward runs)."""
    processor = get_registry().get(FAMILY).tiny_processor()
    sizes = list(TILINGS)
    out = _encode(processor, sizes)
    runs = _tokens_per_image(out["input_ids"][0].tolist(), processor.image_token_id)
    assert runs == [_expected_tokens(w, h, *TILINGS[(w, h)]) for w, h in sizes]
    assert runs[:3] == [51, 33, 39]
    assert out["pixel_values"].shape == (len(sizes), 5, 3, 24, 24)
    assert out["image_sizes"].tolist() == [[h, w] for w, h in sizes]
    assert out["batch_num_images"].tolist() == [1] * len(sizes)
    with torch.no_grad():
        logits = tiny_model(FAMILY)(**out).logits
    assert logits.shape[:2] == out["input_ids"].shape and torch.isfinite(logits).all()


def test_past_anyres_max_features_shrink_and_the_model_agrees():
    """``anyres_max_1``: a 64x64 image's 6x6 tile features are 4 tiles' worth, over one tile's 9 by a ratio of
    sqrt(36 / 9) = 2, so they shrink to 3x3 plus 3 newlines; the processor's count and the model's features agree."""

    descriptor = get_registry().get(FAMILY)
    processor = descriptor.tiny_processor()
    processor.vision_aspect_ratio = "anyres_max_1"
    config = descriptor.tiny_config()
    config.vision_aspect_ratio = "anyres_max_1"
    out = _encode(processor, [(64, 64)])
    assert _tokens_per_image(out["input_ids"][0].tolist(), processor.image_token_id) == [9 + 3 * 3 + 3]
    assert _expected_tokens(64, 64, 2, 2, max_tiles=1) == 21
    torch.manual_seed(0)
    with torch.no_grad():
        logits = LlavaOnevisionForConditionalGeneration(config).eval()(**out).logits
    assert torch.isfinite(logits).all()


def test_every_image_is_tiled_as_if_alone_unlike_transformers_stock_processor():
    """vlmreg expands each image alone; this processor tiles every image, so two images in one prompt get what each
    gets alone (vLLM does the same). transformers' stock image processor would give each of them a single padded
    tile (9 features + 1 newline): the deliberate difference."""

    processor = get_registry().get(FAMILY).tiny_processor()
    alone = [
        _tokens_per_image(_encode(processor, [s])["input_ids"][0].tolist(), processor.image_token_id)[0]
        for s in ((64, 64), (96, 32))
    ]
    together = _tokens_per_image(
        _encode(processor, [(64, 64), (96, 32)])["input_ids"][0].tolist(), processor.image_token_id
    )
    assert together == alone == [51, 39]
    stock = LlavaOnevisionImageProcessorPil(
        **{k: getattr(processor.image_processor, k) for k in ("image_grid_pinpoints", "image_mean", "image_std")},
        size={"height": 24, "width": 24},
    )

    stock_out = stock([[Image.new("RGB", (64, 64)), Image.new("RGB", (96, 32))]], return_tensors="pt")
    assert stock_out["batch_num_images"].tolist() == [2] and stock_out["pixel_values"].shape[1] == 1


def test_the_tiny_tokenizer_asset():
    tokenizer = p.tiny_tokenizer()
    assert len(tokenizer) == p.VOCAB_SIZE
    expected = {
        "<|endoftext|>": p.PAD_ID,
        "<|im_start|>": p.BOS_ID,
        "<|im_end|>": p.EOS_ID,
        "<image>": p.IMAGE_ID,
        "<video>": p.VIDEO_ID,
    }
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in expected} == expected
    assert (tokenizer.image_token, tokenizer.video_token) == ("<image>", "<video>")
    assert [len(tokenizer(w, add_special_tokens=False)["input_ids"]) for w in ("Red", "Green", "Blue")] == [1, 1, 1]
    config = get_registry().get(FAMILY).tiny_config()
    assert (
        config.image_token_id,
        config.video_token_id,
        config.text_config.vocab_size,
        config.text_config.eos_token_id,
    ) == (p.IMAGE_ID, p.VIDEO_ID, p.VOCAB_SIZE, p.EOS_ID)
    assert (config.vision_config.image_size, config.vision_config.patch_size) == (p.TILE_SIZE, p.PATCH_SIZE)
    assert (
        config.image_grid_pinpoints == p.GRID_PINPOINTS
        and p.tiny_processor().image_processor.image_grid_pinpoints == p.GRID_PINPOINTS
    )


def test_the_tiny_model_is_small():
    assert 100_000 < sum(t.numel() for t in tiny_model(FAMILY).parameters()) < 500_000


# --- weights on the wire -----------------------------------------------------------------------------------------


def test_sent_names_are_the_published_layout():
    """llava-hf/llava-onevision-qwen2-*-hf: language_model.model.*, language_model.lm_head.weight,
    vision_tower.vision_model.* (SigLIP), multi_modal_projector.{linear_1,linear_2} and the bare image_newline (a
    connector parameter): every parameter, once."""
    model = tiny_model(FAMILY)
    wire = sent_weights(model)
    for name in (
        "language_model.model.embed_tokens.weight",
        "language_model.model.layers.1.self_attn.q_proj.weight",
        "language_model.model.layers.1.self_attn.q_proj.bias",
        "language_model.model.norm.weight",
        "language_model.lm_head.weight",
        "vision_tower.vision_model.embeddings.patch_embedding.weight",
        "vision_tower.vision_model.embeddings.position_embedding.weight",
        "vision_tower.vision_model.encoder.layers.1.self_attn.out_proj.weight",
        "vision_tower.vision_model.encoder.layers.0.mlp.fc2.bias",
        "vision_tower.vision_model.post_layernorm.weight",
        "multi_modal_projector.linear_1.weight",
        "multi_modal_projector.linear_2.bias",
    ):
        assert name in wire, name
    assert not [n for n in wire if n.startswith(("model.", "lm_head"))]
    assert wire["image_newline"].shape == (model.config.text_config.hidden_size,)
    assert len(wire) == len(list(model.parameters()))
    config = model.config
    assert wire["multi_modal_projector.linear_1.weight"].shape == (
        config.text_config.hidden_size,
        config.vision_config.hidden_size,
    )
    assert wire["vision_tower.vision_model.embeddings.position_embedding.weight"].shape == (
        9,
        config.vision_config.hidden_size,
    )


#: llava-onevision-qwen2-0.5b-ov-hf's shape: Qwen2-0.5B decoder, SigLIP-so400m (27x27 patches of 14 px, no head).
OV_05B_SHAPE = {
    "image_token_index": 151646,
    "video_token_index": 151647,
    "vision_feature_select_strategy": "full",
    "vision_feature_layer": -1,
    "text_config": {
        "model_type": "qwen2",
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 152000,
        "tie_word_embeddings": False,
    },
    "vision_config": {
        "model_type": "siglip_vision_model",
        "hidden_size": 1152,
        "intermediate_size": 4304,
        "num_hidden_layers": 26,
        "num_attention_heads": 16,
        "image_size": 384,
        "patch_size": 14,
        "vision_use_head": False,
    },
}


def test_names_and_shapes_at_the_published_size():
    """On the meta device at the 0.5b checkpoint's size: the published names with the shapes that size implies."""

    descriptor = get_registry().get(FAMILY)
    model = build_model(LlavaOnevisionConfig(**OV_05B_SHAPE), descriptor, device="meta")
    wire = {name: tuple(t.shape) for name, t in descriptor.checkpoint_weights(model.named_parameters())}
    assert {
        k: wire[k]
        for k in (
            "language_model.model.embed_tokens.weight",
            "language_model.lm_head.weight",
            "language_model.model.layers.23.self_attn.k_proj.weight",
            "vision_tower.vision_model.embeddings.patch_embedding.weight",
            "vision_tower.vision_model.embeddings.position_embedding.weight",
            "vision_tower.vision_model.encoder.layers.25.self_attn.q_proj.weight",
            "vision_tower.vision_model.encoder.layers.25.mlp.fc1.weight",
            "multi_modal_projector.linear_1.weight",
            "multi_modal_projector.linear_2.weight",
            "image_newline",
        )
    } == {
        "language_model.model.embed_tokens.weight": (152000, 896),
        "language_model.lm_head.weight": (152000, 896),
        "language_model.model.layers.23.self_attn.k_proj.weight": (128, 896),
        "vision_tower.vision_model.embeddings.patch_embedding.weight": (1152, 3, 14, 14),
        "vision_tower.vision_model.embeddings.position_embedding.weight": (729, 1152),
        "vision_tower.vision_model.encoder.layers.25.self_attn.q_proj.weight": (1152, 1152),
        "vision_tower.vision_model.encoder.layers.25.mlp.fc1.weight": (4304, 1152),
        "multi_modal_projector.linear_1.weight": (896, 1152),
        "multi_modal_projector.linear_2.weight": (896, 896),
        "image_newline": (896,),
    }


def test_sent_tensors_are_save_pretrained_s_but_for_the_vision_wrapper(tmp_path: Path):
    """Against transformers' own writer (5.23): the same tensors, values and shapes; the names differ only where
    save_pretrained drops the SigLIP ``vision_model.`` segment that the published checkpoints keep."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved: dict[str, torch.Tensor] = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(file))
    wire = sent_weights(model)
    assert all(n.startswith("vision_tower.vision_model.") for n in wire if n.startswith("vision_tower."))
    assert_same_state({n.replace("vision_tower.vision_model.", "vision_tower.", 1): t for n, t in wire.items()}, saved)


def test_sent_tensors_load_back_through_transformers_to_identical_weights(tmp_path: Path):
    """The sent tensors written as a checkpoint and read by from_pretrained: every weight identical, image_newline's
    too."""
    model = tiny_model(FAMILY)
    assert_same_state(loaded_back(model, tmp_path).state_dict(), model.state_dict())


def test_image_newline_trains_and_syncs_with_the_projector():
    """A trainable image_newline is in every sync while the vision tower is frozen; freeze_connectors freezes it."""

    def load(**vlm):
        return vlmreg.load(
            parse_config({"model": {"init": "random", "family": FAMILY, "vlm": vlm}, "trainer": {"device": "cpu"}})
        )

    loaded = load()
    resolved = loaded.resolved
    assert resolved.connector_parameters == {"model.image_newline": resolved.model.model.image_newline}
    assert resolved.model.model.image_newline.requires_grad
    assert not any(p.requires_grad for p in resolved.vision_encoder.parameters())
    sent = [n for n, _ in WeightPlan.from_resolved(resolved, include_frozen_vision=False).shapes()]
    assert "image_newline" in sent and not [n for n in sent if n.startswith("vision_tower.")]
    assert not load(freeze_connectors=True).resolved.model.model.image_newline.requires_grad


def test_apply_weights_maps_the_published_names_back():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, sent_weights(source.model)) == len(list(target.model.parameters()))
    assert_same_state(target.model.state_dict(), source.model.state_dict())


def test_unknown_names_are_refused():
    descriptor = get_registry().get(FAMILY)
    with pytest.raises(ValueError, match="not a LLaVA-OneVision checkpoint name"):
        list(descriptor.memory_weights([("model.language_model.norm.weight", None)]))
    with pytest.raises(ValueError, match="not a LLaVA-OneVision in-memory parameter name"):
        list(descriptor.checkpoint_weights([("vision_tower.encoder.layers.0.mlp.fc1.weight", None)]))


def test_lora_on_the_projector_sends_merged_weights_equal_to_peft_s_merge_and_unload():
    resolved = vlmreg.resolve(tiny_model(FAMILY))
    config = peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, **resolved.lora_targets("language+projector").peft_kwargs()
    )
    wrapped = peft.get_peft_model(resolved.model, config)
    plan = WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=True)
    adapted = {w.name for w in plan.weights if w.adapters}
    assert {"model.multi_modal_projector.linear_1.weight", "model.multi_modal_projector.linear_2.weight"} <= adapted
    merged = copy.deepcopy(wrapped).merge_and_unload()
    expected = {n: p.detach() for n, p in merged.named_parameters()}
    assert_same_state(dict(plan.tensors()), dict(get_registry().get(FAMILY).checkpoint_weights(expected.items())))


# --- processors --------------------------------------------------------------------------------------------------


def _checkpoint_processor_dir(directory: Path) -> Path:
    """The tiny processor's files laid out as the llava-hf checkpoints ship theirs: processor_config.json naming
    LlavaOnevisionProcessor (num_image_tokens, vision_feature_select_strategy, vision_aspect_ratio),
    preprocessor_config.json naming LlavaOnevisionImageProcessor, a video processor config, the tokenizer."""
    processor = get_registry().get(FAMILY).tiny_processor()
    processor.tokenizer.save_pretrained(directory)
    image = processor.image_processor
    (directory / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "image_processor_type": "LlavaOnevisionImageProcessor",
                "processor_class": "LlavaOnevisionProcessor",
                "size": dict(image.size),
                "image_grid_pinpoints": image.image_grid_pinpoints,
                "image_mean": list(image.image_mean),
                "image_std": list(image.image_std),
                "do_pad": True,
                "resample": 3,
            }
        )
    )
    (directory / "processor_config.json").write_text(
        json.dumps(
            {
                "processor_class": "LlavaOnevisionProcessor",
                "num_image_tokens": processor.num_image_tokens,
                "vision_feature_select_strategy": "full",
                "vision_aspect_ratio": "anyres_max_9",
            }
        )
    )
    (directory / "chat_template.jinja").write_text(processor.chat_template)
    (directory / "video_preprocessor_config.json").write_text(
        json.dumps(
            {"video_processor_type": "LlavaOnevisionVideoProcessor", "processor_class": "LlavaOnevisionProcessor"}
        )
    )
    return directory


def test_a_checkpoint_s_processor_loads_without_torchvision(tmp_path: Path):
    processor = get_registry().get(FAMILY).load_processor(_checkpoint_processor_dir(tmp_path))
    assert isinstance(processor, LlavaOnevisionProcessor) and getattr(processor, "video_processor", None) is None
    assert isinstance(processor.image_processor, PerImageAnyresImageProcessor)
    assert (processor.num_image_tokens, processor.vision_feature_select_strategy, processor.image_token_id) == (
        9,
        "full",
        3,
    )
    tiny = get_registry().get(FAMILY).tiny_processor()
    for sizes in ([(64, 64)], [(32, 64), (96, 32)]):
        got, want = _encode(processor, sizes), _encode(tiny, sizes)
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)


def test_load_processor_refuses_another_family_s_files(tmp_path: Path):
    (tmp_path / "processor_config.json").write_text(json.dumps({"processor_class": "Qwen2VLProcessor"}))
    with pytest.raises(ValueError, match="Qwen2VLProcessor"):
        get_registry().get(FAMILY).load_processor(tmp_path)


def test_the_engine_processor_is_the_full_class_or_says_what_it_needs():
    descriptor = get_registry().get(FAMILY)
    tiny = descriptor.tiny_processor()
    if is_torchvision_available():
        full = descriptor.engine_processor(tiny)
        assert type(full) is LlavaOnevisionProcessor and full.video_processor is not None
    else:
        with pytest.raises(ImportError, match="torchvision"):
            descriptor.engine_processor(tiny)


@pytest.mark.parametrize(
    ("checkpoint", "processor"),
    [
        ("llava-hf/llava-onevision-qwen2-0.5b-ov-hf", "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"),
        ("llava-hf/llava-onevision-qwen2-7b-ov-hf", "llava-hf/llava-onevision-qwen2-7b-ov-hf"),
        ("/ckpts/llava-onevision-qwen2-72b-ov-hf", "llava-hf/llava-onevision-qwen2-72b-ov-hf"),
        ("llava-hf/llava-onevision-qwen2-0.5b-si-hf", "llava-hf/llava-onevision-qwen2-0.5b-si-hf"),
        ("llava-hf/llava-onevision-qwen2-7b-si-hf", "llava-hf/llava-onevision-qwen2-7b-si-hf"),
        ("llava-hf/llava-onevision-qwen2-7b-ov-chat-hf", "llava-hf/llava-onevision-qwen2-7b-ov-chat-hf"),
        ("llava-hf/llava-onevision-qwen2-72b-ov-chat-hf", "llava-hf/llava-onevision-qwen2-72b-ov-chat-hf"),
        ("runs/my-finetune", "llava-hf/llava-onevision-qwen2-0.5b-ov-hf"),
    ],
)
def test_processor_ids_per_checkpoint(checkpoint: str, processor: str):
    assert get_registry().get(FAMILY).processor_id_for(checkpoint) == processor


def test_no_thinking_modes():
    descriptor = get_registry().get(FAMILY)
    assert descriptor.thinking_modes == () and descriptor.thinking_end is None
