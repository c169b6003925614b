"""Pushed syncs into a launched vLLM: the trainer writes into vLLM's weights itself, with no request per sync.

Pushed syncs (``transport = "ipc"``, ``vllm_load = "direct"``, ``vllm_push = true``, a vLLM launched here with one
worker): once the worker has recorded how its ``load_weights`` takes a layout of tensors (a copy plan, from the
third sync of that layout), it exports the plan with its weights' CUDA IPC handles, and the trainer replays it
itself, writing into vLLM's weights with no request at all (`vlmreg.broadcast.copy_plan.PushedPlan`). That is safe
only while vLLM runs no forward pass: the trainer's syncs never overlap its rollouts, and a launched server has no
other client. A sync whose tensors moved (the plan's sources are no longer the parameters) goes through vLLM again.

The state lives on the `vlmreg.inference.vllm_server.VllmServer` (``server``): ``push`` (whether its syncs may be
pushed), ``pushed`` (the `PushedPlan` of the layout the syncs now have), ``push_asks``, ``push_refused`` and
``pushes``; these functions read its ``device``, ``sender``, ``url``, ``log`` and ``_rpc``.
"""

from __future__ import annotations

import json
from typing import Any

import torch

from vlmreg.broadcast import (
    BroadcastError,
    ipc,  # ipc.gpu_uuid, ipc.open_tensor: looked up at each call, as tests replace them
)
from vlmreg.broadcast.copy_plan import PlanRefused, PushedPlan

__all__ = ["PUSH_ASKS", "adopt_plan", "push_sync", "pushes_wanted", "refuse_push"]

#: Syncs after which a worker that still has no copy plan to export is not asked again (its layout moves each sync).
PUSH_ASKS = 4


def pushes_wanted(rollout: Any, broadcast: Any, count: int) -> bool:
    """Whether a run's syncs may be pushed (``rollout`` and ``broadcast``: its config sections; ``count``: its vLLM
    servers): asked for, into one vLLM launched here, through CUDA IPC with direct loads."""
    return bool(
        broadcast.vllm_push
        and rollout.launch
        and broadcast.transport == "ipc"
        and broadcast.vllm_load == "direct"
        and count == 1
    )


def adopt_plan(server: Any, step: int, message: dict[str, Any]) -> None:
    """Ask the worker for the copy plan of the sync just made; keep it to push later syncs of the same layout."""

    answers = server._rpc(server.url, "vlmreg_export_copy_plan", [step])
    # vLLM answers {"results": [one a worker]}
    answers = answers.get("results") if isinstance(answers, dict) else answers
    if not isinstance(answers, list) or len(answers) != 1:
        return refuse_push(
            server,
            f"{len(answers) if isinstance(answers, list) else 'an unknown number of'} workers (pushed syncs need one)",
        )
    answer = json.loads(answers[0]) if isinstance(answers[0], str) else {}
    plan = answer.get("plan")
    if plan is None:
        server.push_asks += 1
        if answer.get("final") or server.push_asks > PUSH_ASKS:
            refuse_push(server, str(answer.get("reason")))
        return  # not recorded yet: asked again after the next sync
    device = server.device
    index = device.index if device.index is not None or device.type != "cuda" else torch.cuda.current_device()
    try:
        if plan.get("gpu") != ipc.gpu_uuid(device):
            raise PlanRefused("vLLM's worker is on another GPU")
        server.pushed = PushedPlan(
            plan,
            server.sender.ipc.hold,
            lambda entry: ipc.open_tensor(entry, index, what="vLLM weight")[0],
            layout=message.get("id") or message.get("reuse"),
        )
    except (PlanRefused, BroadcastError, RuntimeError) as exc:
        return refuse_push(server, str(exc))
    server.log(
        f"vLLM at {server.url}: later syncs are pushed into its weights ({len(server.pushed.copies)} copies, "
        f"{server.pushed.bytes / 1e9:.2f} GB, no request per sync)"
    )


def refuse_push(server: Any, reason: str) -> None:
    """No pushed syncs for this run: every sync goes through vLLM."""
    server.push_refused = reason
    server.log(f"vLLM at {server.url}: syncs are not pushed: {reason}")


def push_sync(server: Any, step: int) -> bool:
    """Replay the worker's plan into vLLM's weights from here; ``False`` (and the plan dropped) when this sync's
    tensors are not where the plan reads: the caller then syncs through vLLM, which rewrites every weight."""

    server.pushed.replay()  # queued behind the optimizer's writes on this stream; checked while the GPU copies
    unchanged = server.sender.ipc.unchanged() == server.pushed.layout
    if server.device.type == "cuda":
        torch.cuda.current_stream(server.device).synchronize()  # vLLM's next forward reads finished weights
    if not unchanged:
        server.log(f"step {step}: the weights moved since vLLM's copy plan was made; syncing through vLLM")
        server.pushed, server.push_asks = None, 0
        return False
    server.pushes += 1
    return True
