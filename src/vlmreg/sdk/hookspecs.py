"""The hooks a vlmreg plugin may implement. Each spec's docstring is its whole contract.

A plugin is a module (or object) with functions decorated by `vlmreg.hookimpl` whose names are
listed here. It is found through the ``vlmreg`` entry-point group::

    [project.entry-points.vlmreg]
    my_family = "my_package"
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import pluggy

if TYPE_CHECKING:
    from vlmreg.sdk.descriptor import FamilyDescriptor
    from vlmreg.sdk.engine import Engine
    from vlmreg.sdk.environment import EnvironmentSpec
    from vlmreg.sdk.objective import Objective
    from vlmreg.sdk.reward import Reward
    from vlmreg.sdk.sink import MetricsSink
    from vlmreg.sdk.task import Task
    from vlmreg.sdk.transport import Transport

PROJECT = "vlmreg"

hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def vlmreg_register_families(register: Callable[[FamilyDescriptor], None]) -> None:
    """Register model families by calling ``register(FamilyDescriptor(...))`` once per family.

    Called once per process, the first time anything asks the registry for a family. A family name
    or ``model_type`` that another plugin already registered is an error naming both distributions.
    Keep this function cheap: do not import torch or transformers here (``tiny_config`` and
    ``tiny_processor`` are callables, evaluated only when a model is built).
    """


@hookspec
def vlmreg_register_tasks(register: Callable[[Task], None]) -> None:
    """Register training tasks by calling ``register(Task(...))`` once per task.

    A task generates its own examples (``Task.generate(n, seed, store)``) and names its reward. Called once
    per process, the first time a task is looked up. A task name registered twice is an error naming both
    distributions. vlmreg's bundled tasks register through this same hook, from a built-in plugin.
    """


@hookspec
def vlmreg_register_environments(register: Callable[[EnvironmentSpec], None]) -> None:
    """Register environments by calling ``register(EnvironmentSpec(...))`` once per environment.

    ``EnvironmentSpec.make(example, reward, store)`` returns one episode's environment: ``reset(example) -> messages``
    and ``step(completion) -> EnvStep``, each a plain or an ``async def`` (vlmreg runs a turn's calls concurrently,
    each bounded by ``[rollout] env_timeout_s``), and optionally ``close()``. ``store`` is the run's `ImageStore`, for
    the images of later turns. A task names one (``Task.environment = "name"``), ``[rollout] environment`` overrides
    it, ``vlmreg env serve NAME`` serves one over HTTP. vlmreg's own (``single_turn``, ``colour_turns``) register
    through this hook from built-in plugins. A name registered twice is an error naming both distributions. Keep it
    cheap.
    """


@hookspec
def vlmreg_register_objectives(register: Callable[[Objective], None]) -> None:
    """Register policy-gradient objectives by calling ``register(Objective(...))`` once per objective.

    ``[trainer] algorithm`` names one; an unknown name is a config error with suggestions. vlmreg's own (``grpo``,
    ``gspo``, ``dr_grpo``, ``cispo``, ``sapo``) register through this hook from the built-in plugin
    ``vlmreg.objectives``. An objective that declares an ``aggregation`` reduces its per-token terms with
    ``vlmreg.sdk.aggregate``, so ``[trainer] loss_aggregation`` applies to it. A name registered twice is an
    error naming both distributions. Keep it cheap: import torch inside the loss.
    """


@hookspec
def vlmreg_register_rewards(register: Callable[[Reward], None]) -> None:
    """Register reward functions by calling ``register(Reward(...))`` once per reward.

    ``[reward] functions`` and a task's ``reward`` name them; an unknown name is a config error with suggestions.
    ``Reward.fn(completion, answer) -> float`` may be an ``async def``: vlmreg awaits it on its event loop, several
    samples at once, each call bounded by ``Reward.timeout_s``. vlmreg's own (``exact_match``, ``first_word``,
    ``format``, ``math``, ``multiple_choice``) register through this hook from the built-in plugin ``vlmreg.rewards``.
    A name registered twice is an error naming both distributions. Keep it cheap: import heavy modules inside ``fn``.
    """


@hookspec
def vlmreg_register_rollout_engines(register: Callable[[Engine], None]) -> None:
    """Register rollout engines by calling ``register(Engine(...))`` once per engine.

    ``[rollout] engine`` names one; an unknown name is a config error with suggestions. vlmreg's own (``embedded``,
    ``openai``) register through this hook from the built-in plugin ``vlmreg.engines``. A ``server=True`` engine gets
    the trainer's server link (launch or attach, weight syncs) and its URL and API key in its build context. A name
    registered twice is an error naming both distributions. Keep it cheap: import torch inside ``build``.
    """


@hookspec
def vlmreg_register_metrics_sinks(register: Callable[[MetricsSink], None]) -> None:
    """Register metrics sinks by calling ``register(MetricsSink(...))`` once per sink.

    ``[logging] sinks`` names the ones a run writes to (``metrics.jsonl`` is always written); an unknown name is a
    config error with suggestions. vlmreg's own (``tensorboard``) registers through this hook from the built-in plugin
    ``vlmreg.sinks``. A name registered twice is an error naming both distributions. Import the sink's library
    inside ``open``.
    """


@hookspec
def vlmreg_register_transports(register: Callable[[Transport], None]) -> None:
    """Register weight transports by calling ``register(Transport(...))`` once per transport.

    ``[broadcast] transport`` names one (``"none"``: no transport); an unknown name is a config error with
    suggestions, and the transport's declared properties (the servers it works with, where the server's GPU must be,
    whether the server joins a process group) decide which ``[rollout]`` settings it takes. vlmreg's own (``gloo``,
    ``nccl``, ``filesystem``, ``ipc``) register through this hook from the built-in plugin ``vlmreg.transports``. A name
    registered twice is an error naming both distributions. Keep it cheap: import torch inside the factories.
    """
