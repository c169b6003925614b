"""The chunked-copy kernel against torch's own copy_ (GPU only), and what it refuses (everywhere)."""

from __future__ import annotations

import pytest
import torch

from vlmreg.broadcast import copy_kernel


def test_only_plain_byte_ranges_are_eligible():
    a = torch.zeros(8, 4)
    assert not copy_kernel.eligible(a, a.clone())  # on the CPU
    if torch.cuda.is_available():
        b = torch.zeros(8, 4, device="cuda")
        assert copy_kernel.eligible(b, b.clone())
        assert not copy_kernel.eligible(b, b.t().contiguous().t())  # not contiguous
        assert not copy_kernel.eligible(b, b.half())  # a cast
        # 28 bytes: not whole words
        assert not copy_kernel.eligible(b[:, :1].contiguous().view(-1)[1:], b.view(-1)[1:8])


@pytest.mark.skipif(not copy_kernel.available(), reason="needs a GPU and Triton")
def test_many_copies_in_one_launch_equal_torch_s():
    g = torch.Generator(device="cuda").manual_seed(0)
    # whole words: within a chunk, on its boundary, across many
    sizes = [4, 1000, 16384, 16386, 70000, 3 * 8192 * 4 + 12]
    big = torch.randn(sum(sizes) * 2, device="cuda", generator=g, dtype=torch.float32)
    sources, targets, offset = [], [], 0
    for n in sizes:  # views at offsets inside one allocation, as fused weights are
        sources.append(big[offset : offset + n])
        offset += n
    pool = torch.full((sum(sizes) + 64,), -1.0, device="cuda")
    offset = 2  # word-aligned (8 bytes), not allocation-aligned
    for n in sizes:
        targets.append(pool[offset : offset + n])
        offset += n + 2
    chunked = copy_kernel.ChunkedCopies(list(zip(targets, sources, strict=True)))
    chunked.run()
    torch.cuda.synchronize()
    for t, s in zip(targets, sources, strict=True):
        assert torch.equal(t, s)
    untouched = torch.ones_like(pool, dtype=torch.bool)
    offset = 2
    for n in sizes:
        untouched[offset : offset + n] = False
        offset += n + 2
    assert bool((pool[untouched] == -1.0).all())  # nothing written outside the targets
    bf16 = torch.randn(4096, 2048, device="cuda", generator=g).bfloat16()
    into = torch.empty_like(bf16)
    copy_kernel.ChunkedCopies([(into[:1000], bf16[3000:4000]), (into[1000:], bf16[:3096])]).run()
    torch.cuda.synchronize()
    assert torch.equal(into[:1000], bf16[3000:4000]) and torch.equal(into[1000:], bf16[:3096])
