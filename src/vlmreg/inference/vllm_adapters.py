"""The trainer's side of adapter syncs into vLLM: LoRA served by vLLM as a runtime-loaded adapter.

With ``[model.lora]`` and ``[broadcast] lora_sync = "adapters"`` (or ``"auto"``, the default), a vLLM
launched by the trainer gets ``--enable-lora`` (``--max-lora-rank``: the smallest vLLM allows at or above ``r``;
``--max-loras 1``, ``--max-cpu-loras 2``), ``--enable-tower-connector-lora`` when the LoRA reaches the vision tower or
a connector, and ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``. Once it is up, each worker says which of the trainer's
adapted modules it serves as LoRA (`vlmreg.inference.vllm_lora.served_modules`: with the tower option, vLLM 0.24
serves the vision tower and connector of a model whose vLLM class has ``get_num_mm_encoder_tokens``; without it,
only the language model's), and whether it keeps the adapter live; those modules travel as adapters, the rest are
merged into base weights, and the log says which.

Each sync, the transport carries the adapter factors (and any merged weights) to the workers. Live (the default):
the first sync's factors are staged in each worker's GPU buffer and ``/v1/load_lora_adapter`` loads them once as
``vlmreg-lora`` (peft's ``adapter_config.json`` in ``OUTPUT/vllm-lora/v1`` gives vLLM the rank and alpha; the factors
never touch the disk); every later sync rewrites that adapter in place inside the workers
(`vlmreg.inference.vllm_lora_live`), with no request beyond the transfer's own. Versioned (``VLMREG_LORA_LIVE=0`` in
vLLM's environment): each sync's factors are staged for a new directory, loaded as ``vlmreg-lora-N`` and the version
before unloaded. The engine's requests name the adapter as their model; the trainer's syncs exclude rollouts, so no
request is in flight while a version changes, and each version's requests carry its own cache salt (and image uuids
when the image side changes): nothing cached under an older version is reused.
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
    """Whether this run syncs LoRA to vLLM as adapters: LoRA on, ``lora_sync`` ``"adapters"`` or ``"auto"`` (the
    default: on 4 x H200 the live adapter's syncs moved 25-99x fewer bytes with the same ``mismatch_kl``,
    BENCHMARKS.md), adapters not FSDP-sharded."""
    if rc.config.model.lora is None or rc.config.broadcast.lora_sync == "merged":
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
        self.live = False  # every worker keeps the adapter live (`choose`)
        self.sends_weights = True  # a step's sync carries base weights too (merged modules, trained non-LoRA weights)
        self.pending: Path | None = None  # the directory this sync's factors are staged for, to load after it

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
        # one adapter in a GPU slot at a time (a new version replaces the old); two known while one replaces the other
        args = ["--enable-lora", "--max-lora-rank", str(rank), "--max-loras", "1", "--max-cpu-loras", "2"]
        d = self.resolved.descriptor
        roots = tuple(r for r in (d.vision_encoder_attr, *d.connector_attrs) if r)
        if any(name.startswith(tuple(root + "." for root in roots)) for name in self.keepable):
            args.append("--enable-tower-connector-lora")
        return args

    @staticmethod
    def server_env() -> dict[str, str]:
        return {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "1"}

    def choose(self, ask_workers: Any, where: str) -> frozenset[str] | None:
        """Ask every worker (``ask_workers(names) -> [(served names, keeps live) per worker]``) which modules it serves
        as LoRA; the split (logged), and the modules that travel as adapters (``None``: vLLM serves none, all
        merged)."""
        answers = ask_workers(sorted(self.keepable))
        served = set(self.keepable)
        self.live = bool(answers)
        for names, live in answers:
            served &= set(names)  # tensor-parallel workers agree; several servers must all serve a module
            self.live = self.live and live
        self.split = split_modules(self.adapted, self.keepable, sorted(served))
        self.log(self.split.summary(f"vLLM at {where}"))
        if self.split.adapters:
            plan = WeightPlan.from_resolved(
                self.resolved, include_frozen_vision=False, lora_modules=self.split.adapters
            )
            self.sends_weights = bool(plan.weights)
            how = "kept live, rewritten in place each sync" if self.live else "loaded as a new adapter each sync"
            self.log(f"LoRA adapter in vLLM at {where}: {how}")
        return self.split.adapters or None

    def next_directory(self) -> Path:
        """The next version's directory, holding peft's ``adapter_config.json`` (the workers stage the factors for
        it)."""
        if self.peft_model is None or self.directory is None:
            raise VlmregError("adapter syncs into vLLM need the peft model and a directory for its adapter config")
        path = self.directory / f"v{self.versions + 1}"
        shutil.rmtree(path, ignore_errors=True)
        self.peft_model.peft_config[self.peft_model.active_adapter].save_pretrained(str(path))
        return path.resolve()

    def request_fields(self) -> dict[str, str]:
        """What this sync's request tells the workers about the factors: the adapter's directory and ``lora_mode``
        (`vlmreg.inference.vllm_lora.take_adapter`)."""
        if self.live and self.loaded:
            self.pending = None
            return {"lora_path": str(self.loaded[-1][1]), "lora_mode": "update"}
        self.pending = self.next_directory()
        return {"lora_path": str(self.pending), **({"lora_mode": "live"} if self.live else {})}

    def finish(self, post: Any, scope: Any) -> str:
        """After the transfer: load what the workers staged as the next adapter (live: once), name it in ``scope``
        (the engine's requests use it from now on), unload the one before; returns the name requests use."""
        self.versions += 1
        if self.pending is None:
            return self.loaded[-1][0]  # rewritten in place
        path, self.pending = self.pending, None
        name = NAME if self.live else f"{NAME}-{self.versions}"
        post("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        scope.model = name
        self.loaded.append((name, path))
        while len(self.loaded) > 1:  # no request is in flight during a sync: the version before goes now
            old, old_path = self.loaded.pop(0)
            post("/v1/unload_lora_adapter", {"lora_name": old})
            if self.directory is not None and old_path.parent == self.directory.resolve():
                shutil.rmtree(old_path, ignore_errors=True)
        return name


def worker_answers(results: Any) -> list[tuple[list[str], bool]]:
    """Per worker, from a ``/collective_rpc`` answer of ``vlmreg_lora_modules``: the modules it serves as LoRA, and
    whether it keeps the adapter live (a bare list: an older worker, which does not)."""
    results = results.get("results") if isinstance(results, dict) else results
    if not isinstance(results, list):
        raise VlmregError(f"vlmreg_lora_modules: unexpected answer {results!r}")
    answers = []
    for result in results:
        answer = json.loads(result) if isinstance(result, str) else result
        if isinstance(answer, dict):
            answers.append((list(answer.get("served") or []), bool(answer.get("live"))))
        elif isinstance(answer, list):
            answers.append((list(answer), False))
        else:
            raise VlmregError(f"vlmreg_lora_modules: unexpected answer {answer!r}")
    return answers
