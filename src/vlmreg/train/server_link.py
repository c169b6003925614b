"""Training against an inference server that runs apart: launching it, and keeping its weights current.

With ``[rollout] engine = "openai"`` the trainer samples from an OpenAI-compatible server: ``vlmreg serve``
(below), or vLLM (``server = "vllm"``: `vlmreg.train.vllm_server`). ``launch = true`` starts the server as a
separate process (``vlmreg serve`` on the trainer's own config). After every optimizer step (and once before the first rollouts, frozen
vision tower included) the new weights go to the server over ``[broadcast] transport``, a registered `vlmreg.Transport`
whose sender (`vlmreg.broadcast.senders`) this link drives; nothing here names a transport:

- ``gloo`` / ``nccl``: the trainer's `Sender` broadcasts buckets over a private process group the server joined
  at start (``vlmreg serve --weights-from HOST:PORT``), while ``POST /v1/weights`` asks the server to receive them;
- ``filesystem``: the trainer writes an atomic weights directory and ``POST /v1/weights`` names it;
- a plugin's transport: its sender says what a launched server needs (``server_args``) and what each request carries.

Either way the server answers once the weights are applied (between its batches), and only then does the
trainer sample again, so every rollout comes from the policy being trained. A server that dies or stalls is
an error naming it within ``[broadcast] timeout_s``. With LoRA the server gets the merged weights, and peft's adapter
files of every synced step are also written to ``OUTPUT/adapters/step_NNNNNN/adapter`` (the newest two kept).

A launched ``vlmreg serve`` gets a fresh random API key (``OUTPUT/server.key``, mode 0600, passed as
``--api-key-file``), which the trainer sends on its own requests (`api_key`); an attached server's key is taken
from the environment variable ``VLMREG_API_KEY`` when set.
"""

from __future__ import annotations

import os
import secrets
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from vlmreg.broadcast import BroadcastError, FilesystemSender, SyncStats, WeightPlan
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.config.toml_out import to_toml
from vlmreg.resolution import ResolvedFamily
from vlmreg.rollout.openai_client import base_url
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.registry import get_transport_registry
from vlmreg.sdk.transport import NO_TRANSPORT, SenderContext
from vlmreg.serve.auth import API_KEY_ENV
from vlmreg.train.distributed import Distributed, server_environment, server_gpus
from vlmreg.train.http import alongside, free_port, post_json, wait_healthy

__all__ = ["ServerLink"]


