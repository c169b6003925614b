"""Bucket layout: packing round-trips bitwise (dtypes, a tensor larger than a bucket), JSON round-trips, checksums."""

from __future__ import annotations

import json
import re

import pytest
import torch

from vlmreg.broadcast import BroadcastError, Layout, bucket_checksum, buckets
from vlmreg.broadcast.buckets import ALIGN, BucketPacker, wire_order

BUCKET = 4096


def sample() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("a.weight", torch.randn(7, 5, generator=g)),
        ("b.bf16", torch.randn(3, 33, generator=g).to(torch.bfloat16)),
        ("big.weight", torch.randn(40, 70, generator=g)),  # 11200 bytes: spans three 4 KiB buckets
        ("c.half", torch.randn(11, generator=g).to(torch.float16)),
        ("steps", torch.tensor(7, dtype=torch.int64)),
        ("mask", torch.rand(13, generator=g) > 0.5),
        ("empty", torch.zeros(0, 4)),
        ("d.bf16", torch.randn(2, 2, 2, generator=g).to(torch.bfloat16)),
    ]


def send_and_receive(layout: Layout, tensors: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """Pack every bucket on one side and copy its bytes into freshly allocated regions on the other."""
    packer = BucketPacker(layout, "cpu")
    regions = [torch.full((r.nbytes,), 0xAB, dtype=torch.uint8) for r in layout.regions]
    for k, target in enumerate(layout.bucket_views(regions)):
        sent = packer.pack(k, tensors)
        assert sent.dtype == torch.uint8 and sent.shape == target.shape  # the bytes the receiver's view expects
        target.copy_(sent)
    return layout.region_views(regions)


def test_packing_round_trips_every_dtype_bitwise():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    received = send_and_receive(layout, [t for _, t in pairs])
    assert list(received) == [name for name, _ in pairs]
    for name, tensor in pairs:
        assert received[name].dtype == tensor.dtype and received[name].shape == tensor.shape
        assert torch.equal(received[name], tensor), name


def test_a_bucket_inside_one_tensor_is_sent_from_it_without_a_copy():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    tensors = [t for _, t in pairs]
    packer = BucketPacker(layout, "cpu")
    direct = [k for k in range(len(layout.buckets)) if packer.direct(k)]
    assert direct == [1]  # bytes 4096..8191 of the float32 region lie inside big.weight
    big = tensors[2]
    sent = packer.pack(1, tensors)
    assert big.data_ptr() <= sent.data_ptr() < big.data_ptr() + big.numel() * big.element_size()


def test_layout_groups_by_dtype_and_bounds_every_bucket():
    layout = Layout.build(sample(), BUCKET)
    assert [r.dtype for r in layout.regions] == ["float32", "bfloat16", "float16", "int64", "bool"]
    assert all(0 < b.nbytes <= BUCKET for b in layout.buckets)
    assert all(slot.offset % ALIGN == 0 for slot in layout.tensors)
    big = next(i for i, s in enumerate(layout.tensors) if s.name == "big.weight")
    holding = [k for k in range(len(layout.buckets)) if any(i == big for i, *_ in layout.bucket_pieces(k))]
    assert len(holding) == 3
    assert layout.payload_bytes == sum(t.numel() * t.element_size() for _, t in sample())


def test_layout_json_round_trips():
    layout = Layout.build(sample(), BUCKET)
    assert Layout.from_json(layout.to_json()) == layout


def test_layout_check_and_mismatch_name_the_tensor():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    changed = [(n, t.double() if n == "a.weight" else t) for n, t in pairs]
    with pytest.raises(BroadcastError, match=r"expected 'a.weight' \(7, 5\) float32, got 'a.weight' \(7, 5\) float64"):
        layout.check(changed)
    expected = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in pairs}
    assert layout.mismatch(expected, complete=True) is None
    expected["big.weight"] = ((40, 71), "float32")
    assert (
        layout.mismatch(expected, complete=True)
        == "tensor 'big.weight': the sender sends (40, 70) float32, this model has (40, 71) float32"
    )
    expected["extra"] = ((1,), "float32")
    del expected["big.weight"]
    assert "'big.weight' ((40, 70) float32) is sent, but this model has no such tensor" in layout.mismatch(
        expected, complete=False
    )


