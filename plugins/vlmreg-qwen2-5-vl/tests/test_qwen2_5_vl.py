"""The bundled qwen2_5_vl family: conformance, published checkpoint names on the wire, real configs resolving."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
from transformers.video_utils import VideoMetadata
from transformers.vision_utils import get_vision_window_index
from vlmreg_qwen_common.processor import TINY_PROCESSOR_DIR

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.cli import main
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.video import DecodedVideo
from vlmreg.loading.build import build_model, load_config
from vlmreg.modeling.logprobs import selected_logprobs
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model
from vlmreg.testing.video_parity import video_prompt_parity
from vlmreg.train.batching import make_microbatches
from vlmreg.train.samples import TrainingSample

FAMILY = "qwen2_5_vl"
CONFIGS = Path(__file__).with_name("configs")


class TestQwen25VlConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-qwen2-5-vl"


def _sent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    plan = WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True)
    return {name: tensor.detach().contiguous().clone() for name, tensor in plan.tensors()}


def test_sent_names_and_values_equal_what_save_pretrained_writes(tmp_path):
    """transformers writes Qwen2.5-VL in the published layout (``visual.*``, ``model.layers.*``), not the in-memory
    one."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = _sent(model)
    assert sorted(sent) == sorted(saved)
    assert all(torch.equal(sent[name], saved[name]) for name in saved)
    for name in (
        "visual.blocks.0.attn.qkv.weight",
        "visual.merger.mlp.0.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.embed_tokens.weight",
        "model.norm.weight",
        "lm_head.weight",
    ):
        assert name in sent
    assert not [n for n in sent if n.startswith(("model.visual.", "model.language_model."))]


def test_sent_checkpoint_loads_back_through_transformers_to_identical_weights(tmp_path):
    model = tiny_model(FAMILY)
    model.config.save_pretrained(tmp_path)
    save_file(_sent(model), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path)
    expected = model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    assert all(torch.equal(t, expected[n]) for n, t in loaded.state_dict().items())


def test_apply_weights_takes_published_names():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, _sent(source.model)) == len(list(target.model.parameters()))
    assert all(torch.equal(p, source.model.state_dict()[n]) for n, p in target.model.state_dict().items())


