"""Run under torchrun (2 processes, gloo): CompensatedAdamW on FSDP2 shards (each rank steps its shard as a plain
tensor) gives, bit for bit, the weights and state one process gets stepping the whole bf16 tensors."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import distribute_tensor

from vlmreg.train.distributed import from_environment, full_tensor
from vlmreg.train.optim import CompensatedAdamW

ctx = from_environment("cpu")
torch.manual_seed(0)
whole = torch.nn.Sequential(torch.nn.Linear(24, 40), torch.nn.Linear(40, 7)).to(torch.bfloat16)  # 7 rows: uneven
sharded = copy.deepcopy(whole)
mesh = init_device_mesh("cpu", (ctx.world,))
for layer in sharded:
    fully_shard(layer, mesh=mesh)
fully_shard(sharded, mesh=mesh)
options = {"lr": 1e-3, "weight_decay": 0.1}
ours, reference = CompensatedAdamW(sharded.parameters(), **options), CompensatedAdamW(whole.parameters(), **options)
generator = torch.Generator().manual_seed(1)
for _ in range(4):
    for p, q in zip(sharded.parameters(), whole.parameters(), strict=True):
        grad = torch.randn(q.shape, generator=generator).to(torch.bfloat16)
        q.grad = grad.clone()
        p.grad = distribute_tensor(grad, p.device_mesh, p.placements)
    ours.step()
    reference.step()
for p, q in zip(sharded.parameters(), whole.parameters(), strict=True):
    assert torch.equal(full_tensor(p), q.detach()), "weights differ"
    for key in ("exp_avg", "exp_avg_sq", "compensation"):
        assert torch.equal(full_tensor(ours.state[p][key]), reference.state[q][key]), key
print(f"rank {ctx.rank}: OK")
dist.destroy_process_group()
