"""Run under torchrun (2 processes, gloo) with a folder: sharded checkpoints of an FSDP2 model and CompensatedAdamW.

- Each rank's files hold exactly its ``to_local()`` shards; rank 0 reads every rank's files and their concatenation
  along dim 0 is ``full_tensor`` of each weight and optimizer state (uneven rows, and a rank with no rows).
- A fresh model resumed from it equals the saved one (weights and optimizer state), and one more step on each stays
  equal: the resumed run goes on as the uninterrupted one.
- Rank 1 failing to write (no space) fails the save on both ranks with its message; ``latest`` and the previous
  checkpoint stay as they were and no temporary folder is left.
- A NaN in rank 1's file of the newest checkpoint: both ranks skip it and resume the same earlier one.
- ``keep = 1`` removes the older sharded checkpoints whole.
- An output folder rank 1 does not share with rank 0 (each rank's working directory is its own "machine"): both
  ways it shows (rank 1 cannot see rank 0's folder; rank 1 writes into a stale folder of its own, so rank 0 finds
  its files missing) end with the message naming rank 1 and the shared filesystem.
Prints ``rank N: OK``."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from vlmreg.train import shard_checkpoint
from vlmreg.train.checkpoint import CheckpointError, resume_checkpoint, save_checkpoint
from vlmreg.train.distributed import from_environment, full_tensor
from vlmreg.train.optim import CompensatedAdamW

ctx = from_environment("cpu")
assert ctx is not None
out = Path(sys.argv[1])
folder = out / "checkpoints"
mesh = init_device_mesh("cpu", (ctx.world,))


def build(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    # 7 rows: 4 + 3; Linear(7, 1): one row, so rank 1 holds none of it
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 7), torch.nn.Linear(7, 1))
    model = model.to(torch.bfloat16)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, CompensatedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, steps: int, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(6, 24, generator=generator).to(torch.bfloat16)
        model(x).float().pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()


def states(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every weight and optimizer state by its checkpoint name, sharded tensors as they are."""
    found: dict[str, torch.Tensor] = dict(model.named_parameters())
    names = {id(p): name for name, p in model.named_parameters()}
    for p, fields in optimizer.state.items():
        found.update({f"{names[id(p)]}::{key}": value for key, value in fields.items()})
    return found


def save_error(folder: Path, step: int) -> str:
    """The message of a save of this rank's model (the script's own) that must fail."""
    try:
        save_checkpoint(folder, step, model, optimizer, {"source": None}, ctx=ctx)
    except CheckpointError as exc:
        return str(exc)
    raise AssertionError("the save did not fail")


def digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir())}


model, optimizer = build(0)
train(model, optimizer, 2, seed=1)
saved = save_checkpoint(folder, 2, model, optimizer, {"source": None}, ctx=ctx)
rank, world = ctx.rank, ctx.world

# each rank's files hold exactly its own shards; together they are the whole tensors
own = {
    **load_file(saved / f"trainable.rank{rank:05d}-of-{world:05d}.safetensors"),
    **load_file(saved / f"optimizer.rank{rank:05d}-of-{world:05d}.safetensors"),
}
live = states(model, optimizer)
assert set(own) == set(live), sorted(set(own) ^ set(live))
assert own["2.weight"].shape[0] == (1 if rank == 0 else 0)  # the one-row weight: all of it on rank 0
for name, value in live.items():
    local = value.to_local() if hasattr(value, "to_local") else value
    assert own[name].dtype == local.dtype and torch.equal(own[name], local.detach()), name
every = [
    {
        **load_file(saved / f"trainable.rank{r:05d}-of-{world:05d}.safetensors"),
        **load_file(saved / f"optimizer.rank{r:05d}-of-{world:05d}.safetensors"),
    }
    for r in range(world)
]
for name, value in live.items():
    whole = full_tensor(value)  # a collective: every rank
    if value.dim() == 0:  # the step count: whole on every rank
        assert all(torch.equal(files[name], whole) for files in every), name
    else:
        assert torch.equal(torch.cat([files[name] for files in every]), whole), name
at_step_2 = {
    name: full_tensor(value).clone() for name, value in live.items()
}  # a copy: the step count is updated in place
if rank == 0:  # the whole state at step 2, read from memory: the reference of the resharded loads (test_reshard.py)
    torch.save(at_step_2, out / "full-2.pt")
state = json.loads((saved / "state.json").read_text())
assert state["sharded"] == {"world_size": 2} and state["step"] == 2, state
assert not (saved / "trainable.safetensors").exists() and (saved / "rng.safetensors").is_file()

