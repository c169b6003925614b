"""Where a run's examples come from (a task or dataset files), in a reproducible, resumable order."""

from __future__ import annotations

import inspect
import os
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from vlmreg.config.resolve import ResolvedConfig
from vlmreg.data.datasets import load_examples
from vlmreg.data.store import ImageStore
from vlmreg.envs.remote import RemoteEnvironments
from vlmreg.envs.single_turn import SingleTurnEnvironment
from vlmreg.http.auth import check_key
from vlmreg.rewards import combine
from vlmreg.sdk.environment import Environment, EnvironmentSpec, RewardFn
from vlmreg.sdk.errors import VlmregError
from vlmreg.sdk.example import Example
from vlmreg.sdk.registry import get_environment_registry

__all__ = ["ExampleSource", "RunData", "load_run_data"]

DEFAULT_TASK_SAMPLES = 512


class ExampleSource:
    """Examples in a shuffled order, reshuffled each epoch from the seed; its position is all its state."""

    def __init__(self, examples: list[Example], seed: int) -> None:
        if not examples:
            raise VlmregError("the dataset has no examples")
        self.examples, self.seed = examples, seed
        self.epoch, self.position = 0, 0
        self._order = self._shuffled(0)

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.examples)))
        random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def take(self, n: int) -> list[Example]:
        out = []
        for _ in range(n):
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self.examples[self._order[self.position]])
            self.position += 1
        return out

    def state(self) -> dict[str, int]:
        return {"epoch": self.epoch, "position": self.position}

    def restore(self, state: dict[str, int]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])
        self._order = self._shuffled(self.epoch)


@attrs.frozen(eq=False)
class RunData:
    examples: list[Example]
    reward: RewardFn
    make_env: Callable[[Example], Environment]
    choices: tuple[str, ...] | None
    skipped: int
    description: str
    #: the environment's name (a registered one, or the server's), or None for a task's own unregistered factory
    environment: str | None = None


def _check_images_per_message(examples: list[Example], limit: int, family: str, kind: str = "image") -> None:
    """A dataset message with more images (``kind="video"``: videos) than the family takes is an error naming the
    record (not a silent drop); a video for a family that takes none says so."""
    for example in examples:
        for index, message in enumerate(example.messages):
            content = message["content"]
            count = 0 if isinstance(content, str) else sum(1 for part in content if part.get("type") == kind)
            if count and not limit and kind == "video":
                raise VlmregError(
                    f"{example.id}: messages[{index}] carries a video, but family {family} takes no video input "
                    "(its descriptor's max_videos_per_message is 0); use a family that declares video, or give the "
                    "frames as images"
                )
            if count > limit:
                raise VlmregError(
                    f"{example.id}: messages[{index}] carries {count} {kind}s; family {family} takes at most {limit} "
                    f"per message (split the {kind}s over several messages, or drop some)"
                )


