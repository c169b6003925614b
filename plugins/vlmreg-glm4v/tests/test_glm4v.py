"""The bundled glm4v family: the conformance suite, the published checkpoint layout on the wire, a 9B-shaped config
resolving, processors (tiny, a checkpoint's, per checkpoint id) and thinking modes."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import peft
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file
from transformers import Glm4vForConditionalGeneration
from vlmreg_glm4v.processor import TINY_PROCESSOR_DIR, ImageOnlyGlm4vProcessor

import vlmreg
from vlmreg.broadcast import WeightPlan, apply_weights
from vlmreg.cli import main
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.inference.vllm_server import vllm_command
from vlmreg.loading.build import build_model, load_config
from vlmreg.rollout.episodes import strip_reasoning
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import FamilyConformance, tiny_forward_inputs, tiny_model
from vlmreg.testing.weights import assert_same_state, loaded_back, sent_weights

FAMILY = "glm4v"
CONFIG_9B = Path(__file__).with_name("configs") / "glm-4.1v-9b-thinking"


class TestGlm4vConformance(FamilyConformance):
    family = FAMILY
    distribution = "vlmreg-glm4v"


# -- weights on the wire --------------------------------------------------------------------------------------


def test_sent_tensors_are_what_save_pretrained_writes(tmp_path: Path):
    """GLM-4.1V checkpoints (and save_pretrained) keep the in-memory layout: model.visual.*, model.language_model.*,
    lm_head.*; the untied lm_head is sent too."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    saved: dict[str, torch.Tensor] = {}
    for file in tmp_path.glob("*.safetensors"):
        saved.update(load_file(file))
    wire = sent_weights(model)
    assert_same_state(wire, saved)
    for name in (
        "model.visual.patch_embed.proj.weight",
        "model.visual.embeddings.position_embedding.weight",
        "model.visual.blocks.1.attn.qkv.weight",
        "model.visual.blocks.0.mlp.gate_proj.weight",
        "model.visual.downsample.weight",
        "model.visual.merger.proj.weight",
        "model.visual.merger.post_projection_norm.bias",
        "model.visual.merger.gate_proj.weight",
        "model.language_model.layers.1.mlp.gate_up_proj.weight",
        "model.language_model.layers.0.self_attn.q_proj.bias",
        "model.language_model.layers.0.post_mlp_layernorm.weight",
        "model.language_model.embed_tokens.weight",
        "model.language_model.norm.weight",
        "lm_head.weight",
    ):
        assert name in wire, name
    assert not [n for n in wire if n.startswith(("visual.", "language_model.", "model.layers."))]


def test_the_written_config_declares_the_attention_biases_the_weights_hold(tmp_path: Path):
    """transformers gives GLM-4's q/k/v projections a bias whatever the config says; vLLM builds them only when the
    config's ``attention_bias`` is true (the published 9B config's is) and otherwise skips the trained biases when it
    loads. The config written beside the weights says true, as the 9B one does."""
    model = tiny_model(FAMILY)
    model.save_pretrained(tmp_path)
    text = json.loads((tmp_path / "config.json").read_text())["text_config"]
    published = json.loads((Path(__file__).parent / "configs" / "glm-4.1v-9b-thinking" / "config.json").read_text())
    assert model.model.language_model.layers[0].self_attn.q_proj.bias is not None
    assert text.get("attention_bias") is True and published["text_config"]["attention_bias"] is True


def test_vllm_runs_glm_rotary_natively(tmp_path: Path):
    """vLLM 0.24's CUDA M-RoPE kernel rotates half-split pairs where GLM rotates neighbouring ones: every vLLM the
    trainer launches for glm4v gets the flag that keeps that custom op off, before the user's own server_args."""

    rc = resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": FAMILY},
                "data": {"task": "colour"},
                "rollout": {"engine": "openai", "server": "vllm", "launch": True, "server_args": ["--enforce-eager"]},
                "broadcast": {"transport": "gloo"},
            }
        )
    )
    command = vllm_command(rc, str(tmp_path), 8000, "float32", 1024)
    at = command.index("--compilation-config")
    assert (
        json.loads(command[at + 1]) == {"custom_ops": ["-rotary_embedding"]} and command.index("--enforce-eager") > at
    )


def test_sent_tensors_load_back_through_transformers_to_identical_weights(tmp_path: Path):
    model = tiny_model(FAMILY)
    loaded = loaded_back(model, tmp_path)
    assert type(loaded).__name__ == "Glm4vForConditionalGeneration"
    assert_same_state(loaded.state_dict(), model.state_dict())


def test_apply_weights_takes_the_published_names():
    source, target = vlmreg.resolve(tiny_model(FAMILY, seed=0)), vlmreg.resolve(tiny_model(FAMILY, seed=1))
    assert apply_weights(target, sent_weights(source.model)) == len(list(target.model.parameters()))
    assert_same_state(target.model.state_dict(), source.model.state_dict())


