"""Weight transports are a registry: vlmreg's own register from the built-in plugin like a third party's, and the config
checks read each transport's declared properties (servers, GPU placement, process group), never its name."""

from __future__ import annotations

import types

import pytest

from vlmreg import Transport, hookimpl
from vlmreg.config import ConfigError, parse_config
from vlmreg.config.resolve import resolve_config
from vlmreg.sdk.errors import DescriptorError, RegistryConflictError, UnknownTransportError
from vlmreg.sdk.registry import get_transport_registry


def _sender(ctx):
    raise AssertionError("not built by a config check")


def _receiver(ctx):
    raise AssertionError("not built by a config check")


def _plugin(*transports: Transport) -> types.SimpleNamespace:
    @hookimpl
    def vlmreg_register_transports(register):
        for transport in transports:
            register(transport)

    return types.SimpleNamespace(vlmreg_register_transports=vlmreg_register_transports)


def problems(transport: str, **rollout) -> list[str]:
    document = {
        "model": {"init": "random", "family": "qwen3_vl"},
        "rollout": {"engine": "openai", **({"launch": True} if "url" not in rollout else {}), **rollout},
        "broadcast": {"transport": transport},
    }
    try:
        resolve_config(parse_config(document))
    except ConfigError as exc:
        return [" ".join(p.split()) for p in exc.problems]
    return []


def test_the_built_ins_come_from_the_built_in_plugin_with_their_properties():
    registry = get_transport_registry()
    assert registry.names() == ["filesystem", "gloo", "ipc", "nccl"]
    assert {registry.plugin_of(n).name for n in registry.names()} == {"vlmreg.transports"}
    assert {
        n: (registry.get(n).servers, registry.get(n).gpu, registry.get(n).process_group) for n in registry.names()
    } == {
        "filesystem": (["vlmreg"], "any", False),
        "gloo": (["vlmreg", "vllm"], "any", True),
        "ipc": (["vllm"], "same", False),
        "nccl": (["vlmreg", "vllm"], "separate", True),
    }


def test_an_unknown_name_gets_the_registry_s_did_you_mean():
    with pytest.raises(UnknownTransportError, match=r"Unknown transport 'glo'\. Did you mean 'gloo'\?"):
        get_transport_registry().get("glo")
    assert problems("ncl") == [
        (
            "broadcast.transport: Unknown transport 'ncl'. Did you mean 'nccl'? Transports: filesystem, gloo, ipc, "
            "nccl ('none': no weights are sent) (got 'ncl')"
        )
    ]


def test_a_transport_spec_is_checked_when_made():
    with pytest.raises(DescriptorError, match="may not be 'none'"):
        Transport(name="none", sender=_sender)
    with pytest.raises(DescriptorError, match="field 'gpu' must be one of 'any', 'same', 'separate'"):
        Transport(name="x", sender=_sender, gpu="other")
    with pytest.raises(DescriptorError, match="field 'receiver' must be a callable taking a ReceiverContext or None"):
        Transport(name="x", sender=_sender, receiver="module.function")


def test_a_name_taken_twice_names_both_plugins(vlmreg_add_plugin):
    vlmreg_add_plugin(_plugin(Transport(name="gloo", sender=_sender)), "p-clash")
    with pytest.raises(Exception) as failure:
        get_transport_registry()
    assert isinstance(failure.value, RegistryConflictError) or isinstance(
        failure.value.__cause__, RegistryConflictError
    )
    assert "transport 'gloo' is registered twice" in str(failure.value) and "p-clash" in str(failure.value)


def test_the_built_in_rules_follow_from_declared_properties(vlmreg_add_plugin):
    # the built-ins' messages, read from their properties
    assert problems("ipc") == [
        (
            'broadcast.transport: is "ipc" only with rollout.server = "vllm" (vlmreg serve takes "filesystem", "gloo" '
            "or "
            "\"nccl\") (got 'ipc')"
        )
    ]
    assert problems("filesystem", server="vllm") == [
        (
            'broadcast.transport: is "filesystem" only with rollout.server = "vlmreg" (vLLM takes "gloo", "ipc" or '
            "\"nccl\") (got 'filesystem')"
        )
    ]
    assert problems("gloo", server="vllm", launch_gpu="same") == []
    assert problems("gloo", url="http://127.0.0.1:8000") == [
        (
            "broadcast.port: must be fixed when the server is not launched by the trainer (start it with "
            "--weights-from HOST:PORT) (got 0)"
        )
    ]
    # a plugin's transports with the same properties get the same rules, under their own names
    vlmreg_add_plugin(
        _plugin(
            Transport(name="shared_gpu", sender=_sender, vllm_receiver=_receiver, gpu="same"),
            Transport(name="own_gpu", sender=_sender, receiver=_receiver, vllm_receiver=_receiver, gpu="separate"),
            Transport(name="group", sender=_sender, receiver=_receiver, process_group=True),
            Transport(name="anywhere", sender=_sender, receiver=_receiver, vllm_receiver=_receiver),
        ),
        "p-transports",
    )
    assert problems("shared_gpu")[0].startswith(
        'broadcast.transport: is "shared_gpu" only with rollout.server = "vllm" (vlmreg serve takes'
    )
    assert problems("shared_gpu", server="vllm") == [
        (
            'rollout.launch_gpu: must be "same" with broadcast.transport = "shared_gpu" (it works between processes on '
            "one GPU only) (got 'next')"
        )
    ]
    assert problems("shared_gpu", server="vllm", launch_gpu="same") == []
    assert problems("own_gpu", server="vllm", launch_gpu="same")[0].startswith(
        'broadcast.transport: cannot be "own_gpu" with rollout.launch_gpu = "same": it needs a GPU of its own for the '
        "server; use"
    )
    assert problems("own_gpu", server="vllm") == problems("own_gpu") == []
    assert problems("group", url="http://127.0.0.1:8000")[0].startswith("broadcast.port: must be fixed")
    assert problems("group", url="http://127.0.0.1:8000", server="vllm")[0].startswith(
        'broadcast.transport: is "group" only with rollout.server = "vlmreg"'
    )
    assert (
        problems("anywhere", url="http://127.0.0.1:8000")
        == problems("anywhere", server="vllm", launch_gpu="same")
        == []
    )
