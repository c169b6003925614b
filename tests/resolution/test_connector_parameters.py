"""connector_parameters: bare parameters of the connector, resolved strictly, trained, frozen and sent with it."""

from __future__ import annotations

import attrs
import pytest
import torch
from torch import nn

import vlmreg
from vlmreg.broadcast import WeightPlan
from vlmreg.sdk.errors import ResolutionError
from vlmreg.sdk.registry import get_registry
from vlmreg.testing import tiny_model


def _with_newline(resolve_path: str | None = "model.image_newline"):
    """A real tiny Qwen3-VL given a bare parameter at the model level, as LLaVA's ``model.image_newline``."""
    model = tiny_model("qwen3_vl")
    model.model.image_newline = nn.Parameter(torch.randn(model.config.text_config.hidden_size))
    paths = () if resolve_path is None else (resolve_path,)
    return model, attrs.evolve(get_registry().get("qwen3_vl"), connector_parameters=paths)


def test_a_bare_parameter_resolves_and_is_sent_with_the_connectors():
    model, descriptor = _with_newline()
    resolved = vlmreg.resolve(model, family=descriptor)
    assert resolved.connector_parameters["model.image_newline"] is model.model.image_newline
    model.model.visual.requires_grad_(False)
    plan = dict(WeightPlan.from_resolved(resolved, include_frozen_vision=False).memory_tensors())
    assert plan["model.image_newline"] is model.model.image_newline
    model.model.image_newline.requires_grad_(False)
    assert "model.image_newline" not in dict(
        WeightPlan.from_resolved(resolved, include_frozen_vision=False).memory_tensors()
    )
    assert "model.image_newline" in dict(
        WeightPlan.from_resolved(resolved, include_frozen_vision=True).memory_tensors()
    )


def test_without_the_field_the_bare_parameter_is_not_sent():
    model, descriptor = _with_newline(None)
    plan = dict(
        WeightPlan.from_resolved(vlmreg.resolve(model, family=descriptor), include_frozen_vision=True).memory_tensors()
    )
    assert "model.image_newline" not in plan


def test_a_missing_parameter_names_the_field_and_what_exists():
    model, descriptor = _with_newline("model.image_newlin")
    with pytest.raises(
        ResolutionError,
        match=r"connector_parameters = 'model.image_newlin' does not resolve.*Did you mean 'image_newline'",
    ):
        vlmreg.resolve(model, family=descriptor)
    model, descriptor = _with_newline("model.nowhere.image_newline")
    with pytest.raises(ResolutionError, match="connector_parameters = 'model.nowhere.image_newline' does not resolve"):
        vlmreg.resolve(model, family=descriptor)


def test_a_module_is_not_a_parameter():
    model, descriptor = _with_newline("model.visual")
    with pytest.raises(ResolutionError, match="model .* has no parameter 'visual' of its own"):
        vlmreg.resolve(model, family=descriptor)


def test_a_parameter_under_a_named_part_is_refused():
    model, descriptor = _with_newline("model.language_model.norm.weight")
    with pytest.raises(ResolutionError, match="lies under 'model.language_model'"):
        vlmreg.resolve(model, family=descriptor)