def test_the_9b_shapes_go_on_the_wire_under_published_names():
    """A meta-device model of the GLM-4.1V-9B config: names and shapes as the published safetensors hold them."""

    model = build_model(load_config(CONFIG_9B), get_registry().get(FAMILY), device="meta")
    shapes = {
        n: tuple(t.shape)
        for n, t in WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=True).shapes()
    }
    assert shapes["model.visual.patch_embed.proj.weight"] == (1536, 3, 2, 14, 14)
    assert shapes["model.visual.embeddings.position_embedding.weight"] == (576, 1536)
    assert shapes["model.visual.blocks.23.attn.qkv.weight"] == (4608, 1536)
    assert shapes["model.visual.blocks.0.mlp.gate_proj.weight"] == (4096, 1536)
    assert shapes["model.visual.downsample.weight"] == (4096, 1536, 2, 2)
    assert shapes["model.visual.merger.proj.weight"] == (4096, 4096)
    assert shapes["model.visual.merger.gate_proj.weight"] == (13696, 4096)
    assert shapes["model.visual.merger.down_proj.weight"] == (4096, 13696)
    assert shapes["model.language_model.layers.39.self_attn.k_proj.weight"] == (256, 4096)
    assert shapes["model.language_model.layers.39.self_attn.q_proj.bias"] == (4096,)
    assert shapes["model.language_model.layers.0.mlp.gate_up_proj.weight"] == (27392, 4096)
    assert shapes["model.language_model.embed_tokens.weight"] == shapes["lm_head.weight"] == (151552, 4096)
    # q, k, v (weight, bias), o, gate_up, down, 4 norms
    assert len([n for n in shapes if n.startswith("model.language_model.layers.")]) == 40 * 13


def test_the_9b_config_resolves_with_vlmreg_check(capsys):
    assert main(["check", str(CONFIG_9B), "--json", "--no-parity"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] and report["family"] == FAMILY
    assert report["num_layers"] == 40 and report["num_vision_blocks"] == 24
    assert report["lora_presets"]["language+projector"]["matches"]["merger.gate_proj"] == 1


def test_lora_on_the_merger_sends_merged_weights_equal_to_peft_s_merge_and_unload():
    resolved = vlmreg.resolve(tiny_model(FAMILY))
    targets = resolved.lora_targets("language+projector")
    assert {"model.visual.merger.proj", "model.visual.merger.gate_proj", "model.visual.merger.down_proj"} <= set(
        targets.modules
    )
    assert not [m for m in targets.modules if ".blocks." in m]
    wrapped = peft.get_peft_model(
        resolved.model, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False, **targets.peft_kwargs())
    )
    plan = WeightPlan.from_resolved(vlmreg.resolve(wrapped), include_frozen_vision=True)
    assert "model.visual.merger.gate_proj.weight" in {w.name for w in plan.weights if w.adapters}
    merged = copy.deepcopy(wrapped).merge_and_unload()
    assert_same_state(dict(plan.tensors()), {n: p.detach() for n, p in merged.named_parameters()})


def test_a_random_init_feeds_image_features_at_the_embeddings_scale():
    """transformers' N(0, 0.02) init leaves the merger's output ~20x smaller than the token embeddings; the family's
    init_random_weights gives its gated MLP a variance-preserving init, so the pixels reach the decoder."""

    descriptor = get_registry().get(FAMILY)
    inputs = tiny_forward_inputs(FAMILY)
    torch.manual_seed(0)
    plain = Glm4vForConditionalGeneration(descriptor.tiny_config()).eval()
    ours = tiny_model(FAMILY)
    embeddings = ours.get_input_embeddings().weight.norm(dim=-1).mean()

    def feature_norm(model: torch.nn.Module) -> float:
        with torch.no_grad():
            out = model.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"])
        return float(torch.cat(list(out.pooler_output)).norm(dim=-1).mean())

    assert feature_norm(plain) < 0.2 * embeddings < embeddings < feature_norm(ours)
    merger = ours.get_submodule("model.visual.merger")
    assert abs(float(merger.down_proj.weight.std()) - merger.down_proj.in_features**-0.5) < 0.02


# -- positions ------------------------------------------------------------------------------------------------


def test_positions_are_the_model_s_3d_rope_with_the_text_row_first():
    model = tiny_model(FAMILY)
    inputs = tiny_forward_inputs(FAMILY)
    positions = get_registry().get(FAMILY).position_ids(model, inputs)
    n = inputs["input_ids"].shape[1]
    assert positions.shape == (4, 1, n)
    assert positions[0, 0].tolist() == list(range(n))
    image = (inputs["mm_token_type_ids"][0] == 1).nonzero().flatten()
    # a 64x64 image is a 2x2 grid of merged patches: heights and widths vary over it, the temporal row does not
    assert positions[1, 0, image].unique().numel() == 1
    assert positions[2, 0, image].unique().numel() == 2 and positions[3, 0, image].unique().numel() == 2
    assert positions[1, 0, -1] < n - 1  # text after the image resumes at its start plus 2, not at its token count


