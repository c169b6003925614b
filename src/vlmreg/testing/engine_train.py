"""Engine parity while training: ``vlmreg train`` with vLLM launched on the family's model, a few synced steps.

`train_config` is the run: the family's tiny random model (or a checkpoint), the bundled ``colour`` task, GRPO,
rollouts from vLLM launched on the trainer's GPU (CUDA IPC syncs before every step: ``max_off_policy_steps = 0``),
no evaluation or checkpoints. `run_training` writes it to ``OUTPUT/train.toml``, runs ``vlmreg train`` on it as a
user would (a subprocess), and reads each step's ``mismatch_kl`` (vLLM's sampled-token logprobs against the
trainer's, k3 estimator) from ``metrics.jsonl``: at most `MISMATCH_KL_LIMIT` every step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmreg.testing.engine_parity import Comparison
from vlmreg.testing.parity import reference_attention

__all__ = ["MISMATCH_KL_LIMIT", "run_training", "train_config"]

#: the most ``mismatch_kl`` a step may show (bf16 trainer and engine, issue 26)
MISMATCH_KL_LIMIT = 1e-3


def train_config(
    family: str,
    checkpoint: str | None,
    *,
    steps: int,
    dtype: str,
    server_args: Sequence[str],
    gpu_memory_fraction: float,
    output_dir: Path,
    server: str = "vllm",
    device: str = "cuda",
    transport: str = "ipc",
    attn: str | None = None,
) -> dict[str, Any]:
    """The run config of `run_training` (a TOML document as a dict); ``attn`` by default
    `vlmreg.testing.parity.reference_attention`'s, the check's own. ``server = "vlmreg"`` launches `vlmreg serve`
    instead of vLLM (the same run on a CPU, with ``device = "cpu"`` and ``transport = "gloo"``)."""
    model = {"init": "pretrained", "name": checkpoint} if checkpoint else {"init": "random", "size": "tiny"}
    rollout: dict[str, Any] = {
        "engine": "openai",
        "server": server,
        "launch": True,
        "group_size": 4,
        "max_tokens": 8,
        "temperature": 1.0,
    }
    if server == "vllm":
        rollout.update(launch_gpu="same", gpu_memory_fraction=gpu_memory_fraction, server_args=list(server_args))
    return {
        "model": {
            **model,
            "family": family,
            "dtype": dtype,
            "attn_implementation": attn or reference_attention(family, checkpoint),
        },
        "rollout": rollout,
        "broadcast": {"transport": transport},
        "trainer": {
            "algorithm": "grpo",
            "steps": steps,
            "prompts_per_step": 4,
            "learning_rate": 1e-3,
            "seq_len": 1024,
            "max_tokens_per_microbatch": 4096,
            "device": device,
            "output_dir": str(output_dir),
            "save_every": 0,
            "max_off_policy_steps": 0,
        },
        "data": {"task": "colour"},
        "eval": {"every": 0},
    }


def _tail(path: Path, lines: int = 8) -> str:
    text = path.read_text(errors="replace").strip().splitlines()[-lines:] if path.exists() else []
    return " | ".join(line.strip() for line in text)


def run_training(
    family: str,
    checkpoint: str | None = None,
    *,
    steps: int = 3,
    dtype: str = "bfloat16",
    server_args: Sequence[str] = (),
    gpu_memory_fraction: float = 0.1,
    output_dir: Path,
    timeout_s: float = 540.0,
    **where: str,
) -> list[Comparison]:
    """Run ``vlmreg train`` for ``steps`` synced steps with vLLM and compare each step's ``mismatch_kl`` with the limit
    (``where``: `train_config`'s ``server``, ``device`` and ``transport``)."""
    # deferred: start-up cost (loads cattrs)
    from vlmreg.config import parse_config  # noqa: PLC0415
    from vlmreg.config.toml_out import to_toml  # noqa: PLC0415

    output_dir.mkdir(parents=True, exist_ok=True)
    run_dir = output_dir / "train"
    raw = train_config(
        family,
        checkpoint,
        steps=steps,
        dtype=dtype,
        server_args=server_args,
        gpu_memory_fraction=gpu_memory_fraction,
        output_dir=run_dir,
        **where,
    )
    config = output_dir / "train.toml"
    config.write_text(
        f"# vlmreg check --engine vllm --train {steps}: {steps} synced steps of {family}\n# Run: vlmreg train "
        f"{config}\n" + to_toml(parse_config(raw))
    )
    log = output_dir / "train.log"
    started = time.perf_counter()
    with log.open("w") as out:
        process = subprocess.Popen(
            [sys.executable, "-m", "vlmreg", "train", str(config), "--overwrite"],
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
        try:
            code: int | None = process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            code = None
            process.send_signal(signal.SIGINT)  # as Ctrl-C: the trainer stops the vLLM it launched on its way out
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
    seconds = time.perf_counter() - started
    metrics = run_dir / "metrics.jsonl"
    records = (
        [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()] if metrics.exists() else []
    )
    found: list[Comparison] = []
    for record in records:
        kl = record.get("mismatch_kl")
        ok = isinstance(kl, (int, float)) and kl < MISMATCH_KL_LIMIT
        found.append(
            Comparison(
                f"train step {record.get('step')}: mismatch_kl",
                "PASS" if ok else "FAIL",
                f"{kl!r} ({dtype}, limit {MISMATCH_KL_LIMIT:g}; step {record.get('step_s') or 0:.2f} s, sync "
                f"{record.get('sync_s') or 0:.3f} s)",
                float(kl) if isinstance(kl, (int, float)) else None,
            )
        )
    if code != 0 or len(records) < steps:
        why = f"exit code {code}" if code is not None else f"still running after {timeout_s:g} s (stopped)"
        found.append(
            Comparison(
                "vlmreg train",
                "FAIL",
                f"{why}, {len(records)} of {steps} steps in {seconds:.0f} s; {log} ends: {_tail(log)}",
            )
        )
    else:
        found.append(
            Comparison(
                "vlmreg train",
                "PASS",
                f"{steps} synced steps in {seconds:.0f} s from {checkpoint or 'a random init'} ({config})",
            )
        )
    return found
