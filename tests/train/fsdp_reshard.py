"""Run under torchrun (3 processes, gloo) with a checkpoints folder two processes wrote (fsdp_shard_files.py) and the
whole state at that step read from those processes' memory (``full-2.pt``): a model FSDP2 shards over three ranks
resumes from it. Each rank holds its own chunk of three (40 rows: 14 + 14 + 12; 7: 3 + 3 + 1; 1: 1 + 0 + 0), and
every weight and optimizer state, gathered with ``full_tensor``, equals the reference; one more step runs. Rank 2,
for which the checkpoint has no RNG state, gets a stream other than ranks 0 and 1's (theirs, as saved). Prints
``rank N: OK``."""

from __future__ import annotations

import gc
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

from vlmreg.train.checkpoint import resume_checkpoint
from vlmreg.train.distributed import from_environment, full_tensor
from vlmreg.train.optim import CompensatedAdamW


def check() -> None:
    ctx = from_environment("cpu")
    assert ctx is not None and ctx.world == 3, ctx
    folder, reference = Path(sys.argv[1]), torch.load(sys.argv[2])
    mesh = init_device_mesh("cpu", (3,))
    torch.manual_seed(5)  # not the saved model's seed: every value below comes from the checkpoint
    model = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 7), torch.nn.Linear(7, 1))
    model = model.to(torch.bfloat16)
    for layer in model:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = CompensatedAdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    path, state = resume_checkpoint(folder, model, optimizer, ctx, log=print)
    assert path.name == "step_000002" and state["step"] == 2, (path, state)
    rows = {"0.weight": (14, 14, 12), "1.weight": (3, 3, 1), "2.weight": (1, 0, 0)}
    names = {id(p): name for name, p in model.named_parameters()}
    found = dict(model.named_parameters())
    for p, fields in optimizer.state.items():
        found.update({f"{names[id(p)]}::{key}": value for key, value in fields.items()})
    assert set(found) == set(reference), sorted(set(found) ^ set(reference))
    for name, value in found.items():
        if name in rows:
            assert value.to_local().shape[0] == rows[name][ctx.rank], (name, value.to_local().shape)
        whole = full_tensor(value) if value.dim() else value  # a collective: every rank, in the same order
        assert whole.dtype == reference[name].dtype and torch.equal(whole, reference[name]), name
    draws = ctx.gather_objects(torch.rand(4))
    assert not torch.equal(draws[2], draws[0]) and not torch.equal(draws[2], draws[1]), draws
    model(torch.randn(6, 24).to(torch.bfloat16)).float().pow(2).mean().backward()
    optimizer.step()  # the state it was given is usable: sharded like the parameters
    print(f"rank {ctx.rank}: {len(found)} tensors resharded from 2 processes to 3: OK", flush=True)


# in a function, and the garbage collected before the group is destroyed (see fsdp_optimizer.py)
check()
gc.collect()
dist.destroy_process_group()
