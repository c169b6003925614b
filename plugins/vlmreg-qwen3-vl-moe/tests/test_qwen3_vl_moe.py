"""Conformance of the bundled qwen3_vl_moe family, through the same checks a third-party plugin runs."""

from vlmreg.testing import FamilyConformance


class TestQwen3VlMoeConformance(FamilyConformance):
    family = "qwen3_vl_moe"
    distribution = "vlmreg-qwen3-vl-moe"


def test_the_30b_a3b_shape_counts_the_published_parameters():
    """On the meta device (no memory): the language model with its head holds the published 30.5B parameters, and
    a token reaches 3.3B of them (attention, routers, norms, 8 of the 128 experts, embedding and head), as Qwen's
    "30B-A3B" says. ``model.layers`` keeps the shape but cuts its depth."""
    # deferred: only this test builds a shape
    from vlmreg.loading.build import build_model, shallower  # noqa: PLC0415
    from vlmreg.sdk.registry import get_registry  # noqa: PLC0415

    descriptor = get_registry().get("qwen3_vl_moe")
    model = build_model(descriptor.config_for_size("30b-a3b"), descriptor, device="meta")
    params = dict(model.named_parameters())
    vision = sum(p.numel() for n, p in params.items() if ".visual." in n)
    experts = sum(p.numel() for n, p in params.items() if ".experts." in n)
    language = sum(p.numel() for p in params.values()) - vision
    text = model.config.text_config
    active = language - experts + experts * text.num_experts_per_tok // text.num_experts
    assert round(language / 1e9, 1) == 30.5 and 3.3e9 <= active < 3.4e9  # Qwen's card: 30.5B, 3.3B activated
    assert len(model.model.language_model.layers) == 48 and len(model.model.visual.blocks) == 27
    cut = shallower(descriptor.config_for_size("30b-a3b"), 12, what="30b-a3b")
    assert cut.text_config.num_hidden_layers == 12 and cut.text_config.hidden_size == 2048
