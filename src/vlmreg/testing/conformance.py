"""Conformance checks a family plugin runs against its ``tiny_config()``.

Subclass `FamilyConformance` in a test module and set ``family`` (and optionally ``distribution``)::

    from vlmreg.testing import FamilyConformance

    class TestMyFamily(FamilyConformance):
        family = "my_family"
        distribution = "vlmreg-my-family"

Each check builds the family's tiny random model on CPU: it builds, resolves strictly, every LoRA
preset applies through peft and trains, the weight prefix covers every decoder layer in the state
dict, the model also resolves when built on the meta device, a forward pass with an image runs and
depends on the image's pixels, and packed samples get the logprobs each gets alone.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, ClassVar

import pytest

from vlmreg.sdk.registry import get_registry

__all__ = ["FamilyConformance", "tiny_forward_inputs", "tiny_model"]


def tiny_model(family: str, seed: int = 0) -> Any:
    """A fresh tiny random model of ``family`` on CPU, in fp32."""
    import torch

    from vlmreg.loading.build import build_model, tiny_config_of

    descriptor = get_registry().get(family)
    torch.manual_seed(seed)
    return build_model(tiny_config_of(descriptor), descriptor).eval()


@functools.lru_cache(maxsize=None)
def _tiny_processor(family: str) -> Any:
    descriptor = get_registry().get(family)
    if descriptor.tiny_processor is None:
        pytest.fail(
            f"family {family!r} has no tiny_processor; the forward check needs one to turn an image and a prompt "
            "into model inputs (see docs/reference.md, field tiny_processor)"
        )
    return descriptor.tiny_processor()


def tiny_forward_inputs(family: str, colour: str = "red", size: int = 64) -> dict[str, Any]:
    """Processor outputs for one user message carrying one ``size`` x ``size`` image and a question."""
    from PIL import Image

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
        from vlmreg.resolution import resolve

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
        from vlmreg.loading.build import tiny_config_of

        assert tiny_config_of(descriptor).model_type in descriptor.model_types

    def test_resolves(self, resolved: Any, descriptor: Any) -> None:
        assert resolved.name == descriptor.name
        assert resolved.weight_prefix == f"{descriptor.language_model_attr}.layers."
        assert len(resolved.layers) >= 1
        for path, module in resolved.connectors.items():
            assert module is resolved.model.get_submodule(path)

    def test_weight_prefix_covers_every_layer_in_the_state_dict(self, model: Any, resolved: Any) -> None:
        prefix = resolved.weight_prefix
        indices = {k[len(prefix) :].split(".", 1)[0] for k in model.state_dict() if k.startswith(prefix)}
        assert indices == {str(i) for i in range(len(resolved.layers))}

    def test_resolves_on_the_meta_device(self, descriptor: Any) -> None:
        from vlmreg.loading.build import build_model, tiny_config_of
        from vlmreg.resolution import resolve

        meta = build_model(tiny_config_of(descriptor), descriptor, device="meta")
        assert next(meta.parameters()).device.type == "meta"
        assert resolve(meta).weight_prefix == descriptor.weight_prefix

    def test_every_lora_preset_applies_and_trains(self, descriptor: Any) -> None:
        import peft
        import torch

        from vlmreg.resolution import resolve
        from vlmreg.resolution.lora import adapted_names

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
            dead = sorted(
                n.removeprefix("base_model.model.") for n, p in wrapped.named_parameters() if "lora_B" in n
            )
            dead = [n for n in dead if n not in live]
            language = descriptor.language_model_attr + "."
            assert not [n for n in dead if n.startswith(language)], f"preset {name!r}: language-model adapters got no gradient: {dead[:5]}"
            for scope, roots in resolve(model).scope_roots().items():
                if scope in descriptor.lora_presets[name].scopes:
                    assert any(n.startswith(r + ".") for n in live for r in roots), f"preset {name!r}: no adapter in {scope} gets a gradient"
            # Some architectures read a middle vision layer's features, so adapters above it never train.
            if dead:
                warnings.warn(f"preset {name!r}: {len(dead)} LoRA adapters get no gradient from a forward pass, e.g. {dead[0]}", stacklevel=1)

    def test_forward_with_an_image(self, model: Any) -> None:
        import torch

        red, blue = tiny_forward_inputs(self.family, "red"), tiny_forward_inputs(self.family, "blue")
        assert torch.equal(red["input_ids"], blue["input_ids"])
        with torch.no_grad():
            logits_red = model(**red).logits
            logits_blue = model(**blue).logits
        assert logits_red.shape[:2] == red["input_ids"].shape
        assert torch.isfinite(logits_red).all()
        assert not torch.allclose(logits_red[0, -1], logits_blue[0, -1]), "the image's pixels do not reach the logits"

    def test_packed_samples_match_each_sample_alone(self) -> None:
        """Samples packed into one row (positions from the family, one attention block each) get the per-token
        logprobs transformers gives each sample alone."""
        import torch
        from PIL import Image

        from vlmreg.config import parse_config
        from vlmreg.data import ImageStore, image_part, text_part
        from vlmreg.data.prompts import encode_messages
        from vlmreg.loading.load import load
        from vlmreg.train.batching import make_microbatches
        from vlmreg.train.logprobs import selected_logprobs
        from vlmreg.train.samples import TrainingSample

        torch.manual_seed(0)
        loaded = load(parse_config({"model": {"init": "random", "family": self.family}, "trainer": {"device": "cpu"}}))
        if loaded.resolved.descriptor.prepare_model is not None:
            loaded.resolved.descriptor.prepare_model(loaded.model)
        loaded.model.eval()
        store, samples = ImageStore(), []
        conversations = [
            [{"role": "user", "content": [image_part(store.add(Image.new("RGB", (64, 64), "red"))), text_part("What colour is the image?")]}],
            [{"role": "user", "content": "what colour is the image ?"}],
            [{"role": "user", "content": [image_part(store.add(Image.new("RGB", (64, 64), "blue"))), text_part("what colour ?")]}],
        ]
        for k, conversation in enumerate(conversations):
            prompt = encode_messages(conversation, loaded.processor, store)
            completion = [prompt.input_ids[-1 - k]] * (3 + k)  # tokens the tokenizer surely has
            ids = prompt.input_ids + completion
            mask = [False] * len(prompt.input_ids) + [True] * len(completion)
            samples.append(TrainingSample(ids, mask, [0.0] * len(ids), prompt.image_ids, prompt.image_tokens, 1.0, k, f"sample {k}"))
        device = loaded.device
        with torch.no_grad():
            packed = make_microbatches(samples, loaded.resolved, loaded.processor, store, budget=4096, packed=True, device=device)
            assert len(packed) == 1
            logp, _ = selected_logprobs(loaded.resolved, packed[0].inputs, packed[0].targets, packed[0].loss_mask)
            owner = packed[0].sample_index[packed[0].loss_mask]
            for i, sample in enumerate(samples):
                alone = make_microbatches([sample], loaded.resolved, loaded.processor, store, budget=4096, packed=False, device=device)[0]
                inputs = {k: v for k, v in alone.inputs.items() if k != "position_ids"}  # transformers' own positions
                logits = loaded.model(**inputs, use_cache=False).logits.float()
                expected = torch.log_softmax(logits, -1).gather(-1, alone.targets[..., None]).squeeze(-1)[alone.loss_mask]
                assert torch.allclose(logp[owner == i], expected, atol=1e-4), (
                    f"sample {i}: packed logprobs differ from the sample alone by {float((logp[owner == i] - expected).abs().max()):.2e}; "
                    "check the descriptor's position_ids (and prepare_model for recurrent layers)"
                )

    def test_processor_agrees_with_the_config(self, model: Any) -> None:
        processor = _tiny_processor(self.family)
        config = model.config
        config_id = getattr(config, "image_token_id", getattr(config, "image_token_index", None))
        assert config_id is not None, "the config names no image token id"
        assert processor.tokenizer.convert_tokens_to_ids(processor.image_token) == config_id
        assert len(processor.tokenizer) <= model.get_input_embeddings().num_embeddings