class ServerLink:
    """The trainer's side of a rollout server: its process (when launched), its URL and weight syncs."""

    def __init__(
        self, rc: ResolvedConfig, resolved: ResolvedFamily, device: Any, output_dir: Path, log: Any, ctx: Distributed | None = None,
        processor: Any = None, peft_model: Any = None,
    ) -> None:
        """``processor``: the trainer's (an exported checkpoint for vLLM carries it); ``peft_model``: the peft wrapper
        when LoRA is on, whose adapter files are written per synced step."""
        self.rc, self.resolved, self.device, self.output_dir, self.log = rc, resolved, device, output_dir, log
        rollout, broadcast = rc.config.rollout, rc.config.broadcast
        self.transport, self.timeout_s = broadcast.transport, broadcast.timeout_s
        self.process: subprocess.Popen | None = None
        self.sender: Any = None  # the transport's sender (`vlmreg.broadcast.senders` describes its methods)
        self.history: list[SyncStats] = []
        self.step_synced: int | None = None
        self.ctx = ctx
        self.vllm_server: Any = None
        self.cache_scope: Any = None  # a vLLM server's `CacheScope`, for the engine's requests
        self.adapters: FilesystemSender | None = None
        self.url = base_url(rollout.url) if rollout.url else rollout.url  # a URL ending in /v1 still finds /collective_rpc
        self.api_key: str | None = os.environ.get(API_KEY_ENV) or None  # an attached server's key; a launched one gets its own
        if ctx is not None and not ctx.is_main:
            # FSDP: other ranks only help gather the shards rank 0 sends; rank 0 tells them the server's URL and key
            self.plans = {kind: WeightPlan.from_resolved(resolved, include_frozen_vision=kind == "full") for kind in ("full", "step")}
            if rollout.server == "vllm" and rollout.launch:
                from vlmreg.train.vllm_server import exports_weights

                if exports_weights(rc):  # rank 0 writes vLLM's initial checkpoint: take part in gathering every shard
                    for _ in self.plans["full"].tensors():
                        pass
            self.url, self.api_key = ctx.gather_objects(None)[0]
            return
        if rollout.server == "vllm":
            from vlmreg.train.vllm_server import VllmServer

            self.vllm_server = VllmServer(rc, resolved, processor, device, output_dir, log)
            self.url, self.api_key = self.vllm_server.url, self.vllm_server.api_key
            self.history = self.vllm_server.history
            self.cache_scope = self.vllm_server.cache_scope
        elif self.transport != NO_TRANSPORT:
            spec = get_transport_registry().get(self.transport)
            self.sender = spec.sender(
                SenderContext(name=spec.name, resolved=resolved, device=device, broadcast=broadcast, output_dir=output_dir, url=self.url, log=log)
            )
        # LoRA: the server gets merged weights; peft's adapter files are also written per step, for engines that load them
        if peft_model is not None:
            self.adapters = FilesystemSender(output_dir / "adapters", resolved, peft_model=peft_model, adapter=True, merged=False)
        if self.vllm_server is None and rollout.launch:
            self.url = self._launch()
        elif self.vllm_server is None and self.sender is not None:
            self.sender.connect(self.timeout_s, launched=False)
        if ctx is not None:
            ctx.gather_objects((self.url, self.api_key))

    # -- the server process ------------------------------------------------------------------
    def _launch(self) -> str:
        self.output_dir.mkdir(parents=True, exist_ok=True)
        config = Path(tempfile.mkstemp(prefix="vlmreg-serve-", suffix=".toml", dir=self.output_dir)[1])
        config.write_text(to_toml(self.rc.config))
        port = free_port()
        self.api_key = secrets.token_urlsafe(32)  # only this trainer may use (and replace the weights of) its server
        key_file = self.output_dir / "server.key"
        fd, temporary = tempfile.mkstemp(prefix=".server-key-", dir=self.output_dir)  # created with mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(self.api_key + "\n")
        os.replace(temporary, key_file)
        command = [sys.executable, "-m", "vlmreg", "serve", str(config), "--host", "127.0.0.1", "--port", str(port),
                   "--api-key-file", str(key_file)]
        server_env: dict[str, str] = {}
        if self.sender is not None:  # what the server needs to take this transport's syncs
            server_argv, server_env = self.sender.server_args()
            command += list(server_argv)
        env = server_environment()
        if self.device.type == "cuda":  # the server gets the GPU after the trainer's (all of its ranks')
            env["CUDA_VISIBLE_DEVICES"] = server_gpus(self.device, "next")
        env.pop(API_KEY_ENV, None)  # the key file is the launched server's key
        env.update(server_env)  # secrets (a weight group's token) go in the environment, not on ps
        self.log_path = self.output_dir / "server.log"
        self.process = subprocess.Popen(command, stdout=self.log_path.open("w"), stderr=subprocess.STDOUT, env=env)
        url = f"http://127.0.0.1:{port}"
        self.log(f"launched vlmreg serve (pid {self.process.pid}) at {url}; its log: {self.log_path}")
        if self.sender is not None:
            try:
                self.sender.connect(self.timeout_s, launched=True)
            except BroadcastError as exc:
                self.check_alive()
                raise VlmregError(f"the launched server did not join the weight group: {exc}") from None
        try:
            wait_healthy(url, timeout_s=self.timeout_s, check_alive=self.check_alive, interval_s=0.2, api_key=self.api_key)
        except TimeoutError:
            raise VlmregError(f"the launched server at {url} was not ready within {self.timeout_s} s; see {self.log_path}") from None
        return url

    def check_alive(self) -> None:
        if self.vllm_server is not None:
            self.vllm_server.check_alive()
        if self.process is not None and self.process.poll() is not None:
            tail = self.log_path.read_text().strip().splitlines()[-3:] if self.log_path.exists() else []
            raise VlmregError(
                f"the rollout server (pid {self.process.pid}) exited with code {self.process.returncode}"
                + (f": {' | '.join(tail)}" if tail else "") + f" (log: {self.log_path})"
            )

    # -- weight syncs ---------------------------------------------------------------------------
    def sync(self, step: int, *, full: bool = False) -> None:
        """Send the current weights and return once the server has applied them (every trainer rank calls it)."""
        if self.transport == NO_TRANSPORT:
            return
        if self.ctx is not None and not self.ctx.is_main:
            for _ in self.plans["full" if full else "step"].tensors():  # take part in gathering every shard
                pass
            self.ctx.gather_objects(None)  # wait until rank 0 has the server's confirmation
            return
        self._sync(step, full=full)
        if self.ctx is not None:
            self.ctx.gather_objects(None)

    def _sync(self, step: int, *, full: bool) -> None:
        if self.adapters is not None and not (self.adapters.directory / f"step_{step:06d}").exists():
            self.adapters.write(step)
        if self.vllm_server is not None:
            self.vllm_server.sync(step, full=full)
            self.step_synced = step
            return
        self.check_alive()
        endpoint = f"{self.url}/v1/weights"

        def request(fields: dict[str, Any], transfer: Any = None) -> Any:
            """POST ``{"step": step, **fields}``; with ``transfer``, run it meanwhile (a collective the server joins)."""
            body = {"step": step, **fields}
            if transfer is None:
                return post_json(endpoint, body, self.timeout_s, api_key=self.api_key)
            return alongside(lambda: post_json(endpoint, body, self.timeout_s + 30, api_key=self.api_key), transfer,
                             what=f"take the weights of step {step}", url=str(self.url), timeout_s=self.timeout_s, check_alive=self.check_alive)

        assert self.sender is not None
        stats = self.sender.send(step, full=full, request=request)
        if stats is not None:
            self.history.append(stats)
        self.step_synced = step

    def close(self) -> None:
        if self.vllm_server is not None:
            self.vllm_server.close()
        if self.sender is not None:
            try:
                self.sender.close()
            except BroadcastError:
                pass
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
        if self.process is not None:  # the launched server's key is of no use once it is gone
            (self.output_dir / "server.key").unlink(missing_ok=True)