@pytest.mark.parametrize(("size", "layers"), [("3b", 36), ("7b", 28)])
def test_real_config_resolves_with_vlmreg_check(size, layers, capsys):
    directory = CONFIGS / f"qwen2.5-vl-{size}-instruct"
    assert main(["check", str(directory), "--json", "--no-parity"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["family"] == FAMILY
    assert report["num_layers"] == layers and report["num_vision_blocks"] == 32
    assert report["lora_presets"]["language+projector"]["matches"]["merger.mlp.0"] == 1


@pytest.mark.parametrize(("size", "hidden", "kv", "tied"), [("3b", 2048, 256, True), ("7b", 3584, 512, False)])
def test_real_shapes_go_on_the_wire_under_published_names(size, hidden, kv, tied):
    """A meta-device model of the real config: names and shapes as the published safetensors hold them."""

    descriptor = get_registry().get(FAMILY)
    model = build_model(load_config(CONFIGS / f"qwen2.5-vl-{size}-instruct"), descriptor, device="meta")
    shapes = {
        n: tuple(t.shape)
        for n, t in WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).shapes()
    }
    assert shapes["visual.patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert shapes["visual.blocks.31.attn.qkv.weight"] == (3840, 1280)
    assert shapes["visual.blocks.0.mlp.gate_proj.weight"] == (3420, 1280)
    assert shapes["visual.merger.mlp.0.weight"] == (5120, 5120)
    assert shapes["visual.merger.mlp.2.weight"] == (hidden, 5120)
    assert shapes["model.layers.0.self_attn.k_proj.weight"] == (kv, hidden)
    assert ("lm_head.weight" in shapes) is not tied
    assert not [n for n in shapes if n.startswith(("model.visual.", "model.language_model."))]


def test_tiny_vision_tower_uses_window_attention():
    """The tiny config keeps Qwen2.5-VL's windowed blocks: a 128 x 96 image spans several windows."""
    model = tiny_model(FAMILY)
    visual = model.model.visual
    assert list(model.config.vision_config.fullatt_block_indexes) == [1]
    grid = torch.tensor([[1, 6, 8]])
    if hasattr(visual, "get_window_index"):  # transformers 5.17
        _, cu_window_seqlens = visual.get_window_index(grid)
    else:  # later 5.x: a shared helper
        _, cu_window_seqlens = get_vision_window_index(
            grid,
            spatial_merge_size=visual.spatial_merge_size,
            window_size=visual.window_size,
            patch_size=visual.patch_size,
        )
    assert len(torch.unique_consecutive(torch.as_tensor(cu_window_seqlens))) - 1 > 1


def test_load_processor_reads_a_published_preprocessor_config(tmp_path):
    """A checkpoint directory with Qwen2.5-VL's published image settings (patch 14, CLIP normalisation, pixel bounds)
    loads as the family's processor class, without torchvision; a 448 x 448 image gives 32 x 32 patches, 256 tokens."""

    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(TINY_PROCESSOR_DIR / name, tmp_path / name)
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps(
            {
                "min_pixels": 3136,
                "max_pixels": 12845056,
                "patch_size": 14,
                "temporal_patch_size": 2,
                "merge_size": 2,
                "image_mean": [0.48145466, 0.4578275, 0.40821073],
                "image_std": [0.26862954, 0.26130258, 0.27577711],
                "image_processor_type": "Qwen2VLImageProcessor",
                "processor_class": "Qwen2_5_VLProcessor",
            }
        )
    )
    processor = get_registry().get(FAMILY).load_processor(tmp_path)
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert processor.image_processor.patch_size == 14
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "colour?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    out = processor(text=[text], images=[Image.new("RGB", (448, 448), "red")], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 32, 32]]
    assert int((out["input_ids"] == processor.image_token_id).sum()) == 256
    assert int((out["mm_token_type_ids"] == 1).sum()) == 256


@pytest.mark.parametrize("size", ["3b", "7b"])
def test_benchmark_shapes_match_the_published_configs(size):
    """``shapes`` (random-init configs for GPU benchmarks) have the published text and vision dimensions."""

    shape, real = get_registry().get(FAMILY).config_for_size(size), load_config(CONFIGS / f"qwen2.5-vl-{size}-instruct")
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
    ):
        assert getattr(shape.text_config, key) == getattr(real.text_config, key), key
    assert shape.text_config.rope_parameters["mrope_section"] == real.text_config.rope_parameters["mrope_section"]
    for key in (
        "depth",
        "hidden_size",
        "intermediate_size",
        "num_heads",
        "patch_size",
        "window_size",
        "fullatt_block_indexes",
        "out_hidden_size",
    ):
        assert getattr(shape.vision_config, key) == getattr(real.vision_config, key), key
    assert shape.tie_word_embeddings == real.tie_word_embeddings


def _frames(count: int, size: tuple[int, int], seed: int) -> tuple[Image.Image, ...]:
    rng = np.random.default_rng(seed)
    return tuple(Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(count))


def _transformers_processor(tiny: Any) -> Qwen2_5_VLProcessor:
    """transformers' own ``Qwen2_5_VLProcessor`` (its class and constructor, not the family's subclass) with the tiny
    processor's tokenizer, image processor, template and torch-only video processor. Its constructor checks the video
    processor's base class by a name it cannot import without torchvision: that one check is answered for this
    instance alone, during construction."""
    real = Qwen2_5_VLProcessor.__new__(Qwen2_5_VLProcessor)
    real.check_argument_for_proper_class = lambda name, argument: type(argument)
    Qwen2_5_VLProcessor.__init__(
        real,
        image_processor=tiny.image_processor,
        tokenizer=tiny.tokenizer,
        video_processor=tiny.video_processor,
        chat_template=tiny.chat_template,
    )
    del real.check_argument_for_proper_class
    return real


#: 5 frames of a 4 fps clip, every frame taken (sampled at 4 fps: 2 / 4 = 0.5 s per temporal patch, not the 1 s that
#: get_rope_index assumes when second_per_grid_ts is missing), at a size the video processor keeps (no resize)
CLIP = DecodedVideo(_frames(5, (96, 64), 3), 4.0, 5, (0, 1, 2, 3, 4))


def _conversation(image: Any, video: Any) -> list[dict[str, Any]]:
    parts = [{"type": "image", "image": image}, {"type": "video", "video": video}, {"type": "text", "text": "Moved?"}]
    return [{"role": "user", "content": parts}]


def _processor_encoding(tiny: Any, image: Image.Image) -> Any:
    """``apply_chat_template(tokenize=True, return_dict=True)`` of transformers' processor with the clip's frames and
    timing."""
    metadata = VideoMetadata(total_num_frames=5, fps=4.0, frames_indices=[0, 1, 2, 3, 4])
    video = np.stack([np.asarray(frame) for frame in CLIP.frames])
    return _transformers_processor(tiny).apply_chat_template(
        _conversation(image, video),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"video_metadata": [metadata], "do_sample_frames": False},
    )


