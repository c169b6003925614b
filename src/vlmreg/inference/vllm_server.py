"""vLLM as the rollout server: starting it (or attaching to one) and keeping its weights the trainer's.

``[rollout] server = "vllm"``, ``engine = "openai"``. With ``launch = true`` the trainer starts
``python -m vllm.entrypoints.openai.api_server`` itself, on its own GPU (``launch_gpu = "same"``, with
``gpu_memory_fraction`` of the memory, default 0.3) or on the next one (default 0.9), with what RL needs: the
vlmreg worker extension and weight-transfer engine, logprobs of the distribution it samples from
(``--logprobs-mode processed_logprobs``), no sampling defaults from the checkpoint (``--generation-config vllm``),
the trainer's dtype and seed, and ``VLLM_SERVER_DEV_MODE=1`` for the weight endpoints. A random init, or a
checkpoint that is not a local directory, is first written to ``OUTPUT/vllm-model`` (weights in the published
layout, config, and the family's `engine_processor`). The log goes to ``OUTPUT/vllm.log``; a server that exits
or is not healthy within ``launch_timeout_s`` is an error quoting the log's last lines.

The weights move by the registered transport ``[broadcast] transport`` names (any with a ``vllm_receiver``, a
plugin's too): its sender, built here as for ``vlmreg serve``, tells the workers how to join (``worker_info()``, sent
once through ``/init_weight_transfer_engine``) and sends each sync, while vLLM's ``/update_weights`` carries the
fields it asks for (see `vlmreg.inference.vllm_worker`). Each sync: ``/start_weight_update``, ``/update_weights``,
``/finish_weight_update``. The world size (``/get_world_size``) sets how many receivers the sender waits for, so a
tensor-parallel server works. A vLLM without the weight-transfer API (or ``vllm_load = "direct"``) is driven through
``/collective_rpc`` instead.

Caches: the engine's requests carry the server's `CacheScope` (a ``cache_salt`` per weight version, and per-version
image ``uuid``s when the syncs change the image side), so no prefix or image embedding computed with older weights is
ever reused; an engine that does not apply it gets ``/reset_prefix_cache`` and ``/reset_encoder_cache`` after every
sync instead.

Several servers (``[rollout] servers = N`` launched, each on its own GPUs after the trainer's, or a list of attached
``url``s): one sender, one process group for every worker of every server (server ``k``'s workers take the ranks after
server ``k - 1``'s: ``first_rank`` in its join message), so a sync is one broadcast; each server's requests are made
to all of them at once.

Pushed syncs (``transport = "ipc"``, ``vllm_load = "direct"``, ``vllm_push = true``, a vLLM launched here with one
worker): the trainer replays the worker's copy plan into vLLM's weights itself, with no request at all
(`vlmreg.inference.vllm_push`, which says when that is safe).

LoRA (``[broadcast] lora_sync = "adapters"``): vLLM serves the adapters itself, loaded at run time as one adapter per
version, and a sync moves only the adapter factors plus whatever vLLM cannot serve as LoRA, merged
(`vlmreg.inference.vllm_adapters`); no pushed syncs then.
"""

from __future__ import annotations

import json
import os
import secrets
import threading
import time
from pathlib import Path
from typing import Any

from vlmreg.broadcast import SyncStats, WeightPlan
from vlmreg.config.resolve import ResolvedConfig
from vlmreg.http.client import HttpStatusError, field, get_json, post_json
from vlmreg.inference.cache_scope import CacheScope
from vlmreg.inference.calls import alongside, free_port, join_while_alive, on_every_server, wait_healthy
from vlmreg.inference.server_process import ServerProcess, server_environment, server_gpus
from vlmreg.inference.vllm_adapters import VllmAdapters, adapters_wanted, worker_answers
from vlmreg.inference.vllm_auth import API_KEY_ENV
from vlmreg.inference.vllm_launch import (
    EXTENSION,
    export_checkpoint,
    export_weights,
    exports_weights,
    launch_problem,
    tensor_parallel_size,
    vllm_command,
)
from vlmreg.inference.vllm_push import PUSH_ASKS, adopt_plan, push_sync, pushes_wanted
from vlmreg.inference.vllm_room import room_for_syncs
from vlmreg.inference.vllm_rpc import RpcSyncs, worker_timings
from vlmreg.resolution import ResolvedFamily
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.transport import SenderContext

