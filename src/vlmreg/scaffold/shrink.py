"""A tiny config of a ``model_type``: its default transformers config with small sizes, as keyword arguments.

`tiny_config_spec` starts from ``AutoConfig.for_model(model_type)`` (what the real class builds by default), shrinks
the size fields of the text and vision parts (layers, hidden sizes, heads, experts, image size) and any other size
field that equalled the default hidden size of one part (a projector's output, a top-level ``hidden_size``), then
finds the fewest keyword arguments that rebuild exactly that config: the fields a composite config sets differently
from its sub-config class's own defaults must be written out. Each field an author must check carries a note, which
the plugin template renders as a ``# TODO(vlmreg new-family)`` comment.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import attrs

from vlmreg.sdk.errors import VlmregError

__all__ = ["ConfigSpec", "Field", "tiny_config_spec"]

TEXT = {"hidden": 64, "intermediate": 128, "heads": 4, "head_dim": 16, "small_intermediate": 32}
VISION = {"hidden": 32, "intermediate": 64, "heads": 2, "head_dim": 16, "small_intermediate": 32}
LAYERS = 2
IMAGE_PATCHES_PER_SIDE = 4

_LAYER_KEYS = ("num_hidden_layers", "num_layers", "depth", "n_layers")
_HIDDEN_KEYS = ("hidden_size", "d_model", "embed_dim", "n_embd")
_INTERMEDIATE_KEYS = ("intermediate_size", "ffn_dim", "mlp_dim", "n_inner")
_SMALL_INTERMEDIATE_KEYS = ("moe_intermediate_size", "shared_expert_intermediate_size")
_HEAD_KEYS = ("num_attention_heads", "num_heads", "n_head")
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")
_TOKENS_PER_IMAGE = re.compile(r"image.*(token|seq|length)|token.*image")
_IGNORED = {"transformers_version", "_name_or_path", "architectures", "dtype", "torch_dtype", "model_type"}
_TOKEN_ID = re.compile(r"(^|_)(token_id|token_index|token_ids)$")
_SIZE_LIKE = re.compile(r"hidden|dim|proj|embed")

TOKEN_NOTE = "this token's id in your tiny processor's vocabulary"
VOCAB_NOTE = "your tiny processor's vocabulary size (it must fit the embeddings); a small one keeps tests fast"
IMAGE_NOTE = "must match your tiny processor's image processor"


@attrs.frozen
class Field:
    """One keyword argument of the tiny config, with a note for the author (empty when there is nothing to check)."""

    key: str
    value: Any
    note: str = ""


@attrs.frozen
class ConfigSpec:
    """The tiny config as code: ``config_class(**top, **{name: {model_type, **fields}})``."""

    config_class: str
    model_type: str
    top: tuple[Field, ...]
    sub_configs: tuple[tuple[str, str | None, tuple[Field, ...]], ...]

    def kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {f.key: f.value for f in self.top}
        for name, model_type, fields in self.sub_configs:
            sub = {"model_type": model_type} if model_type else {}
            kwargs[name] = {**sub, **{f.key: f.value for f in fields}}
        return kwargs

    def build(self) -> Any:
        # deferred: start-up cost (loads transformers)
        import transformers  # noqa: PLC0415

        return getattr(transformers, self.config_class)(**self.kwargs())


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _literal(value: Any) -> bool:
    try:
        return ast.literal_eval(repr(value)) == value
    except (ValueError, SyntaxError, TypeError):
        return False


def _shrink_part(values: dict[str, Any], sizes: dict[str, int], notes: dict[str, str], kind: str) -> dict[str, int]:
    """Shrink one config's size fields in place; returns the default hidden size it had (for the equal-size rule)."""
    default_hidden = next((values[k] for k in _HIDDEN_KEYS if _is_int(values.get(k))), None)
    heads_before = next((values[k] for k in _HEAD_KEYS if _is_int(values.get(k))), None)
    layer_types = values.get("layer_types")
    layers = LAYERS
    if isinstance(layer_types, list) and layer_types:
        kinds = list(dict.fromkeys(layer_types))
        layers = max(LAYERS, len(kinds))
        values["layer_types"] = kinds + [kinds[-1]] * (layers - len(kinds))
        if len(kinds) > 1:
            notes["layer_types"] = (
                f"one layer of each kind the default config uses ({', '.join(map(str, kinds))}); check the pattern "
                "fields"
            )
    for key in _LAYER_KEYS:
        if _is_int(values.get(key)):
            values[key] = layers
    for key in _HIDDEN_KEYS:
        if _is_int(values.get(key)):
            values[key] = sizes["hidden"]
    for key in _INTERMEDIATE_KEYS:
        if _is_int(values.get(key)):
            values[key] = sizes["intermediate"]
    for key in _SMALL_INTERMEDIATE_KEYS:
        if _is_int(values.get(key)):
            values[key] = sizes["small_intermediate"]
    for key in _HEAD_KEYS:
        if _is_int(values.get(key)):
            values[key] = sizes["heads"]
    if _is_int(values.get("num_key_value_heads")):
        kv = values["num_key_value_heads"]
        values["num_key_value_heads"] = sizes["heads"] if kv == heads_before else 1 if kv == 1 else 2
    if _is_int(values.get("head_dim")):
        values["head_dim"] = sizes["hidden"] // sizes["heads"]
    for key in _EXPERT_KEYS:
        if _is_int(values.get(key)) and values[key] > 4:
            values[key] = 4
    if _is_int(values.get("num_experts_per_tok")) and values["num_experts_per_tok"] > 2:
        values["num_experts_per_tok"] = 2
    if kind == "vision" and _is_int(values.get("patch_size")) and _is_int(values.get("image_size")):
        merge = values.get("spatial_merge_size") if _is_int(values.get("spatial_merge_size")) else 1
        values["image_size"] = values["patch_size"] * IMAGE_PATCHES_PER_SIDE * merge
        notes["image_size"] = notes["patch_size"] = IMAGE_NOTE
    return {"hidden": default_hidden} if default_hidden else {}


