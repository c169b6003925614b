"""The trainer's side of adapter syncs into vLLM: LoRA served by vLLM as runtime-loaded adapters, one per version.

With ``[model.lora]`` and ``[broadcast] lora_sync = "adapters"`` (``"auto"``, the default, merges for vLLM), a vLLM
launched by the trainer gets ``--enable-lora`` (``--max-lora-rank``: the smallest vLLM allows at or above ``r``;
``--max-loras 2``, ``--max-cpu-loras
3``), ``--enable-tower-connector-lora`` when the LoRA reaches the vision tower or a connector, and
``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``. Once it is up, each worker says which of the trainer's adapted modules it
serves as LoRA (`vlmreg.inference.vllm_lora.served_modules`: with the tower option, vLLM 0.24 serves the vision
tower and connector of a model whose vLLM class has ``get_num_mm_encoder_tokens``; without it, only the
language model's); those travel as adapters, the rest are merged into base weights, and the log says which.

Each sync: the transport carries the adapter factors (and any merged weights) to the workers, which stage them for
the version's directory (``OUTPUT/vllm-lora/vN``: only peft's ``adapter_config.json``, which gives vLLM the rank and
alpha; the factors never touch the disk); then ``/v1/load_lora_adapter`` loads that directory as a new adapter,
``vlmreg-lora-N`` (vLLM builds it from the staged tensors), the engine's requests name it from then on, and the version
before is unloaded (with rollouts collected ahead, the one before that: a request in flight may still name it) and its
directory removed. vLLM keeps up to 3 adapters (``--max-cpu-loras``) and never more than 2 are named, so it never
needs to read an unloaded version back. vLLM's prefix cache keys blocks by adapter, and requests carry the version's
cache salt too.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from vlmreg.broadcast.adapters import ModuleSplit, split_modules
from vlmreg.broadcast.plan import WeightPlan, lora_modules
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.errors import VlmregError

__all__ = ["LORA_RANKS", "VllmAdapters", "adapters_wanted"]

#: The ``--max-lora-rank`` values vLLM 0.24 accepts.
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
NAME = "vlmreg-lora"


def adapters_wanted(rc: ResolvedConfig, resolved: ResolvedFamily) -> bool:
    """Whether this run syncs LoRA to vLLM as adapters: LoRA on, ``lora_sync = "adapters"``, adapters not
    FSDP-sharded."""
    if rc.config.model.lora is None or rc.config.broadcast.lora_sync != "adapters":
        return False
    _, keepable = lora_modules(resolved)
    return bool(keepable) and not any(
        hasattr(m.layer.lora_A[m.adapter].weight, "full_tensor") for m in keepable.values()
    )


class VllmAdapters:
    """What a `vlmreg.inference.vllm_server.VllmServer` does for adapter syncs: launch arguments, the per-module split,
    and, after each sync's transfer, loading the new version and dropping the old."""

    def __init__(
        self,
        rc: ResolvedConfig,
        resolved: ResolvedFamily,
        log: Any,
        peft_model: Any = None,
        directory: Path | None = None,
    ) -> None:
        """``peft_model``: the peft wrapper, whose config each version's directory holds; ``directory``: where those
        go."""
        self.rc, self.resolved, self.log = rc, resolved, log
        self.peft_model, self.directory = peft_model, directory
        self.adapted, self.keepable = lora_modules(resolved)
        self.split: ModuleSplit | None = None
        self.loaded: list[tuple[str, Path]] = []  # (adapter name, directory) of the versions vLLM holds, oldest first
        self.versions = 0

    def server_args(self) -> list[str]:
        """vLLM's LoRA options for a launched server."""
        lora = self.rc.config.model.lora
        assert lora is not None
        rank = next((r for r in LORA_RANKS if r >= lora.r), None)
        if rank is None:
            raise VlmregError(
                f"model.lora.r = {lora.r}: vLLM serves LoRA up to rank {LORA_RANKS[-1]}; set broadcast.lora_sync = "
                '"merged"'
            )
        args = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "2", "--max-cpu-loras", "3"]
        d = self.resolved.descriptor
        roots = tuple(r for r in (d.vision_encoder_attr, *d.connector_attrs) if r)
        if any(name.startswith(tuple(root + "." for root in roots)) for name in self.keepable):
            args.append("--enable-tower-connector-lora")
        return args

    @staticmethod
    def server_env() -> dict[str, str]:
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}

    def choose(self, ask_workers: Any, where: str) -> frozenset[str] | None:
        """Ask every worker (``ask_workers(names) -> [answer per worker]``) which modules it serves as LoRA; the split
        (logged), and the modules that travel as adapters (``None``: vLLM serves none, all merged)."""
        answers = ask_workers(sorted(self.keepable))
        served = set(self.keepable)
        for answer in answers:
            served &= set(answer)  # tensor-parallel workers agree; several servers must all serve a module
        self.split = split_modules(self.adapted, self.keepable, sorted(served))
        self.log(self.split.summary(f"vLLM at {where}"))
        return self.split.adapters or None

    def step_sends_weights(self) -> bool:
        """Whether a step's sync carries base weights too (merged modules, trained non-LoRA weights)."""
        split = self.split.adapters if self.split is not None else None
        return bool(WeightPlan.from_resolved(self.resolved, include_frozen_vision=False, lora_modules=split).weights)

    def next_directory(self) -> Path:
        """The next version's directory, holding peft's ``adapter_config.json`` (the workers stage the factors for
        it)."""
        if self.peft_model is None or self.directory is None:
            raise VlmregError("adapter syncs into vLLM need the peft model and a directory for its adapter config")
        path = self.directory / f"v{self.versions + 1}"
        shutil.rmtree(path, ignore_errors=True)
        self.peft_model.peft_config[self.peft_model.active_adapter].save_pretrained(str(path))
        return path.resolve()

    def activate(self, adapter_dir: Path, post: Any, scope: Any, keep_previous: bool) -> str:
        """Load the adapter staged for ``adapter_dir`` as the next version, name it in ``scope`` (the engine's requests
        use it from now on), unload the versions no request can name any more; returns its name."""
        self.versions += 1
        name = f"{NAME}-{self.versions}"
        post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(adapter_dir)})
        scope.model = name
        self.loaded.append((name, adapter_dir))
        keep = 2 if keep_previous else 1
        while len(self.loaded) > keep:
            old, path = self.loaded.pop(0)
            post("/v1/unload_lora_adapter", {"lora_name": old})
            if self.directory is not None and path.parent == self.directory.resolve():
                shutil.rmtree(path, ignore_errors=True)
        return name


def worker_answers(results: Any) -> list[list[str]]:
    """The per-worker lists in a ``/collective_rpc`` answer of ``vlmreg_lora_modules``."""
    results = results.get("results") if isinstance(results, dict) else results
    if not isinstance(results, list):
        raise VlmregError(f"vlmreg_lora_modules: unexpected answer {results!r}")
    return [json.loads(r) if isinstance(r, str) else list(r) for r in results]
