"""What docs/tutorial.md says happens does happen (its errors are the real ones)."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import attrs
import pytest

from vlmreg import FamilyDescriptor, LoraPreset, ResolutionError, resolve
from vlmreg.loading.build import build_model

ROOT = Path(__file__).resolve().parents[2]
TUTORIAL = (ROOT / "docs" / "tutorial.md").read_text()
EXAMPLE = ROOT / "examples" / "plugins" / "vlmreg-tiny-llava"


def flat(text: str) -> str:
    return " ".join(text.split())


@pytest.fixture(scope="module")
def llava(tmp_path_factory):
    """The finished example plugin's module, imported from its source tree (installing it is tested elsewhere)."""

    sys.path.insert(0, str(EXAMPLE / "src"))
    try:
        # deferred: optional, its absence is handled here
        import vlmreg_tiny_llava  # noqa: PLC0415

        yield vlmreg_tiny_llava
    finally:
        sys.path.remove(str(EXAMPLE / "src"))


def quoted_error(after: str) -> str:
    block = TUTORIAL.split(after, 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    return flat(block).removeprefix("error: ")


def build(llava):
    descriptor = first_draft(llava)
    return build_model(llava.tiny_config(), descriptor)


def first_draft(llava) -> FamilyDescriptor:
    return FamilyDescriptor(
        name="llava",
        model_types=["llava"],
        vision_encoder_attr="vision_tower",
        language_model_attr="language_model",
        lm_head_attr="lm_head",
        tiny_config=llava.tiny_config,
    )


def test_the_first_draft_error_is_the_one_shown(llava):
    with pytest.raises(ResolutionError) as info:
        resolve(build(llava), family=first_draft(llava))
    assert flat(str(info.value)) == quoted_error("Install it and look:")


def test_the_first_draft_resolves_once_the_paths_are_fixed(llava):
    fixed = attrs.evolve(
        first_draft(llava), vision_encoder_attr="model.vision_tower", language_model_attr="model.language_model"
    )
    assert resolve(build(llava), family=fixed).weight_prefix == "model.language_model.layers."


def test_the_lora_typo_error_is_the_one_shown(llava):
    registered = []
    llava.vlmreg_register_families(registered.append)
    descriptor = registered[0]
    presets = dict(descriptor.lora_presets)
    presets["language+projector"] = attrs.evolve(
        presets["language+projector"], modules=(*llava.LANGUAGE, "linear_1", "linear_3")
    )
    with pytest.raises(ResolutionError) as info:
        resolve(build(llava), family=attrs.evolve(descriptor, lora_presets=presets))
    assert flat(str(info.value)) == quoted_error('A typo, say `"linear_3"`')


def test_the_tutorial_code_matches_the_example_plugin():
    processor_source = (EXAMPLE / "src" / "vlmreg_tiny_llava" / "processor.py").read_text()
    for line in ('IMAGE_TOKEN_ID = SPECIAL.index("<image>")', 'CLIPImageProcessorPil(size={"shortest_edge": 32}'):
        assert line in TUTORIAL and line in processor_source
    pyproject = (EXAMPLE / "pyproject.toml").read_text()
    assert re.search(r'^llava = "vlmreg_tiny_llava"$', pyproject, re.M) and 'llava = "vlmreg_tiny_llava"' in TUTORIAL
    assert isinstance(LoraPreset(modules=("q_proj",)), LoraPreset)