def _equal_size_rule(
    values: dict[str, Any], handled: set[str], defaults: dict[str, tuple[int, int, str]], notes: dict[str, str]
) -> None:
    """A size field not shrunk yet that equalled a part's default hidden size becomes that part's tiny hidden size."""
    for key, value in list(values.items()):
        if key in handled or not _is_int(value) or not _SIZE_LIKE.search(key):
            continue
        for part, (before, after, _) in defaults.items():
            if value == before:
                values[key] = after
                notes[key] = f"was {before}, the default {part} hidden size; set to the tiny {part} hidden size, check"
                break


def _part_kind(name: str) -> str:
    return (
        "vision"
        if re.search(r"vision|visual|image", name)
        else "text"
        if re.search(r"text|language|llm", name)
        else "other"
    )


def _default_values(config: Any) -> dict[str, Any]:
    return {k: v for k, v in config.to_dict().items() if k not in _IGNORED and not isinstance(v, dict)}


def _note_ids(values: dict[str, Any], notes: dict[str, str]) -> None:
    for key, value in values.items():
        if _TOKEN_ID.search(key) and (value is None or _is_int(value) or isinstance(value, list)):
            notes.setdefault(key, TOKEN_NOTE)


def tiny_config_spec(model_type: str) -> ConfigSpec:
    """The tiny config of ``model_type`` as keyword arguments of its config class, with notes for the author."""
    # deferred: start-up cost (loads transformers)
    import transformers  # noqa: PLC0415
    from transformers import AutoConfig  # noqa: PLC0415

    default = AutoConfig.for_model(model_type)
    config_class = type(default).__name__
    if not hasattr(transformers, config_class):
        raise VlmregError(f"transformers does not export {config_class}, the config class of {model_type!r}")
    sub_names = [name for name in getattr(default, "sub_configs", {}) if getattr(default, name, None) is not None]

    parts: dict[str, tuple[dict[str, Any], dict[str, str], Any]] = {}
    hidden_defaults: dict[str, tuple[int, int, str]] = {}
    for name in sub_names:
        sub = getattr(default, name)
        values = _default_values(sub)
        notes: dict[str, str] = {}
        kind = _part_kind(name)
        before = _shrink_part(values, VISION if kind != "text" else TEXT, notes, kind)
        if before and kind in ("text", "vision") and kind not in hidden_defaults:
            hidden_defaults[kind] = (before["hidden"], (TEXT if kind == "text" else VISION)["hidden"], name)
        parts[name] = (values, notes, sub)
    top_values = _default_values(default)
    top_notes: dict[str, str] = {}
    if not sub_names:  # a config with no parts: it is the language model
        before = _shrink_part(top_values, TEXT, top_notes, "text")
        if before:
            hidden_defaults["text"] = (before["hidden"], TEXT["hidden"], "")

    shrunk_keys = set(
        _LAYER_KEYS
        + _HIDDEN_KEYS
        + _INTERMEDIATE_KEYS
        + _SMALL_INTERMEDIATE_KEYS
        + _HEAD_KEYS
        + ("head_dim", "num_key_value_heads")
    )
    for name, (values, notes, _) in parts.items():
        _equal_size_rule(values, shrunk_keys, hidden_defaults, notes)
        _note_ids(values, notes)
        if "vocab_size" in values and _part_kind(name) == "text":
            notes["vocab_size"] = VOCAB_NOTE
    _equal_size_rule(top_values, shrunk_keys if not sub_names else set(), hidden_defaults, top_notes)
    _note_ids(top_values, top_notes)
    if "vocab_size" in top_values:
        top_notes["vocab_size"] = VOCAB_NOTE
    _tokens_per_image(top_values, top_notes, parts, default)
    _feature_layer(top_values, top_notes, parts)

    # The fewest fields that rebuild this config: changed ones, noted ones, then whatever the rebuild gets wrong.
    top_default = _default_values(default)
    top_keys = {k for k in top_values if top_values[k] != top_default.get(k) or k in top_notes}
    sub_keys: dict[str, set[str]] = {}
    for name, (values, notes, sub) in parts.items():
        try:
            own = _default_values(type(sub)())
        except Exception:
            own = {}
        sub_keys[name] = {k for k in values if values[k] != own.get(k, object()) or k in notes}

    def spec() -> ConfigSpec:
        top = tuple(Field(k, top_values[k], top_notes.get(k, "")) for k in top_values if k in top_keys)
        subs = tuple(
            (
                name,
                getattr(sub, "model_type", None) or None,
                tuple(Field(k, values[k], notes.get(k, "")) for k in values if k in sub_keys[name]),
            )
            for name, (values, notes, sub) in parts.items()
        )
        return ConfigSpec(config_class, model_type, top, subs)

    for _ in range(4):
        try:
            built = spec().build()
        except Exception as exc:
            raise VlmregError(f"cannot build a tiny {config_class}: {type(exc).__name__}: {exc}") from exc
        wrong_top = {k for k, v in _default_values(built).items() if k in top_values and v != top_values[k]}
        wrong_sub = {
            name: {k for k, v in _default_values(getattr(built, name)).items() if k in values and v != values[k]}
            for name, (values, _, _) in parts.items()
        }
        if not wrong_top and not any(wrong_sub.values()):
            break
        top_keys |= wrong_top
        for name, keys in wrong_sub.items():
            sub_keys[name] |= keys
    else:
        raise VlmregError(
            f"cannot rebuild the tiny {config_class} from keyword arguments (fields {sorted(wrong_top)} {wrong_sub})"
        )
    result = spec()
    unwritable = [f.key for f in result.top if not _literal(f.value)] + [
        f.key for _, _, fields in result.sub_configs for f in fields if not _literal(f.value)
    ]
    if unwritable:
        raise VlmregError(
            f"the tiny {config_class} has fields that cannot be written as Python literals: {', '.join(unwritable)}"
        )
    return result


