"""Property: any TOML document gives a RunConfig or a ConfigError, never another exception."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from vlmreg.config import ConfigError, RunConfig, parse_config
from vlmreg.config.resolve import resolve_config

KEYS = [
    "model",
    "rollout",
    "trainer",
    "data",
    "broadcast",
    "logging",
    "vlm",
    "lora",
    "name",
    "init",
    "family",
    "size",
    "dtype",
    "r",
    "alpha",
    "dropout",
    "targets",
    "scopes",
    "exclude",
    "group_size",
    "temperature",
    "top_p",
    "steps",
    "algorithm",
    "seq_len",
    "task",
    "paths",
    "format",
    "transport",
    "level",
    "thinking_mode",
    "max_images_per_step",
    "freeze_vision_encoder",
    "connector_attrs",
    "random",
    "qwen3_vl",
    "xyz",
]
scalars = st.one_of(
    st.booleans(),
    st.integers(-5, 10**6),
    st.floats(allow_nan=False, allow_infinity=True),
    st.sampled_from(KEYS),
    st.text(max_size=12),
)
values = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.sampled_from(KEYS), inner, max_size=5)),
    max_leaves=20,
)
documents = st.dictionaries(st.sampled_from(KEYS), values, max_size=6)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(documents)
def test_any_document_is_a_config_or_a_config_error(document):
    try:
        config = parse_config(document)
    except ConfigError as exc:
        assert exc.problems and all(isinstance(p, str) and p for p in exc.problems)
        return
    assert isinstance(config, RunConfig)


model_tables = st.fixed_dictionaries(
    {"init": st.sampled_from(["random", "pretrained"]), "family": st.sampled_from(["qwen3_vl", "qwen3_5", "nope"])},
    optional={
        "lora": st.dictionaries(st.sampled_from(["r", "targets", "scopes"]), values, max_size=3),
        "size": st.sampled_from(["tiny", "2b", "x"]),
    },
)


@settings(max_examples=150, deadline=None)
@given(
    model_tables,
    st.dictionaries(
        st.sampled_from(["thinking_mode", "max_images_per_step", "use_vision", "image_only_mode"]), scalars, max_size=3
    ),
)
def test_resolution_also_only_raises_config_errors(model, rollout):
    try:
        resolve_config(parse_config({"model": model, "rollout": rollout}))
    except ConfigError as exc:
        assert exc.problems
