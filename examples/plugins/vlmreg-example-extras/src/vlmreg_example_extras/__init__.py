"""A third-party vlmreg plugin registering an objective, two rewards, a rollout engine and a weight transport, exactly
as vlmreg's built-ins do.

- objective ``reinforce``: plain REINFORCE with TIS weights, per-token terms ``l_t = - w_t * A_i * logp_t`` reduced by
  the run's loss aggregation (its default: the token mean, ``L = sum_t l_t / (loss tokens in the step)``; ``[trainer]
  loss_aggregation`` picks another, and the KL term follows it); nothing is clipped;
- reward ``one_word``: 1.0 when the answer is a single word, else 0.0 (synchronous);
- reward ``slow_exact_match``: ``exact_match`` computed by an ``async def`` (as one that calls a reward-model server
  would be), with a 5 s timeout;
- rollout engine ``logged_openai``: vlmreg's OpenAI-compatible client (the registered ``openai`` engine), logging each
batch it sends (conversations,
  completion tokens, seconds) to ``OUTPUT/rollout_calls.jsonl``; a server engine, so the trainer launches or attaches
  to ``vlmreg serve`` and keeps its weights current;
- transport ``one_file``: each sync is one safetensors file, ``DIR/step_NNNNNN.safetensors`` (written under a
  temporary name, then renamed), named in ``POST /v1/weights {"step": N, "file": PATH}``; its receiver in ``vlmreg
  serve`` (``--weights-transport one_file --weights-option directory=DIR``) reads only files in ``DIR``. It has a
  vLLM end too (``vllm_receiver``): each vLLM worker is told ``DIR`` once and reads each sync's file from it (trainer
  and vLLM on one machine, or a shared file system), so ``rollout.server = "vllm"`` takes it as well.

``VLMREG_EXTRAS_TRACE=FILE`` appends one line per call of each (``objective``, ``one_word``, ``slow_exact_match``,
``engine``, ``sender``, ``receiver``, ``worker``), to see that they ran. Nothing here imports torch at import time,
and everything it needs from vlmreg comes from ``vlmreg`` and ``vlmreg.sdk``, the public modules.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time
import uuid
from pathlib import Path
from typing import Any

from vlmreg import Engine, Objective, Reward, Transport, get_engine_registry, hookimpl
from vlmreg.sdk import EngineContext, LossInputs, RequestError, aggregate

__version__ = "0.1.0"


def _trace(what: str) -> None:
    path = os.environ.get("VLMREG_EXTRAS_TRACE")
    if path:
        with open(path, "a", encoding="utf-8") as f:
            f.write(what + "\n")


def reinforce(x: LossInputs) -> tuple[Any, Any]:
    """``x`` holds one micro-batch's loss tokens; ``aggregate`` normalises its terms by the whole step, as
    ``x.aggregation`` says."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    _trace("objective")
    terms = -x.weights * x.advantages * x.logp
    return aggregate(terms, x), torch.zeros_like(x.logp, dtype=torch.bool)


def one_word(completion: str, answer: str) -> float:
    _trace("one_word")
    return 1.0 if len(completion.split()) == 1 else 0.0


async def slow_exact_match(completion: str, answer: str) -> float:
    _trace("slow_exact_match")
    await asyncio.sleep(0.001)  # where a reward-model call would await
    return 1.0 if completion.strip().rstrip(".").lower() == str(answer).strip().lower() else 0.0


@hookimpl
def vlmreg_register_objectives(register):
    register(
        Objective(
            name="reinforce",
            loss=reinforce,
            clip=(0.2, 0.28),
            aggregation="token-mean",
            description="REINFORCE with TIS, no clip; token mean by default",
        )
    )


@hookimpl
def vlmreg_register_rewards(register):
    register(Reward(name="one_word", fn=one_word, description="1 for a one-word answer"))
    register(Reward(name="slow_exact_match", fn=slow_exact_match, description="exact_match, async", timeout_s=5.0))


# -- a rollout engine: vlmreg's OpenAI client, with a log of every batch
# ------------------------------------------------
class LoggedEngine:
    """Delegates to an engine and appends one JSON line per ``chat`` call to ``log_path``."""

    def __init__(self, engine: Any, log_path: Path) -> None:
        self.engine, self.log_path = engine, log_path

    def chat(self, conversations: Any, params: Any, template_kwargs: Any = None, names: Any = None) -> Any:
        _trace("engine")
        started = time.perf_counter()
        turns = self.engine.chat(conversations, params, template_kwargs=template_kwargs, names=names)
        record = {
            "conversations": len(conversations),
            "completion_tokens": sum(len(t.completion.token_ids) for t in turns),
            "seconds": round(time.perf_counter() - started, 4),
        }
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        return turns

    def __getattr__(self, name: str) -> Any:  # encoder, prompts, close, ...: the wrapped engine's
        return getattr(self.engine, name)


def build_logged_openai(ctx: EngineContext) -> LoggedEngine:
    """The registered ``openai`` engine, built from the same context (a server engine's has the server's ``url`` and
    ``api_key``), wrapped."""
    engine = get_engine_registry().get("openai").build(ctx)
    return LoggedEngine(engine, Path(ctx.output_dir) / "rollout_calls.jsonl")