def _tokens_per_image(top: dict[str, Any], notes: dict[str, str], parts: dict[str, Any], default: Any) -> None:
    """Fields counting an image's tokens follow the tiny image size when they matched the default one."""
    vision = next((getattr(default, n) for n in parts if _part_kind(n) == "vision"), None)
    tiny = next((values for n, (values, _, _) in parts.items() if _part_kind(n) == "vision"), None)
    if (
        vision is None
        or tiny is None
        or not _is_int(getattr(vision, "patch_size", None))
        or not _is_int(getattr(vision, "image_size", None))
    ):
        return
    per_image = (vision.image_size // vision.patch_size) ** 2
    tiny_per_image = (tiny["image_size"] // tiny["patch_size"]) ** 2
    for values, field_notes in [(top, notes), *((v, n) for v, n, _ in parts.values())]:
        for key in [k for k in values if _TOKENS_PER_IMAGE.search(k) and not _TOKEN_ID.search(k)]:
            if _is_int(values.get(key)):
                if values[key] == per_image:
                    values[key] = tiny_per_image
                field_notes[key] = f"tokens per image; {IMAGE_NOTE}"


def _feature_layer(top: dict[str, Any], notes: dict[str, str], parts: dict[str, Any]) -> None:
    """A vision layer index (``*feature_layer*`` fields) must exist in the tiny vision tower."""
    key = next((k for k in top if "feature_layer" in k), None)
    if key is None:
        return
    value = top[key]
    if _is_int(value) and value >= LAYERS:
        top[key] = LAYERS - 1
    if _is_int(value) and value < -(LAYERS + 1):
        top[key] = -1
    if isinstance(value, list):
        top[key] = [min(v, LAYERS - 1) if v >= 0 else max(v, -(LAYERS + 1)) for v in value if _is_int(v)]
    if _is_int(value) or isinstance(value, list):
        notes[key] = f"the vision layer(s) feeding the projector, within the tiny tower's {LAYERS} layers; check"