def test_video_prompt_and_inputs_equal_transformers_processor_s_own():
    """An image and a video: vlmreg's prompt ids, mm_token_type_ids, pixels, grids and second_per_grid_ts equal
    transformers' Qwen2_5_VLProcessor's encoding of the whole conversation."""
    descriptor = get_registry().get(FAMILY)
    assert descriptor.max_videos_per_message == 4 and descriptor.vllm_video_wrapper is None
    tiny = descriptor.tiny_processor()
    image = _frames(1, (32, 64), 9)[0]
    want = _processor_encoding(tiny, image)
    assert want["second_per_grid_ts"].tolist() == [0.5]
    assert want["video_grid_thw"].tolist() == [[3, 4, 6]]  # 5 frames: the last repeated to fill the 3rd pair

    encoder = PromptEncoder(tiny, ImageStore(), descriptor)
    prompt = encoder.encode(_conversation(encoder.store.add(image), encoder.store.add_video(CLIP)))
    assert prompt.input_ids == want["input_ids"][0].tolist()
    mine = encoder.image_inputs(prompt.image_ids)
    mine.update(
        encoder.token_inputs(
            len(prompt.input_ids), [list(zip([0, 0], prompt.image_ids, prompt.image_spans, strict=True))]
        )
    )
    keys = ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "second_per_grid_ts")
    for key in (*keys, "mm_token_type_ids"):
        assert torch.equal(mine[key], want[key]), key
    assert int((want["mm_token_type_ids"] == 2).sum()) == 3 * 4 * 6 // 4


def test_video_logprobs_equal_a_plain_forward_alone_and_packed_with_the_clip_s_timing():
    """Logprobs of an answer after the video prompt through vlmreg's micro-batches equal a plain forward on
    transformers' processor's inputs; the clip's timing (second_per_grid_ts 0.5) changes them, so it is taken."""
    descriptor = get_registry().get(FAMILY)
    tiny = descriptor.tiny_processor()
    resolved = vlmreg.resolve(tiny_model(FAMILY))
    image = _frames(1, (32, 64), 9)[0]
    reference = dict(_processor_encoding(tiny, image))
    encoder = PromptEncoder(tiny, ImageStore(), descriptor)
    prompt = encoder.encode(_conversation(encoder.store.add(image), encoder.store.add_video(CLIP)))
    answer = [40, 41, 42, encoder.stop_ids[0]]
    for key in ("input_ids", "attention_mask", "mm_token_type_ids"):
        fill = torch.tensor([answer]) if key == "input_ids" else torch.full((1, 4), int(key == "attention_mask"))
        reference[key] = torch.cat([reference[key], fill], dim=1)

    def plain(inputs: dict[str, Any]) -> torch.Tensor:
        with torch.no_grad():
            logits = resolved.model(**inputs, use_cache=False).logits.float()
        return torch.log_softmax(logits[0, :-1], -1).gather(-1, reference["input_ids"][0, 1:, None])[-4:, 0]

    want = plain(reference)
    assert (plain({**reference, "second_per_grid_ts": torch.tensor([1.0])}) - want).abs().max() > 1e-4
    tokens = prompt.input_ids + answer
    sample = TrainingSample(
        tokens, [False] * len(prompt.input_ids) + [True] * 4, [0.0] * len(tokens), prompt.image_ids,
        prompt.image_spans, 1.0, 0, "clip",
    )  # fmt: skip
    for packed, samples in ((False, [sample]), (True, [sample, sample])):
        with torch.no_grad():
            [mb] = make_microbatches(
                samples, resolved, encoder, budget=1 << 16, packed=packed, device=torch.device("cpu")
            )
            logp, _ = selected_logprobs(resolved, mb.inputs, mb.targets, mb.selection)
        owner = mb.pick(mb.sample_index)
        for k in range(len(samples)):
            assert (logp[owner == k] - want).abs().max() < 1e-5, (packed, k)


def test_vlmreg_check_s_video_cases_compare_second_per_grid_ts():
    """``vlmreg check --tiny qwen2_5_vl``'s video prompt cases run (not a refusal) and name the timing input among those
    equal to the processor's."""
    results = video_prompt_parity(FAMILY)
    assert len(results) == 3
    assert all(r.ok and "second_per_grid_ts" in r.detail for r in results), results