def test_checksum_detects_a_flipped_bit_or_byte_anywhere():
    buffer = torch.randint(0, 256, (8 * 4100,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    reference = bucket_checksum(buffer)
    assert reference.dtype == torch.int64 and reference.dim() == 0
    for position in (0, 7, 15, 777, 8 * 4096 - 1, 8 * 4096, len(buffer) - 1):  # last: the top bit of the last word
        for flip in (1, 0x80, 0xFF):
            corrupted = buffer.clone()
            corrupted[position] ^= flip
            assert bucket_checksum(corrupted) != reference, (position, flip)
    swapped = buffer.clone()
    swapped[0:8], swapped[8:16] = buffer[8:16], buffer[0:8]
    assert bucket_checksum(swapped) != reference


def test_checksum_is_the_odd_weighted_sum_of_int64_words_mod_2_64():
    buffer = torch.randint(0, 256, (8 * (4096 + 5),), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    words = buffer.view(torch.int64).tolist()
    expected = sum((2 * i + 1) * w for i, w in enumerate(words)) % 2**64
    expected -= 2**64 if expected >= 2**63 else 0
    assert int(bucket_checksum(buffer)) == expected
    assert int(bucket_checksum(buffer[8:])) != expected  # a shifted view is checksummed on its own words


def test_layout_check_refuses_a_plan_that_yields_fewer_or_more_tensors():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    assert [t is p[1] for t, p in zip(layout.check(pairs), pairs, strict=True)] == [True] * len(pairs)
    with pytest.raises(
        BroadcastError, match=r"the plan no longer yields 'd.bf16'; it changed since its layout was sent"
    ):
        layout.check(pairs[:-1])
    with pytest.raises(BroadcastError, match=r"the plan yields 'late', which its layout does not have"):
        layout.check([*pairs, ("late", torch.zeros(1))])


@pytest.mark.parametrize("bucket", [1024, 4096])
def test_strided_tensors_pack_as_their_contiguous_copies_without_a_whole_copy(monkeypatch, bucket):
    """Transposed views (the published layout of fused experts; a transposed matrix; a single expert; every other
    element of a vector), split across buckets at every kind of boundary (inside one index of the first dimension,
    across several whole ones, a bucket wholly inside one, a piece that starts inside a bucket), pack to the bytes of
    their contiguous copies; and no piece copies a whole strided tensor of two or more dimensions."""
    g = torch.Generator().manual_seed(1)
    experts = torch.randn(5, 48, 20, generator=g).to(torch.bfloat16)  # in memory (E, 2I, H); sent as (E, H, 2I)
    down = torch.randn(3, 20, 24, generator=g)
    proj = torch.randn(60, 80, generator=g)
    small = torch.randn(9, generator=g)
    pairs = [
        ("gate_up", experts.transpose(1, 2)),
        ("down", down.transpose(1, 2)),
        ("proj", proj.t()),  # float32 after down: starts inside a bucket
        ("one_expert", torch.randn(1, 6, 4, generator=g).transpose(1, 2)),
        ("every_other", torch.randn(40, generator=g)[::2]),
        ("small", small),
    ]
    assert not any(t.is_contiguous() for _, t in pairs[:-1])
    layout = Layout.build(pairs, bucket)
    as_bytes = buckets._as_bytes
    copied = []  # the sizes of strided tensors read as bytes (each such read is a copy)
    monkeypatch.setattr(
        buckets, "_as_bytes", lambda t: (copied.append(t.numel()) if not t.is_contiguous() else None) or as_bytes(t)
    )
    received = send_and_receive(layout, [t for _, t in pairs])
    for name, tensor in pairs:
        assert torch.equal(received[name], tensor.contiguous()), name
    assert copied == [20] * len(copied)  # only every_other (1-D, 20 elements); the permuted views are not copied


def test_a_permuted_view_travels_as_the_bytes_of_the_tensor_it_permutes_and_arrives_with_its_strides():
    """The published layout of fused experts is a transpose of the trainer's tensor: on the wire are that tensor's
    own bytes (torch's ``view(uint8)`` of it, the reference), and the receiver's view has the published shape and the
    transposed strides, so an engine transposing it back reads contiguous memory."""
    g = torch.Generator().manual_seed(2)
    memory = torch.randn(4, 12, 10, generator=g).to(torch.bfloat16)  # (E, 2I, H) in the trainer
    published = memory.transpose(1, 2)  # (E, H, 2I)
    pairs = [("norm", torch.randn(10, generator=g)), ("experts", published)]
    layout = Layout.from_json(Layout.build(pairs, 4096).to_json())  # as the receiver reads it
    assert [slot.order for slot in layout.tensors] == [None, (0, 2, 1)]
    packer = BucketPacker(layout, "cpu")
    regions = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in layout.regions]
    for k, target in enumerate(layout.bucket_views(regions)):
        target.copy_(packer.pack(k, [t for _, t in pairs]))
    slot = layout.tensors[1]
    wire = regions[slot.region][slot.offset : slot.offset + slot.nbytes]
    assert wire.tolist() == memory.reshape(-1).view(torch.uint8).tolist()
    received = layout.region_views(regions)["experts"]
    assert received.shape == published.shape and received.stride() == published.stride()
    assert torch.equal(received, published) and received.transpose(1, 2).is_contiguous()


@pytest.mark.parametrize(
    ("tensor", "order"),
    [
        (torch.zeros(3, 4), None),
        (torch.zeros(3, 4).t(), (1, 0)),
        (torch.zeros(2, 3, 4).permute(2, 0, 1), (1, 2, 0)),
        (torch.zeros(6, 4)[::2], None),  # rows skipped: no permutation makes it contiguous
        (torch.zeros(1, 5, 1).transpose(0, 2), None),  # size-1 dims: contiguous already
        (torch.zeros(8)[::2], None),
    ],
)
def test_wire_order_is_the_permutation_that_makes_a_view_contiguous(tensor, order):
    assert wire_order(tensor) == order
    if order is not None:
        assert tensor.permute(order).is_contiguous()


def test_a_one_byte_tensor_and_an_empty_one_round_trip():
    pairs = [("flag", torch.tensor(True)), ("empty", torch.zeros(0)), ("byte", torch.tensor([7], dtype=torch.uint8))]
    layout = Layout.build(pairs, BUCKET)
    received = send_and_receive(layout, [t for _, t in pairs])
    for name, tensor in pairs:
        assert torch.equal(received[name], tensor), name


def test_a_bucket_names_only_the_tensors_with_bytes_in_it():
    """Two float32 tensors of exactly one 256-byte bucket each: the first ends where the second bucket begins, so the
    second bucket holds the second tensor alone (and is sent straight from it)."""
    pairs = [("first", torch.ones(64)), ("second", torch.full((64,), 2.0))]
    layout = Layout.build(pairs, ALIGN)
    assert [layout.names_in_bucket(k) for k in range(2)] == [["first"], ["second"]]
    packer = BucketPacker(layout, "cpu")
    assert packer.direct(0) and packer.direct(1)


def test_the_sender_packs_into_a_ring_of_two_buffers_of_the_largest_bucket():
    """docs/broadcast.md: a ring of two reusable buffers (one, for a layout of one bucket; none needed, for nothing)."""
    layout = Layout.build(sample(), BUCKET)
    assert len(layout.buckets) > 2
    packer = BucketPacker(layout, "cpu")
    assert [(r.numel(), r.dtype) for r in packer.ring] == [(BUCKET, torch.uint8)] * 2
    one = BucketPacker(Layout.build([("a", torch.ones(4))], BUCKET), "cpu")
    assert [r.numel() for r in one.ring] == [ALIGN]
    nothing = Layout.build([], BUCKET)
    assert nothing.buckets == () and BucketPacker(nothing, "cpu").pieces == []


def test_a_tensor_named_twice_is_refused():
    with pytest.raises(BroadcastError, match=r"^tensor 'a' appears twice in the plan$"):
        Layout.build([("a", torch.ones(2)), ("b", torch.ones(2)), ("a", torch.ones(3))], BUCKET)


def test_layout_json_is_the_documented_format():
    """The keys and values docs/broadcast.md shows: the bucket size rounded down to the alignment, the payload bytes."""
    pairs = sample()
    data = json.loads(Layout.build(pairs, 5000).to_json())
    assert list(data) == ["version", "align", "bucket_bytes", "bytes", "regions", "buckets", "tensors"]
    assert data["version"] == 2 and data["align"] == 256 and data["bucket_bytes"] == 4864
    assert data["bytes"] == sum(t.numel() * t.element_size() for _, t in pairs)
    assert data["tensors"][0] == {
        "name": "a.weight",
        "shape": [7, 5],
        "dtype": "float32",
        "region": 0,
        "offset": 0,
        "nbytes": 140,
        "order": None,
    }


@pytest.mark.parametrize(("version", "align"), [(1, 256), (2, 512)])
def test_a_layout_of_another_version_or_alignment_is_refused_naming_both(version, align):
    data = json.loads(Layout.build(sample(), BUCKET).to_json())
    data.update(version=version, align=align)
    message = (
        f"layout version {version} / align {align} from the sender; this vlmreg reads version 2 / align 256 "
        "(run the same vlmreg on both sides)"
    )
    with pytest.raises(BroadcastError, match=f"^{re.escape(message)}$"):
        Layout.from_json(json.dumps(data))


def test_a_layout_naming_an_unknown_dtype_is_refused():
    data = json.loads(Layout.build(sample(), BUCKET).to_json())
    data["regions"][0]["dtype"] = "float99"
    with pytest.raises(BroadcastError, match=r"^layout names an unknown dtype 'float99'$"):
        Layout.from_json(json.dumps(data))


def test_layout_check_refuses_a_renamed_tensor_of_the_same_shape_and_dtype():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    renamed = [("a.renamed" if n == "a.weight" else n, t) for n, t in pairs]
    with pytest.raises(BroadcastError, match=r"expected 'a.weight' \(7, 5\) float32, got 'a.renamed' \(7, 5\) float32"):
        layout.check(renamed, layout.signature())


def test_mismatch_names_the_first_tensor_not_sent_and_counts_them():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    expected = {n: (tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in pairs}
    expected.update({"extra.one": ((1,), "float32"), "extra.two": ((2,), "float32")})
    assert layout.mismatch(expected, complete=False) is None
    assert layout.mismatch(expected, complete=True) == "tensor 'extra.one' of this model is not sent (2 missing)"


def test_checksum_of_a_view_at_an_offset_that_is_not_a_multiple_of_eight():
    """A direct bucket of a tensor view may start at any byte: its checksum is still the formula over its own words."""
    buffer = torch.randint(0, 256, (8 * 40 + 9,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    for offset in (1, 9):
        view = buffer[offset : offset + 8 * 40]
        words = view.clone().view(torch.int64).tolist()
        expected = sum((2 * i + 1) * w for i, w in enumerate(words)) % 2**64
        expected -= 2**64 if expected >= 2**63 else 0
        assert int(bucket_checksum(view)) == expected, offset
