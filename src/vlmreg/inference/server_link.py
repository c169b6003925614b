"""Training against an inference server that runs apart: launching it, and keeping its weights current.

With ``[rollout] engine = "openai"`` the trainer samples from an OpenAI-compatible server: ``vlmreg serve``
(below), or vLLM (``server = "vllm"``: `vlmreg.inference.vllm_server`). ``launch = true`` starts the server as a
separate process (``vlmreg serve`` on the trainer's own config). After every optimizer step (and once before the first
rollouts, frozen vision tower included) the new weights go to the server over ``[broadcast] transport``, a registered
`vlmreg.Transport`
whose sender (`vlmreg.broadcast.senders`) this link drives; nothing here names a transport:

- ``gloo`` / ``nccl``: the trainer's `Sender` broadcasts buckets over a private process group the server joined
  at start (``vlmreg serve --weights-from HOST:PORT``), while ``POST /v1/weights`` asks the server to receive them;
- ``filesystem``: the trainer writes an atomic weights directory and ``POST /v1/weights`` names it;
- a plugin's transport: its sender says what a launched server needs (``server_args``) and what each request carries.

Either way the server answers once the weights are applied (between its batches), and only then does the
trainer sample again, so every rollout comes from the policy being trained. A server that dies or stalls is
an error naming it within ``[broadcast] timeout_s``. With LoRA (``[broadcast] lora_sync = "adapters"``, or ``"auto"``,
the default, for `vlmreg serve`) each sync sends the adapters of every module the server serves as LoRA (a launched
``vlmreg serve`` keeps the run's
LoRA; an attached one says which modules it serves in its ``/v1/models`` card) and merges only the rest into base
weights, one line in the log saying which (`vlmreg.broadcast.adapters`); a server that serves no LoRA, FSDP-sharded
LoRA, or ``lora_sync = "merged"`` get every adapter merged. peft's adapter files of every synced step are also
written to ``OUTPUT/adapters/step_NNNNNN/adapter`` (the newest two kept).

Several servers (``[rollout] servers = N`` launched, or a list of attached ``url``s): server ``k`` joins the weight
group as rank ``k + 1`` (``--weights-rank``), so one broadcast reaches them all, and each sync's request goes to every
server at once; a filesystem sync names one directory to all of them. Under torchrun, rank 0 drives the servers and
tells the other ranks how starting them and each sync went: a failure ends every rank with rank 0's error, never a
rank waiting on a collective that will not come.

A launched ``vlmreg serve`` gets a fresh random API key (``OUTPUT/server.key``, mode 0600, passed as
``--api-key-file``), which the trainer sends on its own requests (`api_key`); an attached server's key is taken
from the environment variable ``VLMREG_API_KEY`` when set.
"""

from __future__ import annotations

import os
import secrets
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Protocol

from vlmreg.broadcast import BroadcastError, FilesystemSender, SyncStats, WeightPlan
from vlmreg.broadcast.adapters import split_modules
from vlmreg.broadcast.plan import lora_modules
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.config.toml_out import to_toml
from vlmreg.http.auth import API_KEY_ENV
from vlmreg.http.client import get_json, post_json
from vlmreg.inference.calls import (
    alongside,
    check_request_in_flight,
    free_port,
    join_while_alive,
    on_every_server,
    wait_healthy,
)
from vlmreg.inference.openai_client import base_url
from vlmreg.inference.server_process import ServerProcess, server_environment, server_gpus
from vlmreg.inference.vllm_server import VllmServer, exports_weights, launch_problem
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.transport import NO_TRANSPORT, SenderContext

__all__ = ["Ranks", "ServerLink"]


class Ranks(Protocol):
    """What the link needs of the trainer's process group under torchrun (`vlmreg.train.distributed.Distributed`):
    whether this process is rank 0, how many ranks there are, and an all-gather of small objects."""

    @property
    def is_main(self) -> bool: ...

    world: int

    def gather_objects(self, value: Any) -> list[Any]: ...