# resumed into a fresh model: equal, and one more step on each stays equal
other, other_optimizer = build(5)
path, _ = resume_checkpoint(folder, other, other_optimizer, ctx, log=print)
assert path == saved
for name, value in states(other, other_optimizer).items():
    assert torch.equal(full_tensor(value), full_tensor(live[name])), f"resumed {name}"
train(model, optimizer, 1, seed=2)
train(other, other_optimizer, 1, seed=2)
live = states(model, optimizer)
for name, value in states(other, other_optimizer).items():
    assert torch.equal(full_tensor(value), full_tensor(live[name])), f"stepped {name}"

# rank 1 cannot write: no new checkpoint, the previous one as it was
before = digest(saved)
real_save_file = shard_checkpoint.save_file
if rank == 1:

    def no_space(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    shard_checkpoint.save_file = no_space
message = save_error(folder, 3)
shard_checkpoint.save_file = real_save_file
expected = (
    f"could not write checkpoint {folder / 'step_000003'}: rank 1: No space left on device "
    f"({folder / '.tmp-step_000003' / 'trainable.rank00001-of-00002.safetensors'}); the partial .tmp-step_000003 was "
    f"removed and {folder / 'latest'} still names step_000002"
)
assert message == expected, message
assert (folder / "latest").read_text() == "step_000002"
assert sorted(p.name for p in folder.iterdir()) == ["latest", "step_000002"], sorted(folder.iterdir())
assert digest(saved) == before

# one rank's file of the newest checkpoint damaged (a NaN moment): every rank falls back to the same earlier one
dist.barrier()  # both ranks have looked at the folder before rank 0 starts the next save
newest = save_checkpoint(folder, 6, model, optimizer, {"source": None}, ctx=ctx)
damaged = newest / "optimizer.rank00001-of-00002.safetensors"
if rank == 1:
    with safe_open(damaged, "pt") as f:
        metadata, tensors = f.metadata(), {key: f.get_tensor(key) for key in f.keys()}  # noqa: SIM118
    tensors["1.weight::exp_avg"].view(-1)[0] = float("nan")
    save_file(tensors, damaged, metadata=metadata)
dist.barrier()
fresh, fresh_optimizer = build(7)
warnings: list[str] = []
path, _ = resume_checkpoint(folder, fresh, fresh_optimizer, ctx, log=warnings.append)
assert path == saved, path
assert warnings == [
    (
        f"warning: skipped checkpoint step_000006: {damaged}: optimizer state '1.weight::exp_avg' holds 1 NaN or "
        "infinite value(s); the run diverged or the file is damaged"
    ),
    "warning: resuming from step_000002, the newest good checkpoint, after skipping 1 newer one(s)",
], warnings
for name, value in states(fresh, fresh_optimizer).items():
    assert torch.equal(full_tensor(value), at_step_2[name]), f"fallback {name}"

# retention: keep = 1 leaves only the new checkpoint, every rank's files of the older ones gone
retention = out / "retention"
for step in (8, 9):
    save_checkpoint(retention, step, model, optimizer, {"source": None}, keep=1, ctx=ctx)
assert sorted(p.name for p in retention.iterdir()) == ["latest", "step_000009"], sorted(retention.iterdir())

# an output folder rank 1 does not share: each rank's working directory is its own machine
view = out / f"view{rank}"
view.mkdir()
os.chdir(view)
message = save_error(Path("checkpoints"), 4)
assert message == (
    "could not write checkpoint checkpoints/step_000004: rank 1 does not see the folder "
    "checkpoints/.tmp-step_000004 that rank 0 made: output_dir must be on a filesystem every rank sees (a shared one "
    "when the ranks run on several machines); the partial .tmp-step_000004 was removed and there is no earlier "
    "checkpoint"
), message
if rank == 1:  # a stale folder of the same name on rank 1's machine: it writes there, rank 0 does not find it
    (view / "checkpoints" / ".tmp-step_000005").mkdir(parents=True)
dist.barrier()
message = save_error(Path("checkpoints"), 5)
assert message == (
    "could not write checkpoint checkpoints/step_000005: checkpoints/.tmp-step_000005/"
    "trainable.rank00001-of-00002.safetensors is missing although rank 1 wrote it: output_dir must be on a filesystem "
    "every rank sees (a shared one when the ranks run on several machines); the partial .tmp-step_000005 was removed "
    "and there is no earlier checkpoint"
), message
if rank == 0:
    assert sorted(p.name for p in (view / "checkpoints").iterdir()) == [], list((view / "checkpoints").iterdir())
print(f"rank {rank}: OK", flush=True)
dist.barrier()
# leave without tearing gloo down: its teardown at exit aborted a rank now and then ("terminate called without an
# active exception"), after every check had passed
os._exit(0)
