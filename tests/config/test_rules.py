"""The config rules that depend on what a part is (`vlmreg.config.rules`): driven by what each registered part declares,
never by its name, run once after parsing; each plugin name looked up once and kept on the resolved config."""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

import pytest

import vlmreg.config.schema
from vlmreg import Engine, hookimpl
from vlmreg.cli import main
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.inference.vllm_server import vllm_command
from vlmreg.sdk import registry as registry_module

MODEL = {"init": "random", "family": "qwen3_vl"}


def _build(ctx):
    raise AssertionError("a config check never builds the engine")


@pytest.fixture
def engines(vlmreg_add_plugin):
    """Two plugin engines, registered through the hook as an installed plugin's would be: ``remote`` samples from a
    server apart (``server = True``, as ``openai`` declares), ``local`` runs in the trainer (as ``embedded``)."""

    class MyEngines:
        @hookimpl
        def vlmreg_register_rollout_engines(self, register):
            register(Engine(name="remote", build=_build, server=True, description="a server engine of a plugin"))
            register(Engine(name="local", build=_build, description="an in-trainer engine of a plugin"))

    vlmreg_add_plugin(MyEngines(), "my-engines")


def problems(engine: str, rollout: dict | None = None, broadcast: str = "none", **sections) -> list[str]:
    document = {
        "model": MODEL,
        "rollout": {"engine": engine, **(rollout or {})},
        "broadcast": {"transport": broadcast},
        **sections,
    }
    try:
        resolve_config(parse_config(document))
    except ConfigError as exc:
        return sorted(" ".join(p.split()) for p in exc.problems)
    return []


def test_a_plugin_server_engine_runs_a_launched_vllm_under_openais_rules(engines, capsys):
    launched_vllm = {
        "server": "vllm",
        "launch": True,
        "launch_gpu": "same",
        "gpu_memory_fraction": 0.5,
        "server_args": ["--enforce-eager"],
    }
    rc = resolve_config(
        parse_config(
            {
                "model": MODEL,
                "rollout": {"engine": "remote", **launched_vllm},
                "broadcast": {"transport": "ipc"},
                "trainer": {"max_off_policy_steps": 1},
            }
        )
    )
    assert rc.specs.engine.name == "remote" and rc.specs.engine.server and rc.specs.transport.name == "ipc"
    assert rc.config.rollout.server == "vllm" and rc.config.rollout.launch
    # the launched vLLM is started from the plugin engine's config exactly as from openai's
    as_openai = resolve_config(
        parse_config(
            {"model": MODEL, "rollout": {"engine": "openai", **launched_vllm}, "broadcast": {"transport": "ipc"}}
        )
    )
    command = vllm_command(rc, "/ckpt", 8123, "bfloat16", 4096)
    assert command == vllm_command(as_openai, "/ckpt", 8123, "bfloat16", 4096)
    assert command[-1] == "--enforce-eager" and command[command.index("--gpu-memory-utilization") + 1] == "0.5"
    assert (
        main(
            [
                "validate",
                "examples/configs/qwen3_vl_tiny.toml",
                "--set",
                "rollout.engine=remote",
                "--set",
                "rollout.server=vllm",
                "--set",
                "rollout.launch=true",
                "--set",
                "broadcast.transport=gloo",
            ]
        )
        == 0
    ), capsys.readouterr().err


# Each case breaks one rule of a server engine; the plugin's engine must get exactly what openai gets, under its own
# name.
SERVER_CASES = {
    "nothing to reach": ({}, "none"),
    "no transport": ({"launch": True}, "none"),
    "ipc needs the same GPU": ({"server": "vllm", "launch": True}, "ipc"),
    "nccl needs its own GPU": ({"server": "vllm", "launch": True, "launch_gpu": "same"}, "nccl"),
    "filesystem is for vlmreg serve": ({"server": "vllm", "launch": True}, "filesystem"),
    "ipc is for vLLM": ({"launch": True}, "ipc"),
    "server_args unlaunched": (
        {"server": "vllm", "url": "http://127.0.0.1:8000", "server_args": ["--enforce-eager"]},
        "gloo",
    ),
    "memory fraction of vlmreg serve": ({"launch": True, "gpu_memory_fraction": 0.5}, "gloo"),
    "several vLLMs on one GPU": ({"server": "vllm", "launch": True, "launch_gpu": "same", "servers": 2}, "gloo"),
    "an attached group without a port": ({"url": "http://127.0.0.1:8000"}, "gloo"),
}