class ServerLink:
    """The trainer's side of its rollout servers: their processes (when launched), URLs and weight syncs."""

    def __init__(
        self,
        rc: ResolvedConfig,
        resolved: ResolvedFamily,
        device: Any,
        output_dir: Path,
        log: Any,
        ctx: Ranks | None = None,
        processor: Any = None,
        peft_model: Any = None,
    ) -> None:
        """``processor``: the trainer's (an exported checkpoint for vLLM carries it); ``peft_model``: the peft wrapper
        when LoRA is on, whose adapter files are written per synced step."""
        self.rc, self.resolved, self.device, self.output_dir, self.log = rc, resolved, device, output_dir, log
        rollout, broadcast = rc.config.rollout, rc.config.broadcast
        self.transport, self.timeout_s = broadcast.transport, broadcast.timeout_s
        self.processes: list[ServerProcess] = []
        self.sender: Any = None  # the transport's sender (`vlmreg.broadcast.senders` describes its methods)
        self.history: list[SyncStats] = []
        self.step_synced: int | None = None
        self.ctx = ctx
        self.vllm_server: Any = None
        self.cache_scope: Any = None  # a vLLM server's `CacheScope`, for the engine's requests
        self.adapters: FilesystemSender | None = None
        self.lora_split: Any = None  # `vlmreg.broadcast.adapters.ModuleSplit` of adapter syncs
        self.adapter_files_s = 0.0  # the time the last sync's peft adapter files took to write (after the sync itself)
        self.count = rollout.server_count
        self.urls = [base_url(u) for u in rollout.urls]  # a URL ending in /v1 still finds /collective_rpc
        # an attached server's key; a launched one gets its own
        self.api_key: str | None = os.environ.get(API_KEY_ENV) or None
        exporting = rollout.server == "vllm" and rollout.launch and _exports_weights(rc)
        if ctx is not None and not ctx.is_main:
            # FSDP: other ranks only help gather the shards rank 0 sends; rank 0 tells them how starting the servers
            # went
            self.plans = {
                kind: WeightPlan.from_resolved(resolved, include_frozen_vision=kind == "full")
                for kind in ("full", "step")
            }
            _from_rank0(ctx)  # rank 0's checks before it writes vLLM's initial checkpoint
            if exporting:  # rank 0 writes vLLM's initial checkpoint: take part in gathering every shard
                for _ in self.plans["full"].tensors():
                    pass
            self.urls, self.api_key = _from_rank0(ctx)
            return
        problem = _launch_problem(rc, device) if rollout.server == "vllm" and rollout.launch else None
        if ctx is not None:
            ctx.gather_objects({"error": problem} if problem else None)
        if problem:
            raise VlmregError(problem)
        try:
            self._start(processor, peft_model)
        except Exception as exc:
            if ctx is not None:
                ctx.gather_objects({"error": str(exc)})
            raise
        if ctx is not None:
            ctx.gather_objects((self.urls, self.api_key))

    @property
    def url(self) -> str:
        """The first server's URL (one-server runs)."""
        return self.urls[0]

    def _start(self, processor: Any, peft_model: Any) -> None:
        rc, rollout, broadcast = self.rc, self.rc.config.rollout, self.rc.config.broadcast
        if rollout.server == "vllm":
            self.vllm_server = VllmServer(
                rc, self.resolved, processor, self.device, self.output_dir, self.log, peft_model=peft_model
            )
            self.urls, self.api_key = list(self.vllm_server.urls), self.vllm_server.api_key
            self.history = self.vllm_server.history
            self.cache_scope = self.vllm_server.cache_scope
        elif self.transport != NO_TRANSPORT:
            spec = rc.specs.transport  # looked up once, by resolve_config
            assert spec is not None, "resolve_config looks the transport up whenever it is not 'none'"
            self.sender = spec.sender(
                SenderContext(
                    name=spec.name,
                    resolved=self.resolved,
                    device=self.device,
                    broadcast=broadcast,
                    output_dir=self.output_dir,
                    url=self.urls[0] if self.urls else None,
                    log=self.log,
                    num_receivers=self.count,
                    lora_modules=self._lora_split(peft_model),
                )
            )
            # a server that dies before taking a sync is named at once: a launched one by its process, an attached
            # one by the failure of the sync's own request (`check_alive`)
            if hasattr(self.sender, "alive"):
                self.sender.alive = self.check_alive
        # LoRA: peft's adapter files are also written per step (vLLM loads each version from them)
        if peft_model is not None:
            self.adapters = FilesystemSender(
                self.output_dir / "adapters", self.resolved, peft_model=peft_model, adapter=True, merged=False
            )
        if self.vllm_server is None and rollout.launch:
            self.urls = self._launch()
        elif self.vllm_server is None and self.sender is not None:
            self.sender.connect(self.timeout_s, launched=False)

    def _lora_split(self, peft_model: Any) -> frozenset[str] | None:
        """The adapted modules whose LoRA travels as adapters to ``vlmreg serve`` (logged), or ``None``: all merged."""
        if peft_model is None or self.rc.config.broadcast.lora_sync == "merged":
            return None
        if self.ctx is not None and self.ctx.world > 1:
            self.log("LoRA syncs: merged (adapter syncs from FSDP-sharded LoRA are not supported)")
            return None
        adapted, keepable = lora_modules(self.resolved)
        if self.rc.config.rollout.launch:
            # the launched server loads this run's [model.lora]
            served: dict[str, Any] = {name: {} for name in keepable}
        else:
            for url in self.urls:  # an attached server answers what it serves once its model is loaded
                wait_healthy(
                    url, timeout_s=self.timeout_s, check_alive=self.check_alive, interval_s=0.2, api_key=self.api_key
                )
            cards = self._lora_cards("/v1/models")
            served = dict(cards[0])
            for url, other in zip(self.urls[1:], cards[1:], strict=True):
                if other != cards[0]:
                    raise VlmregError(
                        f"the servers serve different LoRA: {self.urls[0]} and {url} (start them from one config)"
                    )
        split = split_modules(adapted, keepable, served)
        self.lora_split = split
        self.log(split.summary("vlmreg serve"))
        return split.adapters or None

    def _lora_cards(self, path: str) -> list[dict[str, Any]]:
        """What each attached server's ``/v1/models`` card says it serves as LoRA (``vlmreg_lora``; none: ``{}``)."""

        def card(index: int, url: str) -> dict[str, Any]:
            body = get_json(f"{url}{path}", timeout=self.timeout_s, api_key=self.api_key)
            data = body.get("data") if isinstance(body, dict) else None
            first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else {}
            lora = first.get("vlmreg_lora")
            return dict(lora) if isinstance(lora, dict) else {}

        return on_every_server(self.urls, card)

    # -- the server processes ------------------------------------------------------------------
    def _launch(self) -> list[str]:
        """Start ``servers`` copies of ``vlmreg serve`` on the trainer's config, wait until each has joined the weight
        group (when the transport has one) and answers ``/health``; a server that exits meanwhile is an error at
        once."""
        self.output_dir.mkdir(parents=True, exist_ok=True)
        # the servers' config: one file a run (it was a new random name each launch)
        config = self.output_dir / "server.toml"
        fd, temporary = tempfile.mkstemp(prefix=".server-config-", dir=self.output_dir)
        with os.fdopen(fd, "w") as f:
            f.write(to_toml(self.rc.config))
        os.replace(temporary, config)
        self.api_key = secrets.token_urlsafe(32)  # only this trainer may use (and replace the weights of) its servers
        key_file = self.output_dir / "server.key"
        fd, temporary = tempfile.mkstemp(prefix=".server-key-", dir=self.output_dir)  # created with mode 0600
        with os.fdopen(fd, "w") as f:
            f.write(self.api_key + "\n")
        os.replace(temporary, key_file)
        urls = []
        for index in range(self.count):
            port = free_port()
            command = [
                sys.executable,
                "-m",
                "vlmreg",
                "serve",
                str(config),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--api-key-file",
                str(key_file),
            ]
            server_env: dict[str, str] = {}
            if self.sender is not None:  # what the server needs to take this transport's syncs
                server_argv, server_env = self._server_args(index)
                command += list(server_argv)
            env = server_environment()
            if self.device.type == "cuda":  # server k gets the k-th GPU after the trainer's (all of its ranks')
                env["CUDA_VISIBLE_DEVICES"] = server_gpus(self.device, "next", index=index)
            env.pop(API_KEY_ENV, None)  # the key file is the launched server's key
            env.update(server_env)  # secrets (a weight group's token) go in the environment, not on ps
            url = f"http://127.0.0.1:{port}"
            name = "server.log" if self.count == 1 else f"server-{index}.log"
            process = ServerProcess("the rollout server (vlmreg serve)", command, env, self.output_dir / name, url)
            self.processes.append(process)
            urls.append(url)
            self.log(f"launched vlmreg serve (pid {process.pid}) at {url}; its log: {process.log_path}")
        if self.sender is not None:
            what = "the launched server" if self.count == 1 else f"the {self.count} launched servers"
            try:
                join_while_alive(
                    lambda seconds: self.sender.connect(seconds, launched=True),
                    timeout_s=self.timeout_s,
                    check_alive=self.check_alive,
                    what=what,
                    progress=lambda s: self.log(
                        f"waiting for {what} to join the weight group ({s:.0f} s of {self.timeout_s:g})"
                    ),
                )
            except BroadcastError as exc:
                self.check_alive()
                raise VlmregError(f"{what} did not join the weight group: {exc}") from None
        for url in urls:

            def progress(s: float, url: str = url) -> None:
                self.log(f"waiting for the server at {url} ({s:.0f} s of {self.timeout_s:g})")

            try:
                wait_healthy(
                    url,
                    timeout_s=self.timeout_s,
                    check_alive=self.check_alive,
                    interval_s=0.2,
                    api_key=self.api_key,
                    progress=progress,
                )
            except TimeoutError:
                raise VlmregError(
                    f"the launched server at {url} was not ready within broadcast.timeout_s = {self.timeout_s:g} s; "
                    f"see {self.output_dir}"
                ) from None
        return urls

    def _server_args(self, index: int) -> tuple[list[str], dict[str, str]]:
        """The transport's arguments for server ``index``: with several servers, each joins the group as its own
        rank."""
        argv, env = self.sender.server_args()
        argv = list(argv)
        if self.count > 1 and "--weights-from" in argv:
            argv += ["--weights-rank", str(index + 1)]
        return argv, dict(env)

    def check_alive(self) -> None:
        """Raise naming the server that exited (exit code, last log lines), if any did; during a sync, the error of its
        request if that failed (an attached server has no process to watch)."""
        if self.vllm_server is not None:
            self.vllm_server.check_alive()
        for process in self.processes:
            process.check_alive()
        check_request_in_flight()

    # -- weight syncs ---------------------------------------------------------------------------
    def sync(self, step: int, *, full: bool = False) -> None:
        """Send the current weights and return once every server has applied them (every trainer rank calls it)."""
        if self.transport == NO_TRANSPORT:
            return
        ctx = self.ctx
        if ctx is not None and not ctx.is_main:
            _from_rank0(ctx)  # the servers are alive: rank 0 is about to send
            for _ in self.plans["full" if full else "step"].tensors():  # take part in gathering every shard
                pass
            _from_rank0(ctx)  # rank 0 has every server's confirmation
            return
        if ctx is not None:
            problem = None
            try:
                self.check_alive()
            except VlmregError as exc:
                problem = str(exc)
            ctx.gather_objects({"error": problem} if problem else None)
            if problem:
                raise VlmregError(problem)
        try:
            self._sync(step, full=full)
        except Exception as exc:
            self._release_sender()
            if ctx is not None:
                ctx.gather_objects({"error": str(exc)})
            raise
        if ctx is not None:
            ctx.gather_objects(None)

    def _release_sender(self) -> None:
        """After a failed sync: release the transport's group now (an NCCL communicator is aborted), so a broadcast a
        receiver will never take (a vLLM worker that failed before receiving) ends instead of holding the trainer's
        CUDA stream, and the run can report the error and stop. The sender is unusable afterwards, as after any failed
        transfer."""
        sender = self.vllm_server.sender if self.vllm_server is not None else self.sender
        if sender is None:
            return
        try:
            sender.close()
        except Exception as exc:  # noqa: BLE001 - the sync's own error is the one to report
            problem = f"{type(exc).__name__}: {exc}"
            print(f"warning: releasing the weight transfer after a failed sync: {problem}", file=sys.stderr)

    def post_early(self, step: int) -> bool:
        """Once the rollouts of ``step`` are collected and nothing uses the servers before its sync (the synchronous
        loop): ask vLLM's workers now to receive that sync, so the request travels while the trainer updates
        (`vlmreg.inference.vllm_rpc`); whether they were asked. One trainer process only: under torchrun another
        rank may still be collecting."""
        if self.vllm_server is None or self.ctx is not None:
            return False
        return self.vllm_server.post_early(step)

    def settle(self) -> None:
        """Before anything trains on what the servers produced since the last sync: a vLLM's answer to that sync, left
        to be taken (`vlmreg.inference.vllm_rpc`), is taken, its error raised."""
        if self.vllm_server is not None:
            self.vllm_server.settle()

    def timed_sync(self, step: int) -> dict[str, float]:
        """`sync` of a step, and its metrics: ``sync_s``, ``sync_bytes`` (what the transport sent; rank 0),
        ``adapter_files_s`` (peft's adapter files of the step, written after the sync: a record, not part of it), with
        vLLM the parts of ``sync_s`` (`vlmreg.inference.vllm_server.VllmServer.parts`), and with a process-group
        transport where the transfer's time went (``sync_ready_s``, ``sync_send_s``; with vLLM also ``sync_ack_s``,
        ``sync_early`` and the slowest worker's ``sync_worker_*``: `VllmServer.sync_metrics`)."""
        started, syncs = time.perf_counter(), len(self.history)
        self.adapter_files_s = 0.0
        self.sync(step)
        metrics = {"sync_s": time.perf_counter() - started - self.adapter_files_s}
        if self.vllm_server is not None:
            metrics.update(self.vllm_server.parts)
        if self.adapter_files_s:
            metrics["adapter_files_s"] = self.adapter_files_s
        if len(self.history) > syncs:
            stats = self.history[-1]
            metrics["sync_bytes"] = stats.bytes
            if stats.ready_s is not None and stats.send_s is not None:
                metrics.update(sync_ready_s=stats.ready_s, sync_send_s=stats.send_s)
        if self.vllm_server is not None:
            metrics.update(self.vllm_server.sync_metrics())
        return metrics

    def _sync(self, step: int, *, full: bool) -> None:
        self._transfer(step, full=full)
        self.step_synced = step
        if self.adapters is not None and not (self.adapters.directory / f"step_{step:06d}").exists():
            started = time.perf_counter()  # a record of the step's adapters, written once the server has them
            self.adapters.write(step)
            self.adapter_files_s = time.perf_counter() - started

    def _transfer(self, step: int, *, full: bool) -> None:
        if self.vllm_server is not None:
            self.vllm_server.sync(step, full=full)
            return
        self.check_alive()

        def request(fields: dict[str, Any], transfer: Any = None, confirmed: Any = None) -> Any:
            """POST ``{"step": step, **fields}`` to every server; with ``transfer``, run it meanwhile (a collective the
            servers join). ``vlmreg serve`` confirms nothing through the transport: its answer is awaited."""
            body = {"step": step, **fields}
            if transfer is None:
                answers = self._post_all("/v1/weights", body, self.timeout_s)
            else:
                where = self.urls[0] if self.count == 1 else ", ".join(self.urls)
                answers = alongside(
                    lambda: self._post_all("/v1/weights", body, self.timeout_s + 30),
                    transfer,
                    what=f"take the weights of step {step}",
                    url=where,
                    timeout_s=self.timeout_s,
                    check_alive=self.check_alive,
                )
            return answers[0] if self.count == 1 else answers  # one server: its answer, as a sender has always had it

        assert self.sender is not None
        stats = self.sender.send(step, full=full, request=request)
        if stats is not None:
            self.history.append(stats)

    def _post_all(self, path: str, body: dict[str, Any], timeout_s: float) -> list[Any]:
        """POST ``body`` to ``path`` of every server at once; the answers in server order."""
        return on_every_server(
            self.urls, lambda index, url: post_json(f"{url}{path}", body, timeout_s, api_key=self.api_key)
        )

    def close(self) -> None:
        if self.vllm_server is not None:
            self.vllm_server.close()
        if self.sender is not None:
            try:
                self.sender.close()
            except BroadcastError:
                pass
        for process in self.processes:
            process.stop(20)
        if self.processes:  # the launched servers' key is of no use once they are gone
            (self.output_dir / "server.key").unlink(missing_ok=True)


def _from_rank0(ctx: Ranks) -> Any:
    """What rank 0 shares at this point (`ServerLink`): a value, or ``{"error": ...}``, raised here as rank 0's
    error."""
    answer = ctx.gather_objects(None)[0]
    if isinstance(answer, dict) and answer.get("error"):
        raise VlmregError(f"rank 0: {answer['error']}")
    return answer


def _exports_weights(rc: ResolvedConfig) -> bool:
    return exports_weights(rc)


def _launch_problem(rc: ResolvedConfig, device: Any) -> str | None:
    return launch_problem(rc, device)
