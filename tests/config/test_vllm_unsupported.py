"""A family that says vLLM cannot serve it (``vllm_unsupported``): `vlmreg show` prints why, and a run config with
``rollout.server = "vllm"`` is refused with that reason. The family is a third party's (the example tiny LLaVA plugin's
descriptor, registered in process under another name), as any plugin would declare it."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

import attrs
import pytest

from vlmreg import DescriptorError, FamilyDescriptor, hookimpl
from vlmreg.cli import main
from vlmreg.config import parse_config
from vlmreg.config.load import ConfigError
from vlmreg.config.resolve import resolve_config

PLUGIN_SRC = Path(__file__).resolve().parents[2] / "examples" / "plugins" / "vlmreg-tiny-llava" / "src"
REASON = "vLLM 0.24.0 refuses the checkpoint: 'AcmeProjector' is not a supported projector (seen 2026-11-26)"


@pytest.fixture
def acme(vlmreg_add_plugin, monkeypatch):
    """Family ``acme_llava``: the example plugin's LLaVA descriptor, declaring vLLM cannot serve it."""
    # not the installed example plugin, which claims model_type llava too
    monkeypatch.setenv("VLMREG_PLUGINS", "qwen3_vl")
    monkeypatch.syspath_prepend(str(PLUGIN_SRC))
    llava = importlib.import_module("vlmreg_tiny_llava")

    class Acme:
        @hookimpl
        def vlmreg_register_families(self, register):
            llava.vlmreg_register_families(
                lambda d: register(attrs.evolve(d, name="acme_llava", vllm_unsupported=REASON))
            )

    vlmreg_add_plugin(Acme(), "acme")
    return "acme_llava"


def run(server: str, family: str):
    return resolve_config(
        parse_config(
            {
                "model": {"init": "random", "family": family},
                "trainer": {"device": "cpu"},
                "rollout": {"engine": "openai", "server": server, "launch": True},
                "broadcast": {"transport": "gloo"},
            }
        )
    )


def test_a_run_with_vllm_is_refused_with_the_family_s_reason(acme):
    with pytest.raises(ConfigError) as caught:
        run("vllm", acme)
    message = str(caught.value)
    assert f'rollout.server: "vllm" cannot serve family acme_llava: {REASON}' in message
    assert caught.value.problems == [
        (
            f'rollout.server: "vllm" cannot serve family acme_llava: {REASON} (use server = "vlmreg", or engine = '
            '"embedded")'
        )
    ]
    assert run("vlmreg", acme).family.name == "acme_llava"  # the same family served by vlmreg serve is fine


def test_a_family_without_the_field_runs_with_vllm(acme):
    assert run("vllm", "qwen3_vl").family.vllm_unsupported is None


def test_show_prints_the_reason(acme, capsys):
    assert main(["show", acme]) == 0
    text = " ".join(capsys.readouterr().out.split())
    assert f"vllm_unsupported {REASON}" in text
    assert main(["show", acme, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm_unsupported"] == REASON
    assert main(["show", "qwen3_vl", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["vllm_unsupported"] is None


def test_an_empty_reason_is_a_descriptor_error():
    with pytest.raises(DescriptorError, match="field 'vllm_unsupported' must be None or a non-empty string"):
        FamilyDescriptor(
            name="toy",
            model_types=["toy_vl"],
            vision_encoder_attr="model.vision",
            language_model_attr="model.text",
            lm_head_attr="lm_head",
            tiny_config=lambda: None,
            vllm_unsupported="",
        )
