"""Launching vLLM for training: whether the trainer can (`launch_problem`), the checkpoint it writes for it
(`export_checkpoint`: config, weights in the published layout, the family's engine processor) and the command line
(`vllm_command`). `vlmreg.inference.vllm_server.VllmServer` starts and drives the server."""

from __future__ import annotations

import copy
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from vlmreg.broadcast import WeightPlan
from vlmreg.broadcast.adapters import is_adapter_tensor
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.inference.thinking import vllm_reasoning_config
from vlmreg.loading.wrapped import model_class_name
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.errors import VlmregError

__all__ = [
    "AUTH_MIDDLEWARE",
    "EXTENSION",
    "default_fraction",
    "export_checkpoint",
    "export_weights",
    "exports_weights",
    "launch_problem",
    "tensor_parallel_size",
    "vllm_command",
]

EXTENSION = "vlmreg.inference.vllm_worker.VlmregWorkerExtension"
AUTH_MIDDLEWARE = "vlmreg.inference.vllm_auth.RequireApiKey"


def exports_weights(rc: ResolvedConfig) -> bool:
    """Whether a launched vLLM loads weights the trainer writes (`export_checkpoint`): a random init, or any model
    without a checkpoint name; otherwise vLLM loads the checkpoint's own files."""
    section = rc.config.model
    return not (section.init == "pretrained" and section.name)


def launch_problem(rc: ResolvedConfig, device: Any) -> str | None:
    """Why the trainer cannot launch vLLM here (not importable, no GPU), or ``None``: checked before anything starts."""
    if importlib.util.find_spec("vllm") is None:
        return (
            f'rollout.server = "vllm" with launch = true: vLLM is not importable by {sys.executable} (pip install '
            '"vlmreg[vllm]")'
        )
    if getattr(device, "type", None) != "cuda":
        return f'rollout.server = "vllm" with launch = true needs the trainer on a GPU; it runs on {device}'
    return None


def export_weights(resolved: ResolvedFamily, directory: Path, lora_modules: frozenset[str] | None = None) -> Path:
    """Write the config and the weights in the published layout (`WeightPlan`: the family's checkpoint names and shapes,
    LoRA merged) to ``directory``.

    ``architectures`` names the model's own class, as transformers' ``save_pretrained`` of the unwrapped model writes
    it, whatever wraps the model now (FSDP2's generated subclass, ``torch.compile``, peft, DDP). ``lora_modules``: those
    modules' base weights unmerged (vLLM serves their adapters on top)."""

    directory.mkdir(parents=True, exist_ok=True)
    model = resolved.model
    config = copy.deepcopy(model.config)
    config.architectures = [model_class_name(model)]  # vLLM picks its implementation by this name
    config.save_pretrained(directory)
    plan = WeightPlan.from_resolved(resolved, include_frozen_vision=True, lora_modules=lora_modules)
    with torch.no_grad():
        tensors = {
            name: tensor.detach().to("cpu").contiguous()
            for name, tensor in plan.tensors()
            if not is_adapter_tensor(name)
        }
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    return directory


def export_checkpoint(
    resolved: ResolvedFamily, processor: Any, directory: Path, lora_modules: frozenset[str] | None = None
) -> Path:
    """Write what vLLM loads: the config and weights (`export_weights`), and the family's `engine_processor` (else
    the training processor)."""
    export_weights(resolved, directory, lora_modules)
    make = resolved.descriptor.engine_processor
    (make(processor) if make is not None else processor).save_pretrained(directory)
    return directory


def tensor_parallel_size(server_args: list[str]) -> int:
    """The ``--tensor-parallel-size`` (``-tp``) in vLLM's extra arguments, or 1."""
    for index, arg in enumerate(server_args):
        for flag in ("--tensor-parallel-size", "-tp"):
            if arg == flag and index + 1 < len(server_args):
                return int(server_args[index + 1])
            if arg.startswith(flag + "="):
                return int(arg.split("=", 1)[1])
    return 1


def default_fraction(rc: ResolvedConfig) -> float:
    """vLLM's share of its GPU when ``rollout.gpu_memory_fraction`` is unset: 0.3 beside the trainer, 0.9 alone."""
    return 0.3 if rc.config.rollout.launch_gpu == "same" else 0.9


def vllm_command(
    rc: ResolvedConfig,
    model: str,
    port: int,
    dtype: str,
    max_model_len: int,
    lora_args: Any = (),
    fraction: float | None = None,
) -> list[str]:
    """The command line that starts vLLM for training: the family's own ``vllm_args``, then ``server_args`` (last, so
    they may override); with a thinking budget, ``--reasoning-config`` names the family's markers, without which vLLM
    refuses ``thinking_token_budget``; ``lora_args``: vLLM's LoRA options for adapter syncs
    (`vlmreg.inference.vllm_adapters`); ``fraction``: vLLM's share of its GPU as worked out for the launch
    (`vlmreg.inference.vllm_room`), else ``rollout.gpu_memory_fraction`` or its default."""
    rollout = rc.config.rollout
    if fraction is None:
        fraction = rollout.gpu_memory_fraction or default_fraction(rc)
    reasoning = vllm_reasoning_config(rc.family) if rollout.thinking_budget is not None else None
    if rollout.thinking_budget is not None and reasoning is None:
        raise VlmregError(
            f"rollout.thinking_budget: family {rc.family.name} declares no thinking markers (thinking_start, "
            "thinking_end)"
        )
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--served-model-name",
        "vlmreg-policy",
        "--runner",
        "generate",
        "--worker-extension-cls",
        EXTENSION,
        "--middleware",
        AUTH_MIDDLEWARE,
        "--weight-transfer-config",
        json.dumps({"backend": "vlmreg"}),
        "--logprobs-mode",
        "processed_logprobs",
        "--generation-config",
        "vllm",
        "--gpu-memory-utilization",
        str(fraction),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
        "--seed",
        str(rc.config.model.seed),
        *(["--reasoning-config", reasoning] if reasoning else []),
        *lora_args,
        *rc.family.vllm_args,
        *rollout.server_args,
    ]
