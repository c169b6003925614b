"""`gather_to_first` in three real gloo processes: rank 0 gets each DTensor's whole tensor (rows that divide evenly,
rows that do not, a rank holding none), the other ranks a meta tensor of its shape; the reference is the tensor before
it was distributed."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from vlmreg.broadcast.shard_gather import gather_to_first, rows_of_each_rank

#: over 3 ranks: rows that divide evenly, one rank short (5 -> 2, 2, 1; 8 -> 3, 3, 2), two ranks short, one empty (1)
SHAPES = [(6, 3), (5, 4), (1, 2), (7,), (8, 2)]
WORLD = 3


def _rank(rank: int, path: str) -> None:
    # deferred: the test process itself needs neither
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.tensor import Shard, distribute_tensor  # noqa: PLC0415

    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
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
        mp.spawn(_rank, args=(os.path.join(tmp, "store"),), nprocs=WORLD, join=True)


def test_rows_are_split_as_torch_chunk_splits_them():
    for rows in range(0, 12):
        for world in (1, 2, 3, 4):
            chunks = torch.arange(rows).chunk(world) if rows else ()
            expected = [len(c) for c in chunks] + [0] * (world - len(chunks))
            assert rows_of_each_rank(rows, world) == expected, (rows, world)


def _stopped_sync_rank(rank: int, tmp: str) -> None:
    """Ranks 0 and 1: a 2-process FSDP2 trainer, rank 0 sending; rank 2: a receiver that never gets ready."""
    # deferred: the test process itself needs none of them
    from torch.distributed.device_mesh import init_device_mesh  # noqa: PLC0415
    from torch.distributed.fsdp import fully_shard  # noqa: PLC0415

    import vlmreg  # noqa: PLC0415
    from vlmreg.broadcast import BroadcastError, Receiver, Sender, WeightPlan  # noqa: PLC0415
    from vlmreg.testing import tiny_model  # noqa: PLC0415

    folder = Path(tmp)
    resolved = vlmreg.resolve(tiny_model("qwen3_vl_moe", seed=0))
    if rank == 2:
        while not (folder / "port").exists():
            time.sleep(0.02)
        port, token = (folder / "port").read_text().split()
        receiver = Receiver(resolved, host="127.0.0.1", port=int(port), rank=1, timeout_s=30, token=token)
        while not (folder / "done").exists():  # connected, never receiving
            time.sleep(0.05)
        receiver.close()
        return
    dist.init_process_group("gloo", init_method=f"file://{tmp}/trainer", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    for layer in resolved.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(resolved.model, mesh=mesh)
    if rank == 0:
        sender = Sender(resolved, num_receivers=1, timeout_s=2.0)
        (folder / "port.tmp").write_text(f"{sender.port} {sender.token}")
        os.replace(folder / "port.tmp", folder / "port")
        sender.connect(timeout_s=60)
        try:
            sender.send(1)
            raise AssertionError("the sync should have stopped: its receiver was never ready")
        except BroadcastError as exc:
            assert "was not ready for sync 1" in str(exc)
    else:  # as `vlmreg.inference.server_link` has the other ranks do: take part in every gather
        for _ in WeightPlan.from_resolved(resolved, include_frozen_vision=True).tensors():
            pass
    dist.barrier()  # reached by both only when rank 0 issued every gather rank 1 waits in
    (folder / f"rank{rank}.ok").touch()
    if rank == 0:
        sender.close()
        (folder / "done").touch()
    dist.destroy_process_group()


def test_a_sharded_sync_that_stops_before_sending_still_issues_every_gather_so_no_rank_hangs():
    """Rank 0's sync fails at once (its receiver is never ready); rank 1 waits in the gathers of every weight, as the
    other ranks of a trainer do. Rank 0 must still issue them all (`TensorStream.drain`), or rank 1 never returns."""
    with tempfile.TemporaryDirectory() as tmp:
        context = mp.start_processes(_stopped_sync_rank, args=(tmp,), nprocs=3, join=False, start_method="spawn")
        deadline = time.monotonic() + 120
        while not context.join(timeout=1):
            if time.monotonic() > deadline:
                for process in context.processes:
                    process.kill()
                raise AssertionError(f"a rank hung: finished {sorted(p.name for p in Path(tmp).glob('rank*.ok'))}")
        assert sorted(p.name for p in Path(tmp).glob("rank*.ok")) == ["rank0.ok", "rank1.ok"]