# -- processors -----------------------------------------------------------------------------------------------


def test_the_tiny_template_renders_glm_4_1v_s_format():
    processor = get_registry().get(FAMILY).tiny_processor()
    messages = [
        {"role": "system", "content": "answer in one word ."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image ?"}]},
        {"role": "assistant", "content": "<think> red </think><answer> Red </answer>"},
        {"role": "user", "content": "how many ?"},
    ]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "[gMASK]<sop><|system|>\nanswer in one word .<|user|>\n<|begin_of_image|><|image|><|end_of_image|>"
        "what colour is the image ?<|assistant|>\n<think> red </think><answer> Red </answer><|user|>\nhow many "
        "?<|assistant|>\n"
    )


def test_a_checkpoint_s_processor_files_load_without_torchvision(tmp_path: Path):
    """A GLM-4.1V checkpoint ships preprocessor_config.json (Glm4vImageProcessor), tokenizer files and a chat template
    naming Glm4vProcessor, whose video processor needs torchvision: load_processor gives the image-only class, with the
    checkpoint's image settings, and the same model inputs as the tiny processor it was saved from."""

    shutil.copytree(TINY_PROCESSOR_DIR, tmp_path, dirs_exist_ok=True)
    config = json.loads((tmp_path / "processor_config.json").read_text())
    image = config.pop("image_processor")
    (tmp_path / "processor_config.json").unlink()
    (tmp_path / "preprocessor_config.json").write_text(
        json.dumps({**image, "image_processor_type": "Glm4vImageProcessor", "processor_class": "Glm4vProcessor"})
    )
    tokenizer_config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    (tmp_path / "tokenizer_config.json").write_text(
        json.dumps({**tokenizer_config, "processor_class": "Glm4vProcessor"})
    )
    loaded = get_registry().get(FAMILY).load_processor(tmp_path)
    assert isinstance(loaded, ImageOnlyGlm4vProcessor) and loaded.image_processor.patch_size == 14
    tiny = get_registry().get(FAMILY).tiny_processor()
    messages = [
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what colour is the image ?"}]}
    ]
    picture = Image.new("RGB", (96, 32), "blue")
    a, b = (
        {
            k: v
            for k, v in p(
                text=[p.apply_chat_template(messages, add_generation_prompt=True)],
                images=[picture],
                return_tensors="pt",
            ).items()
        }
        for p in (loaded, tiny)
    )
    assert_same_state(a, b)
    assert int((a["input_ids"] == loaded.image_token_id).sum()) == 3  # 84x28 pixels: 6x2 patches, merged 2x2


@pytest.mark.parametrize(
    ("checkpoint", "processor"),
    [
        ("zai-org/GLM-4.1V-9B-Thinking", "zai-org/GLM-4.1V-9B-Thinking"),
        ("zai-org/GLM-4.1V-9B-Base", "zai-org/GLM-4.1V-9B-Base"),
        ("THUDM/GLM-4.1V-9B-Thinking", "THUDM/GLM-4.1V-9B-Thinking"),
        ("THUDM/GLM-4.1V-9B-Base", "THUDM/GLM-4.1V-9B-Base"),
        ("/ckpts/GLM-4.1V-9B-Base", "zai-org/GLM-4.1V-9B-Base"),
        ("runs/my-finetune", "zai-org/GLM-4.1V-9B-Thinking"),
    ],
)
def test_processor_ids_per_checkpoint(checkpoint: str, processor: str):
    assert get_registry().get(FAMILY).processor_id_for(checkpoint) == processor


@pytest.mark.parametrize(
    ("checkpoint", "modes"),
    [
        ("zai-org/GLM-4.1V-9B-Thinking", ["on"]),
        ("/ckpts/THUDM/GLM-4.1V-9B-Thinking/", ["on"]),
        ("zai-org/GLM-4.1V-9B-Base", ["off"]),
        (None, ["off"]),
    ],
)
def test_thinking_modes_per_checkpoint(checkpoint: str | None, modes: list[str]):
    descriptor = get_registry().get(FAMILY)
    assert [m.name for m in descriptor.thinking_modes_for(checkpoint)] == modes
    assert all(not m.chat_template_kwargs for m in descriptor.thinking_modes)  # the template takes no thinking switch


def test_rewards_see_the_answer_after_the_reasoning():
    """The tiny tokenizer keeps GLM-4.1V-Thinking's markers when decoding (special tokens are skipped), so the
    family's thinking_end cuts the reasoning off and the answer block is what a reward sees."""

    descriptor = get_registry().get(FAMILY)
    tokenizer = descriptor.tiny_processor().tokenizer
    ids = tokenizer("<think> the shape is red </think><answer> Red </answer><|user|>", add_special_tokens=False)[
        "input_ids"
    ]
    text = tokenizer.decode(ids, skip_special_tokens=True)
    assert descriptor.thinking_end == "</think>"
    assert strip_reasoning(text, descriptor.thinking_end).split() == ["<answer>", "Red", "</answer>"]
