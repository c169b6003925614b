"""Hooks are called through pluggy itself: tryfirst / trylast order and wrapper=True keep their meaning, while each
register call is still attributed to the plugin that made it and an error names the plugin at fault."""

from __future__ import annotations

import types

import pytest

import vlmreg
from vlmreg import FamilyDescriptor, Transport, hookimpl
from vlmreg.cli.plugins import plugin_records
from vlmreg.sdk.errors import PluginError
from vlmreg.sdk.registry import get_registry, get_transport_registry


def _family(name: str) -> FamilyDescriptor:
    return FamilyDescriptor(
        name=name,
        model_types=[f"{name}_vl"],
        vision_encoder_attr="v",
        language_model_attr="l",
        lm_head_attr="h",
        tiny_config=dict,
    )


def _plugin(**hooks) -> types.SimpleNamespace:
    return types.SimpleNamespace(**hooks)


@pytest.fixture
def added(vlmreg_add_plugin):
    return vlmreg_add_plugin


def test_tryfirst_trylast_and_wrappers_keep_their_meaning(added):
    calls: list[str] = []

    def maker(tag, **options):
        @hookimpl(**options)
        def vlmreg_register_families(register):
            calls.append(tag)
            register(_family(tag))

        return vlmreg_register_families

    @hookimpl(wrapper=True)
    def around(register):
        calls.append("wrapper-before")
        result = yield
        calls.append("wrapper-after")
        return result

    added(_plugin(vlmreg_register_families=maker("early", tryfirst=True)), "p-early")
    added(_plugin(vlmreg_register_families=maker("plain")), "p-plain")
    added(_plugin(vlmreg_register_families=maker("late", trylast=True)), "p-late")
    added(_plugin(vlmreg_register_families=around), "p-wrapper")
    registry = get_registry()
    ours = [c for c in calls]
    assert ours[0] == "wrapper-before" and ours[-1] == "wrapper-after"
    inner = [c for c in ours if not c.startswith("wrapper")]
    assert inner.index("early") < inner.index("plain") < inner.index("late")
    for tag in ("early", "plain", "late"):  # each registration is attributed to the plugin that made it
        assert registry.plugin_of(tag).name == f"p-{tag}"


def test_a_register_call_from_a_helper_is_attributed_and_an_error_names_the_plugin(added):
    def helper(register):
        register(_family("helped"))

    @hookimpl
    def good(register):
        helper(register)

    def broken_helper():
        raise ValueError("boom in a helper")

    @hookimpl
    def bad(register):
        broken_helper()

    added(_plugin(vlmreg_register_families=good), "p-good")
    assert get_registry().plugin_of("helped").name == "p-good"
    vlmreg.sdk.registry.reset_registry()
    added(_plugin(vlmreg_register_families=bad), "p-bad")
    with pytest.raises(
        PluginError, match=r"plugin 'p-bad'.*raised in vlmreg_register_families: ValueError: boom in a helper"
    ):
        get_registry()


def test_a_register_callback_kept_past_the_call_is_refused(added):
    kept = []

    @hookimpl
    def keep(register):
        kept.append(register)

    added(_plugin(vlmreg_register_families=keep), "p-keep")
    get_registry()
    with pytest.raises(PluginError, match="after the hook returned"):
        kept[0](_family("late-registration"))


def test_a_transport_goes_through_its_hook_like_any_registration_and_plugins_lists_it(added):
    calls: list[str] = []

    @hookimpl(tryfirst=True)
    def first(register):
        calls.append("first")
        register(Transport(name="carrier-pigeon", sender=dict, description="slow"))

    @hookimpl(wrapper=True)
    def around(register):
        calls.append("wrapper-before")
        result = yield
        calls.append("wrapper-after")
        return result

    added(_plugin(vlmreg_register_transports=first), "p-pigeon")
    added(_plugin(vlmreg_register_transports=around), "p-around")
    registry = get_transport_registry()
    assert calls == ["wrapper-before", "first", "wrapper-after"]
    assert (
        registry.plugin_of("carrier-pigeon").name == "p-pigeon"
        and registry.plugin_of("gloo").name == "vlmreg.transports"
    )
    records = {r["name"]: r for r in plugin_records()}
    assert records["p-pigeon"]["transports"] == ["carrier-pigeon"] and records["p-around"]["transports"] == []
    assert records["vlmreg.transports"]["transports"] == ["filesystem", "gloo", "ipc", "nccl"]
    assert "single_turn" in records["vlmreg.environments"]["environments"]  # every registry is listed per plugin
