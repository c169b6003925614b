"""What a launched vLLM loads, for every bundled family, against transformers' own save and load.

`export_weights` writes the config and the weights in the published layout; transformers' own ``from_pretrained``
must take that directory back to the very tensors the trainer holds, with no missing, unexpected or mismatched
weight, and ``architectures`` must name what transformers' own ``save_pretrained`` writes (vLLM picks its model
class by it). The processor `export_checkpoint` saves beside the weights must load with ``AutoProcessor`` (as vLLM
loads it) and encode a 2-image prompt to the trainer's processor's ids. Families whose engine processor needs
torchvision (vLLM's machine has it, this one may not) skip that part with the reason.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path

import pytest
import torch
from transformers import AutoProcessor

import vlmreg
from tests.broadcast.helpers import assert_state_equal
from vlmreg.config import parse_config
from vlmreg.inference.vllm_server import export_checkpoint, export_weights
from vlmreg.loading.build import model_class_for
from vlmreg.sdk.registry import get_registry
from vlmreg.testing.parity import IMAGE_SIZES, noise_image

PLUGINS = Path(__file__).resolve().parents[2] / "plugins"
DISTRIBUTIONS = {tomllib.loads(p.read_text())["project"]["name"] for p in PLUGINS.glob("*/pyproject.toml")}
BUNDLED = [name for name in get_registry().names() if get_registry().plugin_of(name).distribution in DISTRIBUTIONS]


def _load(family: str):
    torch.manual_seed(0)
    return vlmreg.load(parse_config({"model": {"init": "random", "family": family}, "trainer": {"device": "cpu"}}))


def test_every_bundled_family_is_here():
    assert len(BUNDLED) >= 12, BUNDLED  # the families of plugins/ (vlmreg-qwen-common registers none)


@pytest.mark.parametrize("family", BUNDLED)
def test_the_exported_weights_load_back_in_transformers_to_the_trainer_s_tensors(tmp_path: Path, family: str):
    loaded = _load(family)
    descriptor = loaded.resolved.descriptor
    directory = export_weights(loaded.resolved, tmp_path / "engine")
    loaded.model.save_pretrained(tmp_path / "transformers")  # the reference for config.json's architectures
    written = json.loads((directory / "config.json").read_text())
    reference = json.loads((tmp_path / "transformers" / "config.json").read_text())
    assert written["architectures"] == reference["architectures"] == [type(loaded.model).__name__]
    assert written["model_type"] == reference["model_type"]

    cls = model_class_for(descriptor)  # AutoModelForImageTextToText unless the family names its class
    model, info = cls.from_pretrained(directory, output_loading_info=True, dtype=torch.float32)
    assert type(model) is type(loaded.model)
    assert {k: v for k, v in info.items() if v} == {}, f"{family}: transformers' load reports {info}"
    assert_state_equal(model.state_dict(), loaded.model.state_dict())


def _two_image_ids(processor) -> list[int]:
    images = [noise_image(size, seed) for seed, size in enumerate(IMAGE_SIZES[:2])]
    messages = [
        {
            "role": "user",
            "content": [
                *({"type": "image", "image": im} for im in images),
                {"type": "text", "text": "which is larger ?"},
            ],
        }
    ]
    out = processor.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, return_tensors="pt"
    )
    return out["input_ids"][0].tolist()


@pytest.mark.parametrize("family", BUNDLED)
def test_the_engine_processor_loads_with_auto_processor_and_encodes_as_the_trainer_s(tmp_path: Path, family: str):
    loaded = _load(family)
    descriptor = loaded.resolved.descriptor
    if descriptor.max_images_per_message < 2:
        pytest.skip(f"{family} takes at most {descriptor.max_images_per_message} image(s) per message")
    try:
        directory = export_checkpoint(loaded.resolved, loaded.processor, tmp_path / "engine")
    except ImportError as exc:
        # deferred: optional, its absence is handled here
        from transformers.utils import is_torchvision_available  # noqa: PLC0415

        assert not is_torchvision_available(), f"{family}: the engine processor failed with torchvision present: {exc}"
        assert "torchvision" in str(exc)
        pytest.skip(f"{family}: {exc} (not installed here)")
    processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    # without its image processor AutoProcessor returns a bare tokenizer, and vLLM could not take images
    assert getattr(processor, "image_processor", None) is not None, (
        f"{family}: AutoProcessor gave a {type(processor).__name__}"
    )
    ids = _two_image_ids(processor)
    assert ids == _two_image_ids(loaded.processor)
    assert sum(1 for i in ids if i == processor.tokenizer.convert_tokens_to_ids(processor.image_token)) > 0
