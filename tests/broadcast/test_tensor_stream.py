"""`TensorStream`: a sharded trainer's sync takes each tensor once, in plan order, as the packer reaches it.

The reference is the tensors themselves (their bytes through torch's own ``view(torch.uint8)``), and the order and
number of takes is what the other trainer ranks' gathers must match.
"""

from __future__ import annotations

import pytest
import torch

from vlmreg.broadcast import BroadcastError, Layout
from vlmreg.broadcast.buckets import BucketPacker
from vlmreg.broadcast.tensor_stream import TensorStream

from .test_buckets import BUCKET, sample


class Gathers:
    """A plan's (name, tensor) pairs that record each take (a gather, on a sharded trainer) and which are alive."""

    def __init__(self, pairs: list[tuple[str, torch.Tensor]]) -> None:
        self.pairs, self.taken = pairs, []

    def __iter__(self):
        for i, (name, tensor) in enumerate(self.pairs):
            self.taken.append(i)
            yield name, tensor.clone()  # a fresh tensor each take, as full_tensor() is


def test_every_bucket_s_bytes_are_the_tensors_own_and_each_tensor_is_taken_once_in_plan_order():
    pairs = sample()  # four dtypes: buckets go region by region, so a later bucket reads an earlier tensor
    layout = Layout.build(pairs, BUCKET)
    gathers = Gathers(pairs)
    stream = TensorStream(gathers, layout.signature())
    packer = BucketPacker(layout, "cpu")
    regions = [torch.zeros(r.nbytes, dtype=torch.uint8) for r in layout.regions]
    for k, target in enumerate(layout.bucket_views(regions)):
        target.copy_(packer.pack(k, stream))
        stream.release_before(packer.first_tensor(k + 1))
        later = {i for j in range(k + 1, len(layout.buckets)) for i, *_ in packer.pieces[j]}
        assert later <= set(stream._held) | set(range(stream._taken, len(pairs)))  # nothing needed is let go
        assert len(stream._held) < len(pairs)
    stream.drain()
    assert gathers.taken == list(range(len(pairs)))
    received = layout.region_views(regions)
    for name, tensor in pairs:
        assert received[name].reshape(-1).view(torch.uint8).tolist() == tensor.reshape(-1).view(torch.uint8).tolist(), (
            name
        )


def test_a_sync_that_stops_early_still_takes_every_tensor_and_lets_them_go():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    gathers = Gathers(pairs)
    stream = TensorStream(gathers, layout.signature())
    stream[1]
    stream.drain()
    assert gathers.taken == list(range(len(pairs))) and stream._held == {}


def test_a_released_tensor_asked_for_again_and_a_changed_plan_are_named():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    stream = TensorStream(pairs, layout.signature())
    stream[3]
    stream.release_before(3)
    with pytest.raises(BroadcastError, match="'b.bf16' was asked for after it was released"):
        stream[1]
    renamed = [("other", pairs[0][1]), *pairs[1:]]
    with pytest.raises(BroadcastError, match="expected 'a.weight' .* got 'other'"):
        TensorStream(renamed, layout.signature())[0]
    with pytest.raises(BroadcastError, match="the plan yields 'extra'"):
        TensorStream([*pairs, ("extra", torch.zeros(1))], layout.signature()).drain()
    with pytest.raises(BroadcastError, match="no longer yields 'd.bf16'"):
        TensorStream(pairs[:-1], layout.signature()).drain()


def test_taken_ahead_by_bytes_each_tensor_is_still_taken_once_in_order_and_the_last_ones_are_not_overrun():
    pairs = sample()
    layout = Layout.build(pairs, BUCKET)
    sizes = [t.numel() * t.element_size() for _, t in pairs]  # torch's own sizes: 140, 198, 11200, ...
    gathers = Gathers(pairs)
    stream = TensorStream(gathers, layout.signature(), ahead_bytes=sizes[1] + sizes[2])
    assert torch.equal(stream[0], pairs[0][1]) and gathers.taken == [0, 1, 2]
    assert torch.equal(stream[len(pairs) - 2], pairs[-2][1]) and gathers.taken == list(range(len(pairs)))
    stream.drain()
    assert gathers.taken == list(range(len(pairs)))
    short = Gathers(pairs)  # one byte short of the big tensor: it is taken only when asked for
    stream = TensorStream(short, layout.signature(), ahead_bytes=sizes[1] + sizes[2] - 1)
    stream[0]
    assert short.taken == [0, 1]  # tensors 1 and 2 are one byte over the budget
    stream[1]
    assert short.taken == list(range(len(pairs)))  # beyond tensor 1: the big one and the rest, 11,259 bytes, fit