__all__ = [  # the launch helpers live in vlmreg.inference.vllm_launch, re-exported where callers found them
    "PUSH_ASKS",
    "VllmServer",
    "export_checkpoint",
    "export_weights",
    "exports_weights",
    "launch_problem",
    "vllm_command",
]


class VllmServer:
    """The trainer's side of its vLLM servers: their processes (when launched), URLs, and weight syncs into them."""

    lora: Any = None  # `vlmreg.inference.vllm_adapters.VllmAdapters` with adapter syncs

    def __init__(
        self,
        rc: ResolvedConfig,
        resolved: ResolvedFamily,
        processor: Any,
        device: Any,
        output_dir: Path,
        log: Any,
        peft_model: Any = None,
    ) -> None:
        """``peft_model``: the peft wrapper when LoRA is on (adapter syncs need its config)."""
        rollout, broadcast = rc.config.rollout, rc.config.broadcast
        wanted = peft_model is not None and adapters_wanted(rc, resolved)
        self.lora = VllmAdapters(rc, resolved, log, peft_model, output_dir / "vllm-lora") if wanted else None
        self.lora_modules: frozenset[str] | None = None  # the modules whose LoRA travels as adapters (vLLM serves them)
        self.rc, self.resolved, self.device, self.log = rc, resolved, device, log
        self.transport, self.timeout_s = broadcast.transport, broadcast.timeout_s
        self.processes: list[ServerProcess] = []
        self.output_dir = output_dir
        self.sender: Any = None  # the transport's sender (`vlmreg.broadcast.senders`)
        self.history: list[SyncStats] = []
        self.last_stats: SyncStats | None = None  # what the last sync sent (None: pushed, or nothing sent)
        self.parts: dict[str, float] = {}  # seconds of the last sync's parts (`sync`)
        self.api = True  # vLLM's weight-transfer API; False: the worker extension through /collective_rpc
        self.rpc_syncs = RpcSyncs(self, early=False)  # the /collective_rpc syncs (`vlmreg.inference.vllm_rpc`)

        self.cache_scope = CacheScope(
            images=WeightPlan.from_resolved(resolved, include_frozen_vision=False).changes_images
        )
        self.count = rollout.server_count
        self.push = pushes_wanted(rollout, broadcast, self.count)  # `vlmreg.inference.vllm_push`
        self.push_asks = 0  # syncs the worker had no plan to export for (a layout that moves every sync never has one)
        self.pushed: Any = None  # `PushedPlan` of the layout the syncs now have
        self.push_refused: str | None = None
        self.pushes = 0
        # a launched vLLM gets a fresh key that guards every endpoint (vlmreg.inference.vllm_auth); an attached one
        # is sent VLMREG_API_KEY when set
        self.api_key: str | None = (
            secrets.token_urlsafe(32) if rollout.launch else (os.environ.get(API_KEY_ENV) or None)
        )
        try:
            if rollout.launch:
                self.urls = self._launch(processor, output_dir)
            else:
                # deferred: start-up cost (loads http)
                from vlmreg.inference.openai_client import base_url  # noqa: PLC0415

                self.urls = [base_url(u) for u in rollout.urls]
            self._join()
            self.rpc_syncs.early = self._early_receive()
        except BaseException:
            self.close()  # a vLLM launched here that never became ready, or did not join, must not outlive the error
            raise

    @property
    def url(self) -> str:
        """The first server's URL (one-server runs)."""
        return self.urls[0]

    @property
    def log_path(self) -> Path:
        return self.output_dir / "vllm.log"

    # -- the processes ------------------------------------------------------------------------
    def _launch(self, processor: Any, output_dir: Path) -> list[str]:
        rollout, model_section = self.rc.config.rollout, self.rc.config.model
        problem = launch_problem(self.rc, self.device)
        if problem:
            raise VlmregError(problem)
        fraction = room_for_syncs(self.rc, self.resolved, self.device, self.log)  # before anything is written
        if exports_weights(self.rc):  # with FSDP, the other ranks gather each shard meanwhile (`ServerLink`)
            self.log(f"writing the initial weights for vLLM to {output_dir / 'vllm-model'}")
            # adapter syncs: vLLM adds the adapters
            base = frozenset(self.lora.keepable) if self.lora is not None else None
            model = str(export_checkpoint(self.resolved, processor, output_dir / "vllm-model", base))
        else:
            # a checkpoint folder, or a cached Hub id vLLM resolves as transformers does
            model = str(model_section.name)
        config = self.resolved.model.config
        text = getattr(config, "text_config", config)
        limit = self.rc.config.trainer.seq_len + rollout.max_tokens
        positions = getattr(text, "max_position_embeddings", None)
        dtype = str(next(self.resolved.model.parameters()).dtype).removeprefix("torch.")
        tp = tensor_parallel_size(rollout.server_args)
        urls = []
        for index in range(self.count):  # every server starts now; they load side by side
            port = free_port()
            command = vllm_command(
                self.rc,
                model,
                port,
                dtype,
                min(limit, positions) if positions else limit,
                lora_args=self.lora.server_args() if self.lora is not None else (),
                fraction=fraction,
            )
            env = server_environment(
                VLLM_SERVER_DEV_MODE="1", CUDA_VISIBLE_DEVICES=server_gpus(self.device, rollout.launch_gpu, tp, index)
            )
            if self.lora is not None:
                env.update(self.lora.server_env())
            env[API_KEY_ENV] = str(self.api_key)  # in the environment, not on the command line where ps shows it
            env.setdefault("VLLM_NO_USAGE_STATS", "1")
            url = f"http://127.0.0.1:{port}"
            log_path = self.log_path if self.count == 1 else output_dir / f"vllm-{index}.log"
            process = ServerProcess("the rollout server (vLLM)", command, env, log_path, url, header=" ".join(command))
            self.processes.append(process)
            urls.append(url)
            self.log(
                f"launched vLLM (pid {process.pid}) at {url} on GPU {env['CUDA_VISIBLE_DEVICES']}; its log: {log_path}"
            )
        for process in self.processes:

            def progress(s: float, p: ServerProcess = process) -> None:
                self.log(
                    f"waiting for vLLM at {p.url} to be ready ({s:.0f} s of rollout.launch_timeout_s = "
                    f"{rollout.launch_timeout_s:g}){p.tail(1)}"
                )

            try:
                took = wait_healthy(
                    process.url,
                    timeout_s=rollout.launch_timeout_s,
                    check_alive=self.check_alive,
                    interval_s=1.0,
                    api_key=self.api_key,
                    progress=progress,
                )
            except TimeoutError:
                raise VlmregError(
                    f"vLLM at {process.url} was not ready within rollout.launch_timeout_s = "
                    f"{rollout.launch_timeout_s:g} s{process.tail()}"
                ) from None
            self.log(f"vLLM at {process.url} is ready after {took:.0f} s")
        return urls

    def check_alive(self) -> None:
        for process in self.processes:
            process.check_alive()

    # -- joining the weight transfer ----------------------------------------------------------
    def _workers(self, url: str) -> int:
        try:
            answer = get_json(f"{url}/get_world_size", timeout=30, api_key=self.api_key)
        except HttpStatusError as exc:
            if exc.status == 404:
                return 1  # older vLLM: one worker assumed
            raise
        return int(field(answer, "world_size", int, f"{url}/get_world_size"))

    def _join(self) -> None:
        broadcast = self.rc.config.broadcast
        counts = [self._workers(url) for url in self.urls]
        workers = sum(counts)
        spec = self.rc.specs.transport  # looked up once, by resolve_config
        assert spec is not None, "resolve_config looks the transport up whenever it is not 'none'"
        if spec.vllm_receiver is None:
            raise VlmregError(
                f"broadcast.transport = {self.transport!r} has no vLLM end (its Transport declares no vllm_receiver)"
            )
        where = self.url if self.count == 1 else f"{self.count} servers ({', '.join(self.urls)})"
        if self.lora is not None:  # which modules vLLM serves as LoRA: those travel as adapters, the rest merged

            def ask(names: list[str]) -> list[tuple[list[str], bool]]:
                answers = on_every_server(
                    self.urls, lambda index, url: self._rpc(url, "vlmreg_lora_modules", [json.dumps(names)])
                )
                return [answer for result in answers for answer in worker_answers(result)]

            self.lora_modules = self.lora.choose(ask, where)
            if self.lora_modules is None:
                # vLLM serves none of them (no --enable-lora?): every adapter merged, as lora_sync = "merged"
                self.lora = None
            else:
                self.push = False  # a pushed copy plan replays base-weight copies only
        context = SenderContext(
            name=self.transport,
            resolved=self.resolved,
            device=self.device,
            broadcast=broadcast,
            output_dir=self.output_dir,
            url=self.url,
            log=self.log,
            num_receivers=workers,
            # vLLM keeps its checkpoint's base under LoRA
            lora_modules=self.lora_modules,
            lora_base=False,
            # vLLM's lora_dtype "auto"
            lora_dtype=next(self.resolved.model.parameters()).dtype if self.lora_modules else None,
        )
        sender = self.sender = spec.sender(context)
        if hasattr(sender, "alive"):  # a launched vLLM that dies before its workers are ready for a sync: named at once
            sender.alive = self.check_alive
        info = sender.worker_info()
        messages = []
        for index in range(self.count):  # server k's workers take the group's ranks after server k - 1's
            server_info = dict(info) if self.count == 1 else {**info, "first_rank": 1 + sum(counts[:index])}
            messages.append({"transport": self.transport, "timeout_s": self.timeout_s, "info": server_info})
        where = self.url if self.count == 1 else f"{self.count} servers ({', '.join(self.urls)})"
        self.log(f"vLLM at {where}: {workers} worker(s) joining the weight transfer ({self.transport})")

        def join(request: Any) -> None:
            refused = threading.Event()  # set when a server answers with an error: its workers will not connect

            def ask() -> Any:
                try:
                    return on_every_server(self.urls, request)
                except VlmregError:
                    refused.set()
                    raise

            what = f"{workers} vLLM worker(s)"
            connect = lambda: join_while_alive(  # noqa: E731
                lambda seconds: sender.connect(seconds, launched=True),
                timeout_s=self.timeout_s,
                check_alive=self.check_alive,
                # an old vLLM's 404 leads to the fallback at once, not after timeout_s
                what=what,
                gave_up=refused.is_set,
            )
            self._with_transfer(ask, connect, "join the weight transfer")

        rpc = lambda index, url: self._rpc(url, "vlmreg_join_weight_group", [json.dumps(messages[index])])  # noqa: E731
        if broadcast.vllm_load == "direct":
            self.api = False
            self.log(
                f'vLLM at {where}: direct loads ([broadcast] vllm_load = "direct"), no layerwise reload or finalize'
            )
            join(rpc)
            return
        try:
            join(
                lambda index, url: post_json(
                    f"{url}/init_weight_transfer_engine",
                    {"init_info": messages[index]},
                    self.timeout_s + 30,
                    api_key=self.api_key,
                )
            )
        except HttpStatusError as exc:
            if exc.status != 404 and "not configured" not in str(exc):
                raise
            self.api = False  # no weight-transfer API here (or not enabled): the worker extension does it
            self.log(f"vLLM at {where} has no weight-transfer API enabled; using {EXTENSION} through /collective_rpc")
            join(rpc)

    def _rpc(self, url: str, method: str, args: list[Any], timeout_s: float | None = None) -> Any:
        return post_json(
            f"{url}/collective_rpc",
            {"method": method, "args": args},
            timeout_s or self.timeout_s + 30,
            api_key=self.api_key,
        )

    def _with_transfer(self, ask: Any, transfer: Any, what: str) -> Any:
        where = self.url if self.count == 1 else ", ".join(self.urls)
        return alongside(ask, transfer, what=what, url=where, timeout_s=self.timeout_s, check_alive=self.check_alive)

    # -- syncs ----------------------------------------------------------------------------------
    def _early_receive(self) -> bool:
        """Whether the workers may be asked to receive a sync before it starts (`RpcSyncs.post_early`): through the
        extension's RPC, a sender that takes no per-sync fields (``early_receive``), no adapter syncs, and a server
        ``[broadcast] vllm_early_receive`` allows (``"launched"``: one this trainer launched; ``"always"``)."""
        setting = self.rc.config.broadcast.vllm_early_receive
        allowed = setting == "always" or (setting == "launched" and self.rc.config.rollout.launch)
        return allowed and not self.api and self.lora is None and bool(getattr(self.sender, "early_receive", False))

    def settle(self) -> None:
        """Take the answer of the last sync if it is still to be taken (`RpcSyncs.settle`); raise its error."""
        self.rpc_syncs.settle()

    def post_early(self, step: int) -> bool:
        """Ask the workers now to receive the sync of ``step`` (the trainer calls it once the step's rollouts are
        collected, before its update; nothing may use the server until that sync): whether they were asked."""
        return self.rpc_syncs.post_early(step)

    def sync_metrics(self) -> dict[str, float]:
        """Where the last sync's time went: the trainer's waits (``sync_ready_s`` for the workers to be ready,
        ``sync_send_s`` to issue the broadcast, ``sync_ack_s`` after it: until the broadcast left this GPU where the
        answer is left to `RpcSyncs.settle`, else until it came; ``sync_early``: 1 when the request was posted early)
        and the slowest worker's own (``sync_worker_wait_s``, ``_receive_s``, ``_copy_s``, ``_tail_s``:
        `vlmreg.inference.vllm_worker.WeightIntake.receive`) when the answer was awaited; for a sync whose answer was
        settled since, those of that sync as ``sync_prev_worker_*``, with ``sync_prev_settle_s``, what the settle
        waited."""
        metrics = dict(self.rpc_syncs.timings)
        metrics.update(self.rpc_syncs.settled)
        self.rpc_syncs.settled = {}
        stats = self.last_stats
        if stats is None:
            return metrics
        if stats.ready_s is not None and stats.send_s is not None:
            metrics.update(sync_ready_s=stats.ready_s, sync_send_s=stats.send_s)
        if self.rpc_syncs.pending is not None:  # the workers may still be writing: their timings come settled
            return metrics
        metrics.update(worker_timings(self.sender, "sync_worker_"))
        return metrics

    def sync(self, step: int, *, full: bool = False) -> None:
        """Send the current weights; return once every server holds them and no cached work of older weights can be
        reused (with adapter syncs: serves them as its next adapter version)."""
        self.check_alive()
        self.rpc_syncs.timings, self.last_stats = {}, None

        def post(path: str, body: Any = None) -> Any:
            return on_every_server(
                self.urls, lambda index, url: post_json(f"{url}{path}", body, self.timeout_s + 30, api_key=self.api_key)
            )

        parts = self.parts = {}  # what the parts of this sync took (the metrics' sync_*_s)
        clock = time.perf_counter()
        lora_fields = self.lora.request_fields() if self.lora is not None else None
        parts["sync_adapter_config_s"], clock = time.perf_counter() - clock, time.perf_counter()
        if not (self.pushed is not None and not full and push_sync(self, step)):
            self._send(step, full, post, lora_fields)
        parts["sync_transfer_s"], clock = time.perf_counter() - clock, time.perf_counter()
        if self.lora is not None:
            self.lora.finish(post, self.cache_scope)
        parts["sync_adapter_load_s"] = time.perf_counter() - clock
        if self.lora is None:
            del parts["sync_adapter_config_s"], parts["sync_adapter_load_s"]
        self.cache_scope.advance()
        if self.cache_scope.applied:
            return  # the engine's requests are scoped to these weights: nothing cached before can be reused
        post("/reset_prefix_cache")
        try:
            post("/reset_encoder_cache")
        except HttpStatusError as exc:
            if exc.status != 404:
                raise

    def _send(self, step: int, full: bool, post: Any, lora_fields: dict[str, str] | None = None) -> None:
        """A sync through vLLM: its weight-transfer API, or the worker extension's RPC (every server at once).
        ``lora_fields``: adapter syncs (what the workers do with the factors); a step that carries adapters only skips
        the weight-transfer API's layerwise reload (nothing of the base weights changes)."""
        weights = lora_fields is None or full or self.lora is None or self.lora.sends_weights

        def request(fields: dict[str, Any], transfer: Any = None, confirmed: Any = None) -> None:
            """The sender's ``request``: ``/update_weights`` (or the extension's RPC) with its fields, running
            ``transfer()`` meanwhile when given (a broadcast the workers take part in); through the RPC, done once
            ``confirmed()`` (every worker said so through the transport), when the sender gives it."""
            asked = time.perf_counter()
            if lora_fields is not None:
                fields = {**fields, **lora_fields}
            update = {"step": step, "timeout_s": self.timeout_s, "fields": fields}
            what = f"take the weights of step {step}"
            if self.api:

                def ask() -> Any:
                    return post("/update_weights", {"update_info": update})
            else:

                def ask() -> Any:
                    return on_every_server(
                        self.urls, lambda index, url: self._rpc(url, "vlmreg_receive_weights", [json.dumps(update)])
                    )

            if transfer is None:
                ask()
            elif self.api:
                self._with_transfer(ask, transfer, what)
            else:  # adapters: vLLM takes them next, so its answer is awaited
                self.rpc_syncs.send(update, transfer, confirmed if lora_fields is None else None, what)
            # the request, the workers' receive and load included (the rest of sync_transfer_s: the sender's own work);
            # through the RPC until every worker confirmed, when they do
            self.parts["sync_request_s"] = self.parts.get("sync_request_s", 0.0) + time.perf_counter() - asked
            if (
                self.push
                and self.pushed is None
                and self.push_refused is None
                and "ipc" in fields
                and hasattr(self.sender, "ipc")
            ):
                adopt_plan(self, step, fields["ipc"])  # while the sender still holds this sync's tensors

        if self.api:  # adapters only: no layerwise reload of weights that do not change (the workers stage the factors)
            post("/start_weight_update", {"is_checkpoint_format": weights})
        stats = self.sender.send(step, full=full, request=request)
        if stats is not None:
            self.history.append(stats)
        self.last_stats = stats
        if self.api:
            post("/finish_weight_update")

    def close(self) -> None:
        self.pushed = None  # unmap vLLM's weights before vLLM goes
        self.rpc_syncs.close()
        if self.sender is not None:
            try:
                self.sender.close()
            except Exception:  # noqa: BLE001 - closing after a failure must not hide it
                pass
        for process in self.processes:
            process.stop(30)
