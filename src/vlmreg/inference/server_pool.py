"""`ServerPool`: one rollout engine over several inference servers, each prompt group kept on one server.

With ``[rollout] servers = N`` (launched) or a list of attached ``url``s, the trainer builds the run's server engine
once per server and wraps them here. Each `chat` call splits its conversations into groups by name (the episode runner
names each conversation by its example, so a GRPO group shares one name), sends every group to one server, and runs
the servers' calls side by side:

- a group stays on one server, so the server's prefix cache holds the group's shared prompt (and a multi-turn
  episode's next turn goes back to the server that sampled its last one);
- each new group goes to the server with the fewest conversations in flight or already given in this call (ties:
  the lower index), so servers of equal speed get equal shares and a slow one gets fewer as its queue grows;
- each server's engine gets its share in one call, so a group's identical requests become one request with ``n``
  there (`OpenAIEngine`'s ``share_prompts``);
- every server's completions (turns, not requests) are counted (`completions`), for ``rollout_completions_per_server``
  in the metrics.

An error of one server's call is raised with that server's URL, after the other servers' calls have ended.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from vlmreg.sdk.engine import ChatTurn, SamplingParams
from vlmreg.sdk.errors import VlmregError

__all__ = ["ServerPool"]


class ServerPool:
    """A rollout engine that spreads each call's prompt groups over ``engines`` (one a server, ``urls`` theirs)."""

    def __init__(self, engines: Sequence[Any], urls: Sequence[str]) -> None:
        if not engines or len(engines) != len(urls):
            raise ValueError(f"ServerPool needs one engine per server (got {len(engines)} engines, {len(urls)} URLs)")
        self.engines, self.urls = list(engines), [str(u) for u in urls]
        self._lock = threading.Lock()
        self._in_flight = [0] * len(engines)
        self._completions = [0] * len(engines)
        self._home: dict[str, int] = {}  # the server of each name in the last call (its next turn goes back there)

    @property
    def completions(self) -> list[int]:
        """Completions each server has returned so far, in server order."""
        with self._lock:
            return list(self._completions)

    def assign(self, names: Sequence[str]) -> list[int]:
        """The server of each conversation: a name's server from the last call, else the least loaded for a new
        group."""
        with self._lock:
            load = list(self._in_flight)
            chosen: dict[str, int] = {}
            servers = []
            for name in names:
                if name not in chosen:
                    home = self._home.get(name)
                    chosen[name] = home if home is not None else min(range(len(load)), key=lambda k: (load[k], k))
                server = chosen[name]
                load[server] += 1
                servers.append(server)
            self._home = chosen
            return servers

    def chat(
        self,
        conversations: Sequence[Sequence[Mapping[str, Any]]],
        params: SamplingParams,
        *,
        template_kwargs: Mapping[str, Any] | None = None,
        names: Sequence[str] | None = None,
    ) -> list[ChatTurn]:
        """One completion per conversation, in order; each name's conversations on one server."""
        if not conversations:
            return []
        names = list(names or [f"conversation {i}" for i in range(len(conversations))])
        servers = self.assign(names)
        parts: dict[int, list[int]] = {}
        for index, server in enumerate(servers):
            parts.setdefault(server, []).append(index)
        with self._lock:
            for server, indices in parts.items():
                self._in_flight[server] += len(indices)

        def run(server: int) -> list[ChatTurn]:
            indices = parts[server]
            try:
                turns = self.engines[server].chat(
                    [conversations[i] for i in indices],
                    params,
                    template_kwargs=template_kwargs,
                    names=[names[i] for i in indices],
                )
            finally:
                with self._lock:
                    self._in_flight[server] -= len(indices)
            with self._lock:
                self._completions[server] += len(turns)
            return turns

        out: list[ChatTurn | None] = [None] * len(conversations)
        with ThreadPoolExecutor(len(parts), thread_name_prefix="vlmreg-pool") as pool:
            futures = {server: pool.submit(run, server) for server in parts}
        errors = []
        for server, future in futures.items():
            error = future.exception()
            if error is not None:
                errors.append((server, error))
                continue
            for index, turn in zip(parts[server], future.result(), strict=True):
                out[index] = turn
        if errors:
            server, error = errors[0]
            where = self.urls[server]
            if where in str(error) or not isinstance(error, VlmregError):
                raise error
            raise VlmregError(f"rollout server {server + 1} of {len(self.engines)} ({where}): {error}") from error
        return [turn for turn in out if turn is not None]
