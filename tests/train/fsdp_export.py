"""Run under torchrun (2 processes, gloo): with FSDP, the checkpoint rank 0 writes for a launched vLLM (random init)
holds the whole weights, the same files as before sharding, while rank 1 takes part in gathering through
`ServerLink` as the trainer's other ranks do; its config.json names the model's own class in ``architectures``, as
transformers' own ``save_pretrained`` of the unsharded model does (not FSDP2's generated ``FSDP...`` subclass)."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

import vlmreg
from vlmreg.config import parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.inference.server_link import ServerLink
from vlmreg.inference.vllm_server import export_checkpoint
from vlmreg.train.distributed import from_environment, shard_model


class Processor:  # saving the real one needs torchvision, which this venv lacks (vLLM's machine has it)
    def save_pretrained(self, directory) -> None:
        (Path(directory) / "processor_stand_in.json").write_text("{}")


def check() -> None:
    out = Path(sys.argv[1])
    ctx = from_environment("cpu")
    raw = {
        "model": {"init": "random", "family": "qwen3_vl", "dtype": "float32"},
        "trainer": {"device": "cpu"},
        "rollout": {"engine": "openai", "server": "vllm", "launch": True},
        "broadcast": {"transport": "gloo"},
    }
    torch.manual_seed(0)
    loaded = vlmreg.load(parse_config(raw))
    # the references: transformers' own save_pretrained, and the same export from the whole model, before sharding
    if ctx.is_main:
        loaded.resolved.model.save_pretrained(out / "transformers")
        export_checkpoint(loaded.resolved, Processor(), out / "whole")
    shard_model(loaded.resolved, ctx)
    if ctx.is_main:
        # what FSDP2 made of the class
        assert type(loaded.resolved.model).__name__.startswith("FSDP"), type(loaded.resolved.model)
        ctx.gather_objects(None)  # rank 0's link: nothing stands in the way of launching vLLM
        export_checkpoint(loaded.resolved, Processor(), out / "sharded")
        ctx.gather_objects((["http://127.0.0.1:1"], "key"))  # what rank 0's link tells the others once vLLM is up
        reference = json.loads((out / "transformers" / "config.json").read_text())["architectures"]
        written = json.loads((out / "sharded" / "config.json").read_text())["architectures"]
        assert written == reference == ["Qwen3VLForConditionalGeneration"], (written, reference)
        print(f"rank 0: config.json names {written}, as transformers' save_pretrained does: OK", flush=True)
        whole, sharded = (
            {k: v for f in sorted((out / d).glob("*.safetensors")) for k, v in load_file(f).items()}
            for d in ("whole", "sharded")
        )
        assert whole and whole.keys() == sharded.keys(), sorted(set(whole) ^ set(sharded))[:5]
        for name, tensor in whole.items():
            assert torch.equal(tensor, sharded[name]), name
        print(f"rank 0: {len(whole)} tensors exported from the shards as from the whole model: OK", flush=True)
    else:
        link = ServerLink(resolve_config(parse_config(raw)), loaded.resolved, loaded.device, out / "rank1", print, ctx)
        assert link.url == "http://127.0.0.1:1", link.url
        print("rank 1: took part in the export's gathers, then got the server's URL: OK", flush=True)


# The check runs in a function and the garbage is collected after it, so the sharded modules and their device mesh
# (held in reference cycles) are freed before the group is destroyed. Left to the interpreter's exit, under load a
# rank that had printed OK was then killed by "terminate called without an active exception" (a gloo thread freed
# during C++ static destruction): 4 of 24 runs failed so on 2 busy cores, and 6 of 24 with the function alone.
check()
gc.collect()
dist.barrier()
dist.destroy_process_group()
