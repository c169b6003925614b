"""The bundled qwen2_vl family: conformance, published checkpoint names on the wire, a real config resolving."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
import transformers
from PIL import Image
from safetensors.torch import load_file, save_file
from transformers import Qwen2VLForConditionalGeneration, Qwen2VLProcessor
from transformers.utils import is_torchvision_available
from transformers.video_utils import VideoMetadata

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.cli import main
from vlmreg.data import ImageStore
from vlmreg.data.prompts import PromptEncoder
from vlmreg.data.video import DecodedVideo
from vlmreg.loading.build import build_model, load_config
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_model

FAMILY = "qwen2_vl"
CONFIG_7B = Path(__file__).with_name("configs") / "qwen2-vl-7b-instruct"


class TestQwen2VlConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-qwen2-vl"


def _sent(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    plan = WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True)
    return {name: tensor.detach().contiguous().clone() for name, tensor in plan.tensors()}


def test_sent_names_and_values_equal_what_save_pretrained_writes(tmp_path):
    """transformers writes Qwen2-VL in the published layout (``visual.*``, ``model.layers.*``), not the in-memory
    one."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "model.safetensors")
    sent = _sent(model)
    assert sorted(sent) == sorted(saved)
    assert all(torch.equal(sent[name], saved[name]) for name in saved)
    for name in (
        "visual.blocks.0.attn.qkv.weight",
        "visual.blocks.0.mlp.fc1.weight",
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
    loaded = Qwen2VLForConditionalGeneration.from_pretrained(tmp_path)
    expected = model.state_dict()
    assert sorted(loaded.state_dict()) == sorted(expected)
    assert all(torch.equal(t, expected[n]) for n, t in loaded.state_dict().items())


def test_apply_weights_takes_published_names():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, _sent(source.model)) == len(list(target.model.parameters()))
    assert all(torch.equal(p, source.model.state_dict()[n]) for n, p in target.model.state_dict().items())


def test_real_7b_config_resolves_with_vlmreg_check(capsys):
    assert main(["check", str(CONFIG_7B), "--json", "--no-parity"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["family"] == FAMILY
    assert report["num_layers"] == 28 and report["num_vision_blocks"] == 32
    assert report["lora_presets"]["language+projector"]["matches"]["merger.mlp.2"] == 1


def test_real_7b_shapes_go_on_the_wire_under_published_names():
    """A meta-device model of the real config: names and shapes as the published safetensors hold them."""

    model = build_model(load_config(CONFIG_7B), get_registry().get(FAMILY), device="meta")
    shapes = {
        n: tuple(t.shape)
        for n, t in WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).shapes()
    }
    assert shapes["visual.patch_embed.proj.weight"] == (1280, 3, 2, 14, 14)
    assert shapes["visual.blocks.31.attn.qkv.weight"] == (3840, 1280)
    assert shapes["visual.blocks.0.mlp.fc1.weight"] == (5120, 1280)
    assert shapes["visual.merger.mlp.0.weight"] == (5120, 5120)
    assert shapes["visual.merger.mlp.2.weight"] == (3584, 5120)
    assert shapes["model.layers.27.self_attn.k_proj.weight"] == (512, 3584)
    assert shapes["lm_head.weight"] == (152064, 3584)
    assert not [n for n in shapes if n.startswith(("model.visual.", "model.language_model."))]


def _frames(count: int, size: tuple[int, int], seed: int) -> tuple[Image.Image, ...]:
    rng = np.random.default_rng(seed)
    return tuple(Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(count))


def test_the_video_processor_is_transformers_own_and_leaves_no_torchvision_behind():
    """The tiny processor's video processor is transformers' ``Qwen2VLVideoProcessor`` (its code, from its module),
    imported without torchvision; the stand-in used during that import is gone afterwards."""
    video = get_registry().get(FAMILY).tiny_processor().video_processor
    [real] = [c for c in type(video).__mro__ if c.__name__ == "Qwen2VLVideoProcessor"]
    assert real.__module__ == "transformers.models.qwen2_vl.video_processing_qwen2_vl"
    assert real.__dict__["_preprocess"].__code__.co_filename.startswith(str(Path(transformers.__file__).parent))
    if not is_torchvision_available():
        assert not [name for name in sys.modules if name.split(".")[0] == "torchvision"]
        assert type(video).__name__ == "TorchOnlyQwen2VLVideoProcessor"


def _transformers_processor(tiny: Any) -> Qwen2VLProcessor:
    """transformers' own ``Qwen2VLProcessor`` (its class and constructor) with the tiny processor's parts; the
    constructor's video-processor class check (by a name it cannot import without torchvision) answered for this
    instance alone, during construction."""
    real = Qwen2VLProcessor.__new__(Qwen2VLProcessor)
    real.check_argument_for_proper_class = lambda name, argument: type(argument)
    Qwen2VLProcessor.__init__(
        real,
        image_processor=tiny.image_processor,
        tokenizer=tiny.tokenizer,
        video_processor=tiny.video_processor,
        chat_template=tiny.chat_template,
    )
    del real.check_argument_for_proper_class
    return real


def test_video_prompts_and_inputs_equal_transformers_processor_s_own():
    """Two videos (an odd frame count; one the processor resizes) and an image: vlmreg's prompt ids,
    mm_token_type_ids, pixels and grids equal transformers' Qwen2VLProcessor's encoding of the whole conversation."""
    descriptor = get_registry().get(FAMILY)
    assert descriptor.max_videos_per_message == 4 and descriptor.vllm_video_wrapper is None
    tiny = descriptor.tiny_processor()
    clips = [
        DecodedVideo(_frames(3, (64, 64), 1), 2.0, 6, (0, 2, 4)),
        DecodedVideo(_frames(4, (90, 70), 2), 1.0, 4, (0, 1, 2, 3)),
    ]
    image = _frames(1, (64, 32), 3)[0]

    def conversation(image: Any, videos: list[Any]) -> list[dict[str, Any]]:
        parts = [{"type": "video", "video": videos[0]}, {"type": "image", "image": image}]
        parts += [{"type": "video", "video": videos[1]}, {"type": "text", "text": "Which moved?"}]
        return [{"role": "user", "content": parts}]

    metadata = [
        VideoMetadata(total_num_frames=c.total_frames, fps=c.fps, frames_indices=list(c.frame_indices)) for c in clips
    ]
    want = _transformers_processor(tiny).apply_chat_template(
        conversation(image, [np.stack([np.asarray(f) for f in c.frames]) for c in clips]),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
        processor_kwargs={"video_metadata": metadata, "do_sample_frames": False},
    )
    assert want["video_grid_thw"].tolist() == [[2, 4, 4], [2, 4, 6]]  # 90 x 70 resized to 96 x 64
    encoder = PromptEncoder(tiny, ImageStore(), descriptor)
    prompt = encoder.encode(conversation(encoder.store.add(image), [encoder.store.add_video(c) for c in clips]))
    assert prompt.input_ids == want["input_ids"][0].tolist()
    mine = encoder.image_inputs(prompt.image_ids)
    mine.update(
        encoder.token_inputs(
            len(prompt.input_ids), [list(zip([0] * 3, prompt.image_ids, prompt.image_spans, strict=True))]
        )
    )
    for key in ("pixel_values", "image_grid_thw", "pixel_values_videos", "video_grid_thw", "mm_token_type_ids"):
        assert torch.equal(mine[key], want[key]), key
    assert "second_per_grid_ts" not in want  # Qwen2-VL's positions take no timing
