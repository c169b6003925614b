"""`PrefixRenames`: both directions, the first matching prefix, and a clear error for a name under none."""

from __future__ import annotations

import pytest

from vlmreg import PrefixRenames

RENAMES = PrefixRenames(
    (
        ("model.language_model.", "language_model.model."),
        ("model.vision_tower.", "vision_tower.vision_model."),
        ("lm_head.", "language_model.lm_head."),
    ),
    label="a Test",
)
MEMORY = [
    "model.language_model.layers.0.mlp.up_proj.weight",
    "model.vision_tower.encoder.layers.1.fc1.bias",
    "lm_head.weight",
]
DISK = [
    "language_model.model.layers.0.mlp.up_proj.weight",
    "vision_tower.vision_model.encoder.layers.1.fc1.bias",
    "language_model.lm_head.weight",
]


def test_both_directions_and_the_tensors_pass_through():
    tensors = [object() for _ in MEMORY]
    sent = list(RENAMES.checkpoint_weights(zip(MEMORY, tensors, strict=True)))
    assert [n for n, _ in sent] == DISK and all(a is b for (_, a), b in zip(sent, tensors, strict=True))
    assert [n for n, _ in RENAMES.memory_weights(sent)] == MEMORY


def test_the_first_matching_prefix_wins():
    renames = PrefixRenames((("model.visual.merger.", "merger."), ("model.visual.", "visual.")))
    assert [
        n for n, _ in renames.checkpoint_weights([("model.visual.merger.fc.weight", 0), ("model.visual.blocks.0.w", 0)])
    ] == [
        "merger.fc.weight",
        "visual.blocks.0.w",
    ]


def test_a_name_under_no_prefix_is_an_error_naming_the_family():
    with pytest.raises(
        ValueError,
        match=r"'model.norm.weight' is not a Test in-memory parameter name \(expected one of model.language_model.",
    ):
        list(RENAMES.checkpoint_weights([("model.norm.weight", 0)]))
    with pytest.raises(ValueError, match="is not a Test checkpoint name"):
        list(RENAMES.memory_weights([("model.norm.weight", 0)]))
    with pytest.raises(ValueError, match="non-empty strings"):
        PrefixRenames((("", "x."),))