# -- a weight transport: one safetensors file per sync
# ------------------------------------------------------------------
_FILE = re.compile(r"^step_\d{6}\.safetensors$")


class OneFileSender:
    """Trainer side: writes the sync's tensors (checkpoint names) to one file and names it in the request."""

    def __init__(self, ctx: Any) -> None:
        # deferred: imports torch: here, when a run builds the sender
        from vlmreg import WeightPlan  # noqa: PLC0415

        self.directory = Path(ctx.broadcast.directory) if ctx.broadcast.directory else Path(ctx.output_dir) / "one_file"
        self.plans = {
            full: WeightPlan.from_resolved(ctx.resolved, include_frozen_vision=full) for full in (True, False)
        }
        self.sent = 0

    def server_args(self) -> tuple[list[str], dict[str, str]]:
        return ["--weights-transport", "one_file", "--weights-option", f"directory={self.directory}"], {}

    def worker_info(self) -> dict[str, Any]:
        return {"directory": str(self.directory)}  # vLLM's workers: where every sync's file will be

    def connect(self, timeout_s: float, *, launched: bool) -> None:
        """Nothing to join: each request names its file."""

    def send(self, step: int, *, full: bool, request: Any) -> None:
        # deferred: start-up cost (loads safetensors)
        from safetensors.torch import save_file  # noqa: PLC0415

        _trace("sender")
        self.directory.mkdir(parents=True, exist_ok=True)
        final = self.directory / f"step_{step:06d}.safetensors"
        partial = self.directory / f".{final.name}.{uuid.uuid4().hex[:8]}"
        tensors = {
            name: t.detach().to("cpu", copy=True).contiguous()
            for name, t in self.plans[full or self.sent == 0].tensors()
        }
        save_file(tensors, str(partial), metadata={"format": "pt", "step": str(step)})
        os.replace(partial, final)  # a reader never sees half a file
        request({"file": str(final)})
        self.sent += 1
        for old in sorted(self.directory.glob("step_*.safetensors"))[:-2]:  # keep the newest two
            old.unlink(missing_ok=True)

    def close(self) -> None:
        """Nothing to release."""


def _allowed(file: Any, directory: Path) -> Path | None:
    """The sync file ``file`` names, or ``None`` when it is not a ``step_NNNNNN.safetensors`` file in ``directory``."""
    path = Path(str(file)).resolve()
    return path if path.parent == directory and _FILE.match(path.name) else None


class OneFileReceiver:
    """Server side: takes ``{"step": N, "file": PATH}`` and reads the file, only from its directory."""

    fields = ("file",)

    def __init__(self, ctx: Any) -> None:
        if "directory" not in ctx.options:
            raise ValueError("transport one_file: its receiver needs --weights-option directory=DIR")
        self.directory, self.device = Path(ctx.options["directory"]).resolve(), ctx.loaded.device

    def receive(self, timeout_s: float | None = None, *, file: Any) -> dict[str, Any]:
        # deferred: start-up cost (loads safetensors)
        from safetensors.torch import load_file  # noqa: PLC0415

        _trace("receiver")
        path = _allowed(file, self.directory)
        if path is None:
            raise RequestError(
                "file",
                f"{file!r} is not a step_NNNNNN.safetensors file in {str(self.directory)!r}",
                status=403,
                kind="permission_error",
                code="path_not_allowed",
            )
        if not path.is_file():
            raise RequestError("file", f"{file!r} does not exist", status=409)
        return load_file(str(path), device=str(self.device))


class OneFileWorkerReceiver:
    """vLLM side, in each worker: reads each sync's file from the directory the trainer named when it joined, onto
    the worker's device; vLLM's ``load_weights`` keeps the worker's shard."""

    def __init__(self, ctx: Any) -> None:
        if "directory" not in ctx.info:
            raise ValueError("transport one_file: the trainer named no directory for vLLM's workers")
        self.directory = Path(ctx.info["directory"]).resolve()
        self.device = str(ctx.device) if ctx.device is not None else "cpu"

    def receive(self, *, step: int, timeout_s: float | None = None, file: Any = None) -> list[tuple[str, Any]]:
        # deferred: start-up cost (loads safetensors)
        from safetensors.torch import load_file  # noqa: PLC0415

        _trace("worker")
        path = _allowed(file, self.directory)
        if path is None:
            raise ValueError(
                f"transport one_file: {file!r} is not a step_NNNNNN.safetensors file in {str(self.directory)!r}"
            )
        return list(load_file(str(path), device=self.device).items())

    def close(self) -> None:
        """Nothing to release."""


@hookimpl
def vlmreg_register_rollout_engines(register):
    register(
        Engine(
            name="logged_openai",
            build=build_logged_openai,
            server=True,
            description="vlmreg's OpenAI client, logging each batch to OUTPUT/rollout_calls.jsonl",
        )
    )


@hookimpl
def vlmreg_register_transports(register):
    register(
        Transport(
            name="one_file",
            sender=OneFileSender,
            receiver=OneFileReceiver,
            vllm_receiver=OneFileWorkerReceiver,
            description="one safetensors file per sync, named in the request (vlmreg serve or vLLM)",
        )
    )
