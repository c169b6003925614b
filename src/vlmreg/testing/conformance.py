"""Conformance checks a family plugin runs against its ``tiny_config()``.

Subclass `FamilyConformance` in a test module and set ``family`` (and optionally ``distribution``)::

    from vlmreg.testing import FamilyConformance

    class TestMyFamily(FamilyConformance):
        family = "my_family"
        distribution = "vlmreg-my-family"

Each check builds the family's tiny random model on CPU: it builds, resolves strictly, every LoRA
preset applies through peft and every scope gets a gradient, the weight prefix covers every decoder layer
in the state dict, the model also resolves when built on the meta device, a forward pass with an image
runs and depends on the image's pixels. Then the parity checks of `vlmreg.testing.parity`, each against
an independent reference: prompt ids and every input the processor returns, shapes included (through the
family's declared ``processor_layout``), equal vlmreg's for 1, 2 and 3 images of different sizes; logprobs
equal a plain forward of the model on the processor's inputs, alone, padded (mixed image sizes) and packed (or
the family declares packing unsupported); generation stops at the family's turn end; a 3-turn conversation
equals the processor's encoding and merges into one sample.
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping
from typing import Any, ClassVar

import pytest

from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_registry
from vlmreg.testing.hints import contract_hint
from vlmreg.testing.parity import Parity, logprob_parity, prompt_parity, tiny_model, tiny_processor
from vlmreg.testing.rollout_parity import multiturn_parity, stop_parity

__all__ = ["FamilyConformance", "tiny_forward_inputs", "tiny_model"]


def _tiny_processor(family: str) -> Any:
    try:
        return tiny_processor(family)
    except VlmregError as exc:
        pytest.fail(str(exc))


def _assert_all(results: list[Parity], hint: str | Mapping[str, str] = "") -> None:
    """Every check passed; else each failure with its detail, and the hint for what failed (``hint`` by check name:
    only the hints of the checks that failed)."""
    failed = [r for r in results if not r.ok]
    hints = [hint] if isinstance(hint, str) else list(dict.fromkeys(hint[r.name] for r in failed if r.name in hint))
    hints += list(dict.fromkeys(contract_hint(r.name) for r in failed))  # the requirement and the fields that lift it
    assert not failed, "\n".join([*(f"{r.name}: {r.detail}" for r in failed), *(h for h in hints if h)])


#: What to look at when a check of `stop_parity` fails, by check name.
STOP_HINTS = {
    "stops at the turn end": "set the descriptor's turn_end_tokens to the token the chat template closes a turn with",
    "sampler logprobs": (
        "the embedded sampler's logprobs differ from a plain forward on the processor's own inputs: an input the "
        "processor gives that changes attention or positions is not reproduced while sampling (a prompt attended as "
        "a bidirectional prefix through an input the processor gives: declare prefix_lm; positions: position_ids); see "
        "the processor contract in docs/reference.md"
    ),
}


def tiny_forward_inputs(family: str, colour: str = "red", size: int = 64) -> dict[str, Any]:
    """Processor outputs for one user message carrying one ``size`` x ``size`` image and a question."""
    # deferred: start-up cost (loads PIL)
    from PIL import Image  # noqa: PLC0415

    processor = _tiny_processor(family)
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What colour is the image?"}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    image = Image.new("RGB", (size, size), colour)
    return dict(processor(text=[text], images=[image], return_tensors="pt"))


class FamilyConformance:
    """The checks every family passes; set ``family`` (and ``distribution`` to check where it comes from)."""

    family: ClassVar[str]
    distribution: ClassVar[str | None] = None

    @pytest.fixture(scope="class")
    @classmethod
    def descriptor(cls) -> Any:
        return get_registry().get(cls.family)

    @pytest.fixture(scope="class")
    @classmethod
    def model(cls) -> Any:
        return tiny_model(cls.family)

    @pytest.fixture(scope="class")
    @classmethod
    def resolved(cls, model: Any) -> Any:
        # deferred: start-up cost (loads torch)
        from vlmreg.resolution import resolve  # noqa: PLC0415

        return resolve(model)

    def test_registered_through_an_entry_point(self) -> None:
        plugin = get_registry().plugin_of(self.family)
        assert plugin.entry_point is not None, f"{self.family!r} was registered in process, not by an installed plugin"
        if self.distribution is not None:
            assert plugin.distribution == self.distribution, (
                f"family {self.family!r} comes from distribution {plugin.distribution!r}, but the test class's "
                f"`distribution` attribute says {self.distribution!r}"
            )

    def test_tiny_config_is_claimed(self, descriptor: Any) -> None:
        # deferred: start-up cost (loads torch)
        from vlmreg.loading.build import tiny_config_of  # noqa: PLC0415

        assert tiny_config_of(descriptor).model_type in descriptor.model_types

    def test_resolves(self, resolved: Any, descriptor: Any) -> None:
        assert resolved.name == descriptor.name
        assert resolved.weight_prefix == f"{descriptor.language_model_attr}.{descriptor.layers_attr}."
        assert len(resolved.layers) >= 1
        for path, module in resolved.connectors.items():
            assert module is resolved.model.get_submodule(path)
        for path, parameter in resolved.connector_parameters.items():
            assert parameter is resolved.model.get_parameter(path)

    def test_weight_prefix_covers_every_layer_in_the_state_dict(self, model: Any, resolved: Any) -> None:
        prefix = resolved.weight_prefix
        indices = {k[len(prefix) :].split(".", 1)[0] for k in model.state_dict() if k.startswith(prefix)}
        assert indices == {str(i) for i in range(len(resolved.layers))}

    def test_resolves_on_the_meta_device(self, descriptor: Any) -> None:
        # deferred: start-up cost (loads torch)
        from vlmreg.loading.build import build_model, tiny_config_of  # noqa: PLC0415
        from vlmreg.resolution import resolve  # noqa: PLC0415

        meta = build_model(tiny_config_of(descriptor), descriptor, device="meta")
        assert next(meta.parameters()).device.type == "meta"
        assert resolve(meta).weight_prefix == descriptor.weight_prefix

    def test_every_lora_preset_applies_and_trains(self, descriptor: Any) -> None:
        # deferred: start-up cost (loads peft)
        import peft  # noqa: PLC0415

        # deferred: start-up cost (loads torch)
        import torch  # noqa: PLC0415

        # deferred: start-up cost (loads torch)
        from vlmreg.resolution import resolve  # noqa: PLC0415
        from vlmreg.resolution.lora import adapted_names  # noqa: PLC0415

        inputs = tiny_forward_inputs(self.family)
        for name in descriptor.lora_presets:
            model = tiny_model(self.family)
            targets = resolve(model).lora_presets[name]
            wrapped = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, **targets.peft_kwargs()))
            adapted = adapted_names(wrapped)
            wanted = set(targets.modules) | {p.rsplit(".", 1)[0] for p in targets.parameters}
            assert wanted <= adapted, f"preset {name!r}: peft did not adapt {sorted(wanted - adapted)[:5]}"
            wrapped.train()
            out = wrapped(**inputs)
            out.logits.float().pow(2).mean().backward()
            live = {
                n.removeprefix("base_model.model.")
                for n, p in wrapped.named_parameters()
                if "lora_B" in n and p.grad is not None and torch.count_nonzero(p.grad)
            }
            dead = sorted(n.removeprefix("base_model.model.") for n, p in wrapped.named_parameters() if "lora_B" in n)
            dead = [n for n in dead if n not in live]
            language = descriptor.language_model_attr + "."
            assert not [n for n in dead if n.startswith(language)], (
                f"preset {name!r}: language-model adapters got no gradient: {dead[:5]}"
            )
            for scope, roots in resolve(model).scope_roots().items():
                if scope in descriptor.lora_presets[name].scopes:
                    assert any(n.startswith(r + ".") for n in live for r in roots), (
                        f"preset {name!r}: no adapter in {scope} gets a gradient"
                    )
            # Some architectures read a middle vision layer's features, so adapters above it never train.
            if dead:
                warnings.warn(
                    f"preset {name!r}: {len(dead)} LoRA adapters get no gradient from a forward pass, e.g. {dead[0]}",
                    stacklevel=1,
                )

    def test_forward_with_an_image(self, model: Any) -> None:
        # deferred: start-up cost (loads torch)
        import torch  # noqa: PLC0415

        red, blue = tiny_forward_inputs(self.family, "red"), tiny_forward_inputs(self.family, "blue")
        assert torch.equal(red["input_ids"], blue["input_ids"])
        with torch.no_grad():
            logits_red = model(**red).logits
            logits_blue = model(**blue).logits
        assert logits_red.shape[:2] == red["input_ids"].shape
        assert torch.isfinite(logits_red).all()
        assert not torch.allclose(logits_red[0, -1], logits_blue[0, -1]), "the image's pixels do not reach the logits"

    def test_prompt_ids_and_inputs_equal_the_processors(self) -> None:
        """1, 2 and 3 images of different sizes: ids, token-aligned inputs and image tensors as the processor gives
        them."""
        _tiny_processor(self.family)
        _assert_all(
            prompt_parity(self.family),
            "vlmreg splices each image's expansion (the processor on the image alone) into the tokenized text; see the "
            "processor contract in docs/reference.md (image_placeholder, collate_images, processor_layout)",
        )

    def test_logprobs_equal_a_plain_forward_alone_padded_and_packed(self) -> None:
        results = {r.name: r for r in logprob_parity(self.family)}
        alone, padded, packed = results["logprobs, alone"], results["logprobs, padded"], results["logprobs, packed"]
        if not alone.ok:
            hint = (
                "each sample alone already differs: the model inputs vlmreg builds are not the processor's (see "
                "the prompt check)"
            )
        elif not padded.ok:
            hint = "alone matches but a padded batch of mixed image sizes does not: check the family's collate_images"
        else:
            hint = (
                "alone and padded match, packed does not: attention in a packed row is not what each sample gets alone "
                "(bidirectional image blocks, or state or positions leaking across samples: check position_ids and "
                "prepare_model), or declare packing=False so vlmreg pads"
            )
        _assert_all([alone, padded, packed], hint)

    def test_generation_stops_at_the_turn_end_and_mixed_sizes_generate(self) -> None:
        _assert_all(stop_parity(self.family), STOP_HINTS)

    def test_three_turns_continue_from_sampled_tokens_and_merge(self) -> None:
        _assert_all(multiturn_parity(self.family))

    def test_video_prompts_equal_the_processors_or_video_is_refused(self) -> None:
        # deferred: start-up cost (loads torch)
        from vlmreg.testing.video_parity import video_prompt_parity  # noqa: PLC0415

        _assert_all(
            video_prompt_parity(self.family),
            "a family that declares video (max_videos_per_message > 0) must encode "
            "videos as its processor does; one that does not must refuse them naming the family",
        )

    def test_video_logprobs_equal_a_plain_forward_alone_padded_and_packed(self) -> None:
        # deferred: start-up cost (loads torch)
        from vlmreg.testing.video_parity import video_logprob_parity  # noqa: PLC0415

        _assert_all(
            video_logprob_parity(self.family),
            "the family's position_ids must pass the video inputs (video_grid_thw) on",
        )

    def test_tokenizer_fits_the_embeddings(self, model: Any) -> None:
        processor = _tiny_processor(self.family)
        assert len(processor.tokenizer) <= model.get_input_embeddings().num_embeddings
