"""The prompt check compares every tensor the processor returns with vlmreg's, shapes included, through the layout
mapping a family declares (``processor_layout``): a layout difference nobody declared, a collation that drops or
reorders a tile, and a wrong mapping each fail, naming the tensor.

Idefics3 is the family whose layouts differ: vlmreg collates tiles per image, ``(images, most tiles, 3, 32, 32)``
zero-padded, and its processor gives one prompt's tiles in one row, ``(1, all tiles, 3, 32, 32)``. The test images
(64x64, 32x64, 96x32) make 5, 3 and 3 tiles: 5, 8 and 11 for 1, 2 and 3 images.
"""

from __future__ import annotations

import attrs
import pytest

from vlmreg.data.store import pad_and_concat
from vlmreg.sdk.registry import get_registry
from vlmreg.testing.parity import prompt_parity

FAMILY = "idefics3"


@pytest.fixture
def family_with(monkeypatch):
    """Make the registry hand out the bundled idefics3 descriptor with some fields changed, for this test only."""
    registry = get_registry()
    original = type(registry).get

    def use(**changes):
        changed = attrs.evolve(original(registry, FAMILY), **changes)
        monkeypatch.setattr(
            type(registry), "get", lambda self, name: changed if name == FAMILY else original(self, name)
        )
        return changed

    return use


def test_the_declared_layout_passes_with_every_tensor_compared():
    results = prompt_parity(FAMILY)
    assert [r.name for r in results] == ["prompt, 1 image(s)", "prompt, 2 image(s)", "prompt, 3 image(s)"]
    assert all(r.ok for r in results), [r.detail for r in results]
    assert all(
        "pixel_attention_mask, pixel_values compared through the family's processor_layout" in r.detail for r in results
    )


def test_an_undeclared_layout_difference_fails_naming_the_tensor_and_both_shapes(family_with):
    family_with(processor_layout=None)
    one, two, three = prompt_parity(FAMILY)
    assert one.ok  # one image: both layouts are (1, 5, ...)
    assert not two.ok and not three.ok
    assert "pixel_values has shape (2, 5, 3, 32, 32) in vlmreg, (1, 8, 3, 32, 32) from the processor" in two.detail
    assert "pixel_attention_mask has shape (2, 5, 32, 32) in vlmreg, (1, 8, 32, 32) from the processor" in two.detail
    assert "pixel_values has shape (3, 5, 3, 32, 32) in vlmreg, (1, 11, 3, 32, 32) from the processor" in three.detail
    assert "does not declare" in two.detail


def _drop_last_tile(per_image):
    """A wrong collation: the last image loses its last tile (its global view)."""
    *first, last = per_image
    return pad_and_concat([*first, {key: value[:, :-1] for key, value in last.items()}])


def _reverse_tiles(per_image):
    """A wrong collation: every image's tiles in reverse order (the same tiles, the same shapes)."""
    return pad_and_concat([{key: value.flip(1) for key, value in features.items()} for features in per_image])


def test_a_collation_that_drops_a_tile_fails_naming_the_tensor(family_with):
    family_with(collate_images=_drop_last_tile)
    results = prompt_parity(FAMILY)
    assert not any(r.ok for r in results)
    assert (
        "pixel_values (through processor_layout) has shape (1, 4, 3, 32, 32) in vlmreg, (1, 5, 3, 32, 32) from the "
        "processor" in results[0].detail
    )
    assert (
        "pixel_attention_mask (through processor_layout) has shape (1, 7, 32, 32) in vlmreg, (1, 8, 32, 32)"
        in results[1].detail
    )


def test_a_collation_that_reorders_tiles_fails_naming_the_tensor(family_with):
    family_with(collate_images=_reverse_tiles)
    results = prompt_parity(FAMILY)
    assert not any(r.ok for r in results)
    for r, tiles in zip(results, (5, 8, 11), strict=True):
        assert f"pixel_values (through processor_layout) differs (shape (1, {tiles}, 3, 32, 32))" in r.detail
        assert "pixel_attention_mask" not in r.detail  # every tile's mask is all ones: only the pixels show the order


def test_a_wrong_declared_mapping_fails_naming_the_tensor(family_with):
    # flattens (images, tiles) but keeps the zero padding tiles, which the processor never gives
    family_with(processor_layout=lambda collated: {k: v.flatten(0, 1)[None] for k, v in collated.items()})
    one, two, three = prompt_parity(FAMILY)
    assert one.ok  # one image has no padding tile
    assert (
        "pixel_values (through processor_layout) has shape (1, 10, 3, 32, 32) in vlmreg, (1, 8, 3, 32, 32)"
        in two.detail
    )
    assert (
        "pixel_values (through processor_layout) has shape (1, 15, 3, 32, 32) in vlmreg, (1, 11, 3, 32, 32)"
        in three.detail
    )


def test_a_mapping_that_invents_a_tensor_is_refused_by_name(family_with):
    family_with(processor_layout=lambda collated: {"pixel_mask": collated["pixel_attention_mask"]})
    results = prompt_parity(FAMILY)
    assert not any(r.ok for r in results)
    assert (
        "family 'idefics3': processor_layout returned ['pixel_mask'], which collate_images does not give"
        in results[0].detail
    )
