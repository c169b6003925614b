"""`gather_to_first` in two real gloo processes: rank 0 gets each DTensor's whole tensor (rows that divide evenly,
rows that do not, a rank holding none), the other rank a meta tensor of its shape; the reference is the tensor before
it was distributed."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlmreg.broadcast.shard_gather import gather_to_first, rows_of_each_rank

SHAPES = [(6, 3), (5, 4), (1, 2), (7,)]


def _rank(rank: int, path: str) -> None:
    # deferred: the test process itself needs neither
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    try:
        for i, shape in enumerate(SHAPES):
            whole = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape) + 100 * i
            got = gather_to_first(distribute_tensor(whole, mesh, [Shard(0)]))
            if rank == 0:
                assert torch.equal(got, whole), (shape, got)
            else:
                assert got.is_meta and got.shape == whole.shape and got.dtype == whole.dtype
    finally:
        dist.destroy_process_group()


def test_rank_0_gets_every_whole_tensor_and_the_other_rank_only_its_shape():
    with tempfile.TemporaryDirectory() as tmp:
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        mp.spawn(_rank, args=(os.path.join(tmp, "store"),), nprocs=2, join=True)


def test_rows_are_split_as_torch_chunk_splits_them():
    for rows in range(0, 12):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            expected = [len(c) for c in chunks] + [0] * (world - len(chunks))
            assert rows_of_each_rank(rows, world) == expected, (rows, world)
