"""Start vLLM as an attached rollout server for a trainer elsewhere (another node, another job), as vlmreg launches it.

Writes the run's initial checkpoint for vLLM when the config's model is a random init (or uses its checkpoint
folder), then replaces this process with vLLM's OpenAI server, started with the flags the trainer's own launch uses
(`vlmreg.inference.vllm_server.vllm_command`: the worker extension, the weight-transfer config, processed logprobs, the
API-key middleware) and ``VLLM_SERVER_DEV_MODE=1``. Set ``VLMREG_API_KEY`` (the same for the trainer) and
``CUDA_VISIBLE_DEVICES`` before running it; docs/scaling.md shows it in a Slurm and a Kubernetes job.

    VLMREG_API_KEY=... CUDA_VISIBLE_DEVICES=2 python benchmarks/attached_vllm.py CONFIG --host 0.0.0.0 --port 8100
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import vlmreg
from vlmreg.config import load_config
from vlmreg.config.resolve import resolve_config
from vlmreg.inference.vllm_server import export_checkpoint, exports_weights, vllm_command


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="the trainer's run config (TOML)")
    parser.add_argument("--host", default="0.0.0.0", help="the address vLLM listens on (default: every interface)")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--dir", default="/tmp/vlmreg-attached", help="where a random init's checkpoint is written")
    parser.add_argument("--server-args", default="", help="extra vLLM arguments, space-separated")
    args = parser.parse_args()
    if not os.environ.get("VLMREG_API_KEY"):
        sys.exit(
            "error: set VLMREG_API_KEY (the trainer sends the same key); the weight endpoints stay closed without it"
        )
    rc = resolve_config(load_config(Path(args.config)))
    loaded = vlmreg.load(rc.config)
    if exports_weights(rc):
        model = str(export_checkpoint(loaded.resolved, loaded.processor, Path(args.dir)))
    else:
        model = str(rc.config.model.name)
    config = loaded.resolved.model.config
    text = getattr(config, "text_config", config)
    limit = rc.config.trainer.seq_len + rc.config.rollout.max_tokens
    positions = getattr(text, "max_position_embeddings", None)
    dtype = str(next(loaded.resolved.model.parameters()).dtype).removeprefix("torch.")
    command = vllm_command(rc, model, args.port, dtype, min(limit, positions) if positions else limit)
    command[command.index("--host") + 1] = args.host
    command += args.server_args.split()
    del loaded
    print(" ".join(command), flush=True)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"
    os.execv(command[0], command)


if __name__ == "__main__":
    main()