@pytest.mark.parametrize("case", SERVER_CASES, ids=list(SERVER_CASES))
def test_a_plugin_server_engine_is_refused_as_openai_is(engines, case):
    rollout, transport = SERVER_CASES[case]
    found = problems("remote", rollout, transport)
    assert found, "every case breaks a rule"
    assert found == [
        p.replace('engine = "openai"', 'engine = "remote"') for p in problems("openai", rollout, transport)
    ]


IN_TRAINER_CASES = {
    "a url": ({"url": "http://127.0.0.1:8000"}, "none"),
    "a launch": ({"launch": True}, "none"),
    "a server kind": ({"server": "vllm"}, "none"),
    "server_args": ({"server_args": ["--enforce-eager"]}, "none"),
    "a transport": ({}, "gloo"),
}


@pytest.mark.parametrize("case", IN_TRAINER_CASES, ids=list(IN_TRAINER_CASES))
def test_a_plugin_in_trainer_engine_is_refused_as_embedded_is(engines, case):
    rollout, transport = IN_TRAINER_CASES[case]
    found = problems("local", rollout, transport)
    assert found and all("engine = 'local' runs in the trainer" in p for p in found), found
    assert found == [p.replace("'embedded'", "'local'") for p in problems("embedded", rollout, transport)]


def test_the_parts_are_looked_up_once_and_kept_on_the_resolved_config(monkeypatch):
    looked_up: Counter[tuple[str, str]] = Counter()
    original = registry_module._NamedRegistry.get

    def counted(self, name):
        looked_up[(self.kind, name)] += 1
        return original(self, name)

    monkeypatch.setattr(registry_module._NamedRegistry, "get", counted)
    rc = resolve_config(
        parse_config(
            {
                "model": MODEL,
                "data": {"task": "colour_turns"},
                "logging": {"sinks": ["tensorboard"]},
                "rollout": {"engine": "openai", "launch": True, "environment": "colour_turns", "thinking_budget": None},
                "broadcast": {"transport": "filesystem"},
                "trainer": {"algorithm": "gspo"},
            }
        )
    )
    assert max(looked_up.values()) == 1, looked_up
    specs = rc.specs
    assert (specs.task.name, specs.objective.name, specs.engine.name, specs.transport.name) == (
        "colour_turns",
        "gspo",
        "openai",
        "filesystem",
    )
    assert [s.name for s in specs.sinks] == ["tensorboard"] and specs.environment.name == "colour_turns"
    assert list(specs.rewards) == list(specs.task.reward) and all(r.name == n for n, r in specs.rewards.items())


def test_parsing_checks_shapes_only_and_the_rules_run_after_it():
    """An unknown environment or transport, and an engine's rules, are for `resolve_config`: parsing looks no name
    up."""
    config = parse_config(
        {
            "model": MODEL,
            "rollout": {"environment": "nowhere", "url": "http://127.0.0.1:8000"},
            "broadcast": {"transport": "tcp"},
        }
    )
    assert (config.rollout.environment, config.broadcast.transport) == ("nowhere", "tcp")
    found = " ".join(problems("embedded", {"environment": "nowhere"}, "tcp"))
    assert (
        "rollout.environment: Unknown environment 'nowhere'" in found
        and "broadcast.transport: Unknown transport 'tcp'" in found
    )


def _calls_a_registry(node: ast.AST) -> list[str]:
    found = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call):
            name = sub.func.attr if isinstance(sub.func, ast.Attribute) else getattr(sub.func, "id", "")
            if name.startswith("get_") and name.endswith("registry"):
                found.append(f"line {sub.lineno}: {name}()")
        if isinstance(sub, ast.ImportFrom) and sub.module and sub.module.endswith("registry"):
            found.append(f"line {sub.lineno}: from {sub.module} import ...")
    return found


def test_no_field_check_in_the_schema_looks_a_registry_up():
    source = Path(vlmreg.config.schema.__file__).read_text(encoding="utf-8")
    assert _calls_a_registry(ast.parse(source)) == []
    # the scan itself finds what it looks for
    assert _calls_a_registry(
        ast.parse(
            "def check(v):\n    from vlmreg.sdk.registry import get_task_registry\n    get_task_registry().get(v)\n"
        )
    ) == ["line 2: from vlmreg.sdk.registry import ...", "line 3: get_task_registry()"]