def load_run_data(rc: ResolvedConfig, store: ImageStore, *, base_dir: Path, split: str = "train") -> RunData:
    """The examples, reward and environment factory a config describes (``split="eval"``: the held-out ones)."""

    data, config = rc.config.data, rc.config
    task = rc.specs.task  # data.task, looked up once by resolve_config
    paths = config.eval.paths if split == "eval" else data.paths
    skipped = 0
    if split == "eval" and not paths and task is None:
        raise VlmregError("eval needs eval.paths, or a data.task to generate a held-out split from")
    if paths:
        # the held-out split: eval.num_samples of its files, as of a generated one
        count = config.eval.num_samples if split == "eval" else data.num_samples
        section = attrs.evolve(data, paths=list(paths), task=None, num_samples=count)
        loaded = load_examples(section, store, base_dir=base_dir, video_sampling=rc.family.video_sampling)
        examples, skipped = loaded.examples, len(loaded.skipped)
        _check_images_per_message(examples, rc.family.max_images_per_message, rc.family.name)
        _check_images_per_message(examples, rc.family.max_videos_per_message, rc.family.name, kind="video")
        description = f"{len(examples)} examples from {', '.join(paths)}"
    else:
        assert task is not None
        n = config.eval.num_samples if split == "eval" else (data.num_samples or DEFAULT_TASK_SAMPLES)
        seed = config.eval.seed if split == "eval" else data.seed
        examples = task.generate(n, seed, store)
        _check_images_per_message(examples, rc.family.max_videos_per_message, rc.family.name, kind="video")
        description = f"task {task.name}: {len(examples)} generated examples (seed {seed})"
    weights = config.reward.functions or (task.reward if task else None)
    if not weights:
        raise VlmregError(
            "reward.functions: required when the data comes from files (name the reward functions and weights)"
        )
    reward = combine(weights)
    # in the examples themselves, as dataset files get [data] system_prompt: every environment then sees it, the
    # default one and one named (single_turn included), a task's own and a served one alike
    examples = _with_system_prompt(examples, data.system_prompt or (task.system_prompt if task else None))
    make_env, environment = _environment_factory(rc, task, reward, store, examples)
    return RunData(
        examples=examples,
        reward=reward,
        make_env=make_env,
        choices=task.choices if task else None,
        skipped=skipped,
        description=description,
        environment=environment,
    )


def _with_system_prompt(examples: list[Example], system_prompt: str | None) -> list[Example]:
    """Each example whose messages have no system message, with ``system_prompt`` put first."""
    if not system_prompt:
        return examples
    first = {"role": "system", "content": system_prompt}
    return [
        e if any(m["role"] == "system" for m in e.messages) else attrs.evolve(e, messages=(first, *e.messages))
        for e in examples
    ]


def _accepts_store(factory: Any) -> bool:
    """Whether a task's own environment factory takes ``(example, reward, store)`` (older ones take two arguments)."""

    try:
        parameters = list(inspect.signature(factory).parameters.values())
    except (TypeError, ValueError):
        return False
    positional = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    return any(p.kind == p.VAR_POSITIONAL for p in parameters) or len(positional) >= 3


def _environment_factory(
    rc: ResolvedConfig,
    task: Any,
    reward: RewardFn,
    store: ImageStore,
    examples: list[Example],
) -> tuple[Callable[[Example], Any], str | None]:
    """``make_env(example)`` and the environment's name: ``[rollout] environment`` (a registered one), else the task's,
    else one turn; with ``[rollout] env_url``, that environment played on a server, checked before anything trains."""

    rollout = rc.config.rollout
    wanted = getattr(task, "environment", None) if task is not None else None
    name = rollout.environment or (wanted.name if isinstance(wanted, EnvironmentSpec) else None)
    if rollout.env_url is not None:
        return _remote_factory(rc, store, name, examples)
    if name is not None:
        # [rollout] environment, looked up by resolve_config; else the task's, by the name its spec carries
        spec = rc.specs.environment if rollout.environment is not None else get_environment_registry().get(name)
        return (lambda example: spec.make(example, reward, store)), spec.name
    if wanted is not None:  # a task's own factory, not registered: (example, reward[, store])
        if _accepts_store(wanted):
            return (lambda example: wanted(example, reward, store)), None
        return (lambda example: wanted(example, reward)), None
    return (lambda example: SingleTurnEnvironment(reward)), "single_turn"


def _remote_factory(
    rc: ResolvedConfig, store: ImageStore, name: str | None, examples: list[Example]
) -> tuple[Callable[[Example], Any], str]:
    rollout = rc.config.rollout
    key = os.environ.get(rollout.env_api_key_env)
    api_key = check_key(key, f"the environment variable {rollout.env_api_key_env}") if key is not None else None
    # the client's own deadline comes first, so its error (naming the server and the request) is the one reported
    server = RemoteEnvironments(
        rollout.env_url or "",
        store,
        api_key=api_key,
        name=name,
        timeout_s=0.9 * rollout.env_timeout_s,
        concurrency=rollout.env_concurrency,
        retries=rollout.env_retries,
    )
    server.verify(examples[0])
    return server.make, server.served or name or "?"
