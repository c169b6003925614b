"""The config rules that depend on what a named part is, in one place, run once after parsing.

The schema (`vlmreg.config.schema`) checks shapes, types and ranges only. Here each plugin name of a parsed
`RunConfig` is looked up once in its registry (`resolve_specs`: task, rewards, objective, rollout engine, transport,
metrics sinks, environment), and `check_rules` judges the run against what those parts declare, never their names:
an `Engine` says whether it samples from a server apart (``server``), a `Transport` which servers it reaches, where
their GPU must be and whether they join a process group, an `Objective` whether it aggregates per-token terms.
A plugin's server engine therefore gets exactly the rules of the built-in ``openai`` one, ``server = "vllm"``
included. `vlmreg.config.resolve_config` runs both and keeps the specs on the `ResolvedConfig`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import attrs

from vlmreg.config.schema import RolloutSection, RunConfig
from vlmreg.sdk.registry import (
    get_engine_registry,
    get_environment_registry,
    get_objective_registry,
    get_reward_registry,
    get_sink_registry,
    get_task_registry,
    get_transport_registry,
)
from vlmreg.sdk.transport import NO_TRANSPORT

if TYPE_CHECKING:
    from vlmreg.sdk.engine import Engine
    from vlmreg.sdk.objective import Objective
    from vlmreg.sdk.reward import Reward
    from vlmreg.sdk.sink import MetricsSink
    from vlmreg.sdk.task import Task
    from vlmreg.sdk.transport import Transport

__all__ = ["SERVER_LABELS", "Specs", "check_rules", "resolve_specs", "transport_problems"]

#: What each ``[rollout] server`` kind is called in messages.
SERVER_LABELS = {"vlmreg": "vlmreg serve", "vllm": "vLLM"}
#: The ``[rollout] server`` default: what a config that does not choose a server kind says.
_DEFAULT_SERVER = attrs.fields(RolloutSection).server.default
#: ``[rollout]`` keys that only a launched vLLM takes (they become its command line).
_LAUNCHED_VLLM_ONLY = ("server_args", "gpu_memory_fraction")


@attrs.frozen
class Specs:
    """The registered parts a run config names, each looked up once (``None``: not named, or unknown and reported).

    ``task`` (``data.task``), ``rewards`` (name -> `Reward`: ``reward.functions``, else the task's), ``objective``
    (``trainer.algorithm``), ``engine`` (``rollout.engine``), ``transport`` (``broadcast.transport``; ``None`` for
    ``"none"``), ``sinks`` (``logging.sinks``, in order) and ``environment`` (``rollout.environment``, else ``None``:
    the task's own, or none).
    """

    task: Task | None = None
    rewards: Mapping[str, Reward] = attrs.field(factory=dict)
    objective: Objective | None = None
    engine: Engine | None = None
    transport: Transport | None = None
    sinks: tuple[MetricsSink, ...] = ()
    environment: Any = None


def _verb(key: str) -> str:
    return "are" if key.endswith("args") else "is"


def _problem(key: str, message: str, value: Any = None) -> str:
    return f"{key}: {message}" + (f" (got {value!r})" if value is not None else "")


def _lookup(registry: Any, name: str, key: str, problems: list[str], hint: str = "", value: bool = False) -> Any:
    """``registry.get(name)``, or ``None`` with the registry's did-you-mean message appended under ``key``."""
    try:
        return registry.get(name)
    except LookupError as exc:  # the Unknown*Error of each registry, with its suggestions
        problems.append(_problem(key, f"{exc}{hint}", name if value else None))
        return None


def resolve_specs(config: RunConfig, problems: list[str]) -> Specs:
    """Look every plugin name of ``config`` up once; each unknown one appends a problem (with suggestions)."""
    data, rollout, trainer = config.data, config.rollout, config.trainer
    task = _lookup(get_task_registry(), data.task, "data.task", problems) if data.task is not None else None
    rewards: dict[str, Reward] = {}
    if config.reward.functions is not None:
        where, names = "reward.functions", list(config.reward.functions)
    elif task is not None:
        where, names = f"data.task: the reward of task {task.name!r}", list(task.reward)
    else:
        where, names = "", []
        if data.paths:  # files carry no reward of their own: training would stop at its first step
            problems.append(
                "reward.functions: required when the data comes from files (name the reward functions and weights)"
            )
    reward_registry = get_reward_registry()
    for name in names:
        if name in reward_registry:
            rewards[name] = reward_registry.get(name)
        else:
            problems.append(f"{where}: {reward_registry.unknown_message(name)}")
    objective = _lookup(get_objective_registry(), trainer.algorithm, "trainer.algorithm", problems)
    vllm_hint = ' (vLLM is a server: engine = "openai", server = "vllm")' if rollout.engine.lower() == "vllm" else ""
    engine = _lookup(get_engine_registry(), rollout.engine, "rollout.engine", problems, vllm_hint)
    transport = None
    if config.broadcast.transport != NO_TRANSPORT:
        transport = _lookup(
            get_transport_registry(), config.broadcast.transport, "broadcast.transport", problems, value=True
        )
    sinks = [
        _lookup(get_sink_registry(), name, f"logging.sinks[{index}]", problems)
        for index, name in enumerate(config.logging.sinks)
    ]
    environment = None
    if rollout.environment is not None:
        environment = _lookup(
            get_environment_registry(), rollout.environment, "rollout.environment", problems, value=True
        )
    return Specs(
        task=task,
        rewards=rewards,
        objective=objective,
        engine=engine,
        transport=transport,
        sinks=tuple(s for s in sinks if s is not None),
        environment=environment,
    )


def check_rules(config: RunConfig, specs: Specs, problems: list[str]) -> None:
    """Judge ``config`` against what its parts declare; every problem is appended (a part that is unknown, already
    reported by `resolve_specs`, is not judged)."""
    _objective_rules(config, specs.objective, problems)
    if specs.engine is None:
        return
    if specs.engine.server:
        _server_engine_rules(config, specs.engine, problems)
        if specs.transport is not None:
            problems.extend(transport_problems(config, specs.transport))
    else:
        _in_trainer_engine_rules(config, specs.engine, problems)


def _objective_rules(config: RunConfig, objective: Objective | None, problems: list[str]) -> None:
    """``trainer.loss_aggregation`` needs an objective that aggregates per-token terms (one that normalises its own
    loss would ignore the key)."""
    aggregation = config.trainer.loss_aggregation
    if objective is not None and aggregation is not None and objective.aggregation is None:
        problems.append(
            f"trainer.loss_aggregation: objective {objective.name!r} normalises its own loss (its Objective declares "
            f"no aggregation), so {aggregation!r} would do nothing: remove the key, or give the Objective an "
            "aggregation and reduce its terms with vlmreg.train.losses.aggregate"
        )


def _transports() -> str:
    return ", ".join(get_transport_registry().names()) or "none is installed"


def _server_engine_rules(config: RunConfig, engine: Engine, problems: list[str]) -> None:
    """An engine that declares ``server = True`` (``openai`` or a plugin's): a server to attach to or launch, a
    transport to keep it on the trained weights, and the options of the server kind it runs."""
    rollout, name = config.rollout, engine.name
    if rollout.url is None and not rollout.launch:
        problems.append(
            _problem(
                "rollout.url",
                f'is required with engine = "{name}" (the server\'s base URL, e.g. '
                '"http://127.0.0.1:8000"), unless launch = true',
            )
        )
    if config.broadcast.transport == NO_TRANSPORT:
        problems.append(
            _problem(
                "broadcast.transport",
                f'must send the trained weights to the server with engine = "{name}" ({_transports()})',
                NO_TRANSPORT,
            )
        )
    launched_vllm = rollout.launch and rollout.server == "vllm"
    for key in _LAUNCHED_VLLM_ONLY:
        value = getattr(rollout, key)
        if value not in (None, []) and not launched_vllm:
            problems.append(
                _problem(f"rollout.{key}", f'{_verb(key)} for a launched vLLM (server = "vllm", launch = true)', value)
            )
    if launched_vllm and rollout.servers > 1 and rollout.launch_gpu == "same":
        problems.append(
            _problem(
                "rollout.servers", 'needs launch_gpu = "next": each launched vLLM gets GPUs of its own', rollout.servers
            )
        )


def _in_trainer_engine_rules(config: RunConfig, engine: Engine, problems: list[str]) -> None:
    """An engine that declares ``server = False`` (``embedded`` or a plugin's) runs in the trainer on its weights: no
    server, no server kind, nothing to send, nothing to run ahead of training."""
    rollout, name = config.rollout, engine.name
    in_trainer = f"engine = {name!r} runs in the trainer (no server)"
    for key in ("url", "launch"):
        value = getattr(rollout, key)
        if value:
            problems.append(
                _problem(
                    f"rollout.{key}",
                    f'is for a server engine (engine = "openai", or a plugin\'s that declares '
                    f"server = True); {in_trainer}",
                    value,
                )
            )
    if rollout.server != _DEFAULT_SERVER:
        problems.append(
            _problem("rollout.server", f"chooses the server of a server engine; {in_trainer}", rollout.server)
        )
    for key in _LAUNCHED_VLLM_ONLY:
        value = getattr(rollout, key)
        if value not in (None, []):
            problems.append(_problem(f"rollout.{key}", f"{_verb(key)} for a launched vLLM; {in_trainer}", value))
    if config.broadcast.transport != NO_TRANSPORT:
        problems.append(
            _problem(
                "broadcast.transport",
                f"is for a server engine; {in_trainer}, so the trained weights are already the ones it samples from",
                config.broadcast.transport,
            )
        )
    if config.trainer.max_off_policy_steps:
        problems.append(
            f"trainer.max_off_policy_steps: is {config.trainer.max_off_policy_steps}, but rollouts run ahead of "
            "training only with a "
            f'server engine (engine = "openai"); engine {name!r} samples from the weights being trained: set it to 0'
        )


def _either(names: list[str]) -> str:
    quoted = [f'"{n}"' for n in names]
    return "none" if not quoted else quoted[0] if len(quoted) == 1 else ", ".join(quoted[:-1]) + f" or {quoted[-1]}"


def transport_problems(config: RunConfig, spec: Transport) -> list[str]:
    """What ``[broadcast] transport`` rules out in ``[rollout]``, from the transport's declared properties: the server
    kinds it reaches (``Transport.servers``), where their GPU must be (``gpu``) and whether they join a process group
    the trainer hosts (``process_group``)."""
    rollout, port, name = config.rollout, config.broadcast.port, spec.name
    server, launch, servers = rollout.server, rollout.launch, rollout.server_count
    others = list(get_transport_registry())
    if server not in spec.servers:
        label = SERVER_LABELS.get(server, server)
        takes = _either([t.name for t in others if server in t.servers])
        where = " or ".join(f'rollout.server = "{s}"' for s in spec.servers) or "no server vlmreg starts or attaches to"
        return [_problem("broadcast.transport", f'is "{name}" only with {where} ({label} takes {takes})', name)]
    problems = []
    # where a launched vLLM runs is configurable; a launched vlmreg serve takes the next GPU
    if launch and server == "vllm":
        if spec.gpu == "same" and rollout.launch_gpu != "same":
            problems.append(
                _problem(
                    "rollout.launch_gpu",
                    f'must be "same" with broadcast.transport = "{name}" (it works between processes on one GPU only)',
                    rollout.launch_gpu,
                )
            )
        if spec.gpu == "separate" and rollout.launch_gpu == "same":
            same = _either([t.name for t in others if server in t.servers and t.gpu != "separate"])
            problems.append(
                _problem(
                    "broadcast.transport",
                    f'cannot be "{name}" with rollout.launch_gpu = "same": it needs a GPU of '
                    f"its own for the server; use {same}",
                    name,
                )
            )
    if servers > 1 and spec.gpu == "same":
        problems.append(
            _problem(
                "rollout.servers" if launch else "rollout.url",
                f'is one server only with broadcast.transport = "{name}" (it shares the trainer\'s GPU with one '
                "server)",
                servers,
            )
        )
    if spec.process_group and not launch and server == "vlmreg" and port == 0:
        problems.append(
            _problem(
                "broadcast.port",
                "must be fixed when the server is not launched by the trainer (start it with --weights-from HOST:PORT)",
                0,
            )
        )
    return problems
