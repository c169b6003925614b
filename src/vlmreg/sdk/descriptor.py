"""`FamilyDescriptor`: everything vlmreg knows about one model family, in one frozen value.

A plugin builds one descriptor per family and hands it to the ``register`` callback of
``vlmreg_register_families``. The core reads the descriptor and never branches on a family name.
Every field is checked when the descriptor is built; a bad value raises `DescriptorError`
naming the family and the field (the validators are `vlmreg.sdk.field_checks`'s, which the SDK's other specs share).
Nothing here imports torch or transformers.
"""

from __future__ import annotations

import fnmatch
import re
import types
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import attrs
from packaging.specifiers import InvalidSpecifier, SpecifierSet

from vlmreg.sdk.errors import DescriptorError
from vlmreg.sdk.field_checks import (
    IMPORT_RE,
    NAME_RE,
    PATH_RE,
    SUFFIX_RE,
    check_bool,
    check_callable,
    check_int,
    check_mapping,
    check_name,
    check_optional_pair,
    check_optional_path,
    check_optional_str,
    check_path,
    check_strings,
    check_type,
    check_weight_mapping,
    field_error,
    freeze,
)
from vlmreg.sdk.video import VideoSampling

__all__ = [
    "ALL_LINEAR",
    "LORA_SCOPES",
    "FamilyDescriptor",
    "LoraPreset",
    "ThinkingMode",
    "VisionTokens",
]

#: A LoRA module pattern meaning "every ``nn.Linear`` inside the preset's scopes".
ALL_LINEAR = "all-linear"
#: The parts of a model a LoRA preset may reach.
LORA_SCOPES = ("language_model", "vision_encoder", "connectors")

_PRESET_RE = re.compile(r"^[a-z0-9][a-z0-9_.+-]*$")


def _same_names(weights: Iterable[tuple[str, Any]]) -> Iterable[tuple[str, Any]]:
    """The default weight-name mapping: checkpoint names are the in-memory names."""
    return weights


def _callable_name(value: Any) -> str | None:
    if value is None:
        return None
    return f"{getattr(value, '__module__', '?')}:{getattr(value, '__qualname__', type(value).__name__)}"


@attrs.frozen(kw_only=True)
class LoraPreset:
    """A named set of LoRA targets, matched against the resolved parts of a model.

    ``modules`` are suffixes of module names, matched the way peft matches a list (a module matches
    ``out_proj`` when its name is ``out_proj`` or ends in ``.out_proj``), or `ALL_LINEAR`. ``parameters`` are
    suffixes of parameter names for peft's ``target_parameters`` (fused MoE experts). ``scopes`` limit the
    search to the language model, the vision encoder and/or the connectors. Resolution checks that every
    pattern matches at least one module or parameter inside its scopes.
    """

    modules: tuple[str, ...] = attrs.field(
        default=(),
        validator=check_strings(
            re.compile(rf"^({re.escape(ALL_LINEAR)}|{SUFFIX_RE.pattern[1:-1]})$"), "module name suffixes"
        ),
    )
    parameters: Sequence[str] = attrs.field(default=(), validator=check_strings(SUFFIX_RE, "parameter name suffixes"))
    scopes: Sequence[str] = attrs.field(
        default=("language_model",), validator=check_strings(None, "scopes", non_empty=True)
    )
    description: str = attrs.field(default="", validator=check_type(str, "a string"))

    @scopes.validator
    def _scopes_known(self, attribute: attrs.Attribute, value: Any) -> None:
        unknown = [s for s in value if s not in LORA_SCOPES]
        if unknown:
            raise field_error(
                self, attribute, f"may only name {', '.join(LORA_SCOPES)}; {unknown[0]!r} is not one", value
            )

    def __attrs_post_init__(self) -> None:
        if not self.modules and not self.parameters:
            raise DescriptorError(
                "LoraPreset: fields 'modules' and 'parameters' are both empty; a preset must target something"
            )
        freeze(self, modules=tuple(self.modules), parameters=tuple(self.parameters), scopes=tuple(self.scopes))

    @property
    def reaches_vision(self) -> bool:
        """Whether the preset adapts modules of the vision encoder (not only its connectors)."""
        return "vision_encoder" in self.scopes


@attrs.frozen(eq=False)
class ThinkingMode:
    """One thinking mode of a family and how it reaches the chat template.

    ``chat_template_kwargs`` are passed to ``apply_chat_template`` when the mode is on (for example
    ``{"enable_thinking": False}``). ``checkpoints`` are glob patterns on the checkpoint's name or path
    (for example ``"*-Thinking*"``; ``"!pattern"`` excludes) saying which checkpoints have this mode;
    empty means every checkpoint. A random init has the empty name ``""``.
    """

    name: str = attrs.field(validator=check_name)
    chat_template_kwargs: Mapping[str, Any] = attrs.field(
        factory=dict, validator=check_mapping(lambda k: isinstance(k, str), object, "keyword arguments")
    )
    checkpoints: Sequence[str] = attrs.field(default=(), validator=check_strings(None, "glob patterns"))

    def __attrs_post_init__(self) -> None:
        freeze(
            self,
            chat_template_kwargs=types.MappingProxyType(dict(self.chat_template_kwargs)),
            checkpoints=tuple(self.checkpoints),
        )

    def available_for(self, checkpoint: str | None) -> bool:
        """Whether a checkpoint (by name or path; ``None`` for a random init) has this mode.

        A pattern starting with ``!`` excludes: ``("*", "!*-Thinking*")`` is every checkpoint but the thinking ones.
        """
        if not self.checkpoints:
            return True
        name = checkpoint or ""
        base = name.rstrip("/").rsplit("/", 1)[-1]

        def hit(pattern: str) -> bool:
            return fnmatch.fnmatch(name, pattern) or fnmatch.fnmatch(base, pattern)

        included = any(hit(p) for p in self.checkpoints if not p.startswith("!"))
        return included and not any(hit(p[1:]) for p in self.checkpoints if p.startswith("!"))


@attrs.frozen
class VisionTokens:
    """The special tokens that mark images (and videos) in the family's prompts."""

    image: str = attrs.field(validator=check_type(str, "a string"))
    video: str | None = attrs.field(default=None, validator=check_optional_str)
    start: str | None = attrs.field(default=None, validator=check_optional_str)
    end: str | None = attrs.field(default=None, validator=check_optional_str)


def _default_lora_presets(has_connectors: bool) -> dict[str, LoraPreset]:
    """Presets that name no module: every linear layer of the language model, or of every part."""
    scopes = (
        ("language_model", "vision_encoder", "connectors") if has_connectors else ("language_model", "vision_encoder")
    )
    return {
        "language": LoraPreset(modules=(ALL_LINEAR,), description="every linear layer of the language model"),
        "all-linear": LoraPreset(
            modules=(ALL_LINEAR,), scopes=scopes, description="every linear layer, vision encoder included"
        ),
    }


def _is_preset_name(key: Any) -> bool:
    return isinstance(key, str) and bool(_PRESET_RE.match(key))


@attrs.frozen(eq=False, kw_only=True)
class FamilyDescriptor:
    """The single source of truth for one model family.

    Required: ``name``, ``model_types``, ``vision_encoder_attr``, ``language_model_attr``, ``lm_head_attr``
    and ``tiny_config``. Paths are dotted attribute paths on the loaded model (the object
    ``from_pretrained`` returns). The broadcast weight prefix is derived: ``{language_model_attr}.{layers_attr}.``.
    See ``docs/reference.md`` for every field. A ``Sequence[str]`` field takes a list or a tuple and holds a tuple.
    """

    name: str = attrs.field(validator=check_name)
    model_types: Sequence[str] = attrs.field(validator=check_strings(NAME_RE, "model_type names", non_empty=True))
    vision_encoder_attr: str = attrs.field(validator=check_path)
    language_model_attr: str = attrs.field(validator=check_path)
    lm_head_attr: str = attrs.field(validator=check_path)
    tiny_config: Callable[[], Any] = attrs.field(validator=check_callable(optional=False))

    layers_attr: str = attrs.field(default="layers", validator=check_path)
    connector_attrs: Sequence[str] = attrs.field(default=(), validator=check_strings(PATH_RE, "dotted attribute paths"))
    connector_parameters: Sequence[str] = attrs.field(
        default=(), validator=check_strings(PATH_RE, "dotted parameter paths")
    )
    vision_blocks_attr: str | None = attrs.field(default=None, validator=check_optional_path)
    lora_presets: Mapping[str, LoraPreset] = attrs.field(
        default=None,
        validator=attrs.validators.optional(check_mapping(_is_preset_name, LoraPreset, "preset names to LoraPreset")),
    )
    default_lora_preset: str = attrs.field(default="language", validator=check_type(str, "a preset name"))
    supports_vision: bool = attrs.field(default=True, validator=check_bool)
    max_images_per_message: int = attrs.field(default=1, validator=check_int(0))
    max_videos_per_message: int = attrs.field(default=0, validator=check_int(0))
    video_placeholder: str | None = attrs.field(default=None, validator=check_optional_str)
    video_sampling: VideoSampling = attrs.field(
        factory=VideoSampling, validator=check_type(VideoSampling, "a VideoSampling")
    )
    vision_processor_id: str | None = attrs.field(default=None, validator=check_optional_str)
    vision_processor_ids: Mapping[str, str] = attrs.field(
        factory=dict,
        validator=check_mapping(lambda k: isinstance(k, str) and bool(k), str, "checkpoint patterns to processor ids"),
    )
    thinking_modes: tuple[ThinkingMode, ...] = attrs.field(default=())
    default_thinking_mode: str | None = attrs.field(default=None, validator=check_optional_str)
    default_thinking_budget: int | None = attrs.field(default=None, validator=check_int(1, optional=True))
    vision_tokens: VisionTokens | None = attrs.field(
        default=None, validator=check_type(VisionTokens, "a VisionTokens", optional=True)
    )
    image_placeholder: str | None = attrs.field(default=None, validator=check_optional_str)
    turn_end_tokens: Sequence[str] = attrs.field(default=(), validator=check_strings(None, "token strings"))
    thinking_end: str | None = attrs.field(default=None, validator=check_optional_str)
    thinking_start: str | None = attrs.field(default=None, validator=check_optional_str)
    collate_images: Callable[[Sequence[Mapping[str, Any]]], Mapping[str, Any]] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable taking the images' list of input dicts")
    )
    processor_layout: Callable[[Mapping[str, Any]], Mapping[str, Any]] | None = attrs.field(
        default=None,
        validator=check_callable(optional=True, what="a callable taking one prompt's collated image tensors"),
    )
    packing: bool = attrs.field(default=True, validator=check_bool)
    prefix_lm: str | None = attrs.field(default=None, validator=check_optional_str)
    transformers_range: str = attrs.field(default="", validator=check_type(str, "a version specifier string"))
    model_class: str | None = attrs.field(default=None)
    tiny_processor: Callable[[], Any] | None = attrs.field(default=None, validator=check_callable(optional=True))
    load_processor: Callable[[Any], Any] | None = attrs.field(default=None, validator=check_callable(optional=True))
    engine_processor: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable taking the training processor")
    )
    shapes: Mapping[str, Callable[[], Any]] = attrs.field(
        factory=dict,
        validator=check_mapping(
            lambda k: isinstance(k, str) and bool(NAME_RE.match(k)) and k != "tiny",
            Callable,  # type: ignore[arg-type]  # isinstance takes Callable; its type hint says type
            "shape names (not 'tiny') to zero-argument config functions",
        ),
    )
    position_ids: Callable[[Any, Mapping[str, Any]], Any] | None = attrs.field(
        default=None, validator=check_callable(optional=True)
    )
    prepare_model: Callable[[Any], Any] | None = attrs.field(default=None, validator=check_callable(optional=True))
    #: ``(vision encoder, image inputs on the host) -> {image input name: keyword arguments}``: what the encoder's
    #: forward would derive from that input on the device, derived on the host (`vlmreg.modeling.vision_calls`)
    vision_call_inputs: Callable[[Any, Mapping[str, Any]], Mapping[str, Mapping[str, Any]]] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable (vision encoder, image inputs) -> dict")
    )
    init_random_weights: Callable[[Any], Any] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable taking the model")
    )
    checkpoint_weights: Callable[[Iterable[tuple[str, Any]]], Iterable[tuple[str, Any]]] = attrs.field(
        default=_same_names, validator=check_weight_mapping
    )
    memory_weights: Callable[[Iterable[tuple[str, Any]]], Iterable[tuple[str, Any]]] = attrs.field(
        default=_same_names, validator=check_weight_mapping
    )
    #: ``(processor, image) -> image``: an image as a rollout server gets it, the trainer's processor's own resize done
    #: first, so a server whose processor resizes otherwise (transformers' torchvision backend, which vLLM's
    #: ``AutoProcessor`` takes where torchvision is installed) sees the trainer's pixels; ``None``: sent as stored
    engine_image: Callable[[Any, Any], Any] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable (processor, image) -> image")
    )
    #: ``(processor, frames) -> frames``: a video's sampled frames as a rollout server gets them, resized beforehand
    #: exactly as the trainer's processor resizes them (as ``engine_image`` for images); ``None``: sent as stored
    engine_video: Callable[[Any, Sequence[Any]], Sequence[Any]] | None = attrs.field(
        default=None, validator=check_callable(optional=True, what="a callable (processor, frames) -> frames")
    )
    #: ``(before, after)``: text the family's processor keeps around a video's expansion and vLLM's replaces away (its
    #: prompt update takes the template's whole video markup); sent to vLLM around each video, so its prompt is the
    #: processor's. ``None``: nothing is added
    vllm_video_wrapper: tuple[str, str] | None = attrs.field(default=None, validator=check_optional_pair)
    vllm_unsupported: str | None = attrs.field(default=None, validator=check_optional_str)
    #: flags every vLLM that serves this family needs (a vLLM bug's workaround, say), put before ``rollout.server_args``
    vllm_args: tuple[str, ...] = attrs.field(
        default=(), validator=check_strings(None, "command-line arguments", unique=False)
    )
    description: str = attrs.field(default="", validator=check_type(str, "a string"))

    @thinking_modes.validator
    def _thinking_modes_valid(self, attribute: attrs.Attribute, value: Any) -> None:
        if isinstance(value, ThinkingMode) or not isinstance(value, (list, tuple)):
            raise field_error(self, attribute, "must be a list of ThinkingMode", value)
        if not all(isinstance(m, ThinkingMode) for m in value):
            raise field_error(self, attribute, "must be a list of ThinkingMode", value)
        names = [m.name for m in value]
        if len(set(names)) != len(names):
            raise field_error(self, attribute, "names a mode more than once", names)

    @model_class.validator
    def _model_class_valid(self, attribute: attrs.Attribute, value: Any) -> None:
        if value is not None and (not isinstance(value, str) or not IMPORT_RE.match(value)):
            raise field_error(self, attribute, "must be None or an import path 'package.module:ClassName'", value)

    @transformers_range.validator
    def _range_valid(self, attribute: attrs.Attribute, value: str) -> None:
        try:
            SpecifierSet(value)
        except InvalidSpecifier:
            raise field_error(self, attribute, "must be a version specifier such as '>=5.17,<6'", value) from None

    @layers_attr.validator
    def _layers_relative(self, attribute: attrs.Attribute, value: str) -> None:
        if value.startswith(self.language_model_attr + "."):
            raise field_error(self, attribute, "is relative to language_model_attr; drop the leading path", value)

    @vision_blocks_attr.validator
    def _blocks_relative(self, attribute: attrs.Attribute, value: str | None) -> None:
        if value is not None and value.startswith(self.vision_encoder_attr + "."):
            raise field_error(self, attribute, "is relative to vision_encoder_attr; drop the leading path", value)

    def __attrs_post_init__(self) -> None:
        if self.lora_presets is None:  # the defaults reach the connectors only when there are some
            freeze(self, lora_presets=_default_lora_presets(bool(self.connector_attrs)))
        if self.default_lora_preset not in self.lora_presets:
            raise DescriptorError(
                f"FamilyDescriptor {self.name!r}: field 'default_lora_preset' names {self.default_lora_preset!r}, "
                f"which is not in lora_presets ({', '.join(sorted(self.lora_presets))})"
            )
        modes = [m.name for m in self.thinking_modes]
        if self.default_thinking_mode is not None and self.default_thinking_mode not in modes:
            raise DescriptorError(
                f"FamilyDescriptor {self.name!r}: field 'default_thinking_mode' names {self.default_thinking_mode!r}, "
                f"which is not in thinking_modes ({', '.join(modes) or 'none'})"
            )
        if self.thinking_start is not None and self.thinking_end is None:
            raise DescriptorError(
                f"FamilyDescriptor {self.name!r}: field 'thinking_start' ({self.thinking_start!r}) needs thinking_end, "
                "the marker that closes it"
            )
        if self.prefix_lm and self.packing:
            raise DescriptorError(
                f"FamilyDescriptor {self.name!r}: field 'prefix_lm' needs packing=False: a packed row attends causally "
                "within each sample, and the bidirectional attention over each sample's prompt that prefix_lm asks "
                f"for (through the input {self.prefix_lm!r}) is built by transformers' own mask, which only padded "
                "micro-batches get"
            )
        if self.prefix_lm and self.max_videos_per_message:
            raise DescriptorError(
                f"FamilyDescriptor {self.name!r}: field 'prefix_lm' needs max_videos_per_message=0 (got "
                f"{self.max_videos_per_message}): a prefix-LM prompt is its processor's own encoding of the text with "
                "its images, and vlmreg hands that processor images only"
            )
        if not self.supports_vision and self.max_videos_per_message:
            raise DescriptorError(
                f"FamilyDescriptor {self.name!r}: field 'max_videos_per_message' must be 0 when supports_vision is "
                f"False (got {self.max_videos_per_message})"
            )
        if not self.supports_vision and self.max_images_per_message:
            raise DescriptorError(
                f"FamilyDescriptor {self.name!r}: field 'max_images_per_message' must be 0 when supports_vision is "
                f"False (got {self.max_images_per_message})"
            )
        freeze(
            self,
            model_types=tuple(self.model_types),
            turn_end_tokens=tuple(self.turn_end_tokens),
            connector_attrs=tuple(self.connector_attrs),
            connector_parameters=tuple(self.connector_parameters),
            lora_presets=types.MappingProxyType(dict(self.lora_presets)),
            vision_processor_ids=types.MappingProxyType(dict(self.vision_processor_ids)),
            thinking_modes=tuple(self.thinking_modes),
            shapes=types.MappingProxyType(dict(self.shapes)),
            vllm_video_wrapper=tuple(self.vllm_video_wrapper) if self.vllm_video_wrapper is not None else None,
        )

    @property
    def weight_prefix(self) -> str:
        """The in-memory name prefix of the decoder layers: ``{language_model_attr}.{layers_attr}.``."""
        return f"{self.language_model_attr}.{self.layers_attr}."

    @property
    def layers_path(self) -> str:
        """The dotted path of the decoder layers' ModuleList on the loaded model."""
        return f"{self.language_model_attr}.{self.layers_attr}"

    @property
    def transformers_specifier(self) -> SpecifierSet:
        return SpecifierSet(self.transformers_range)

    def processor_id_for(self, checkpoint: str | None) -> str | None:
        """The processor to load for a checkpoint: the first matching ``vision_processor_ids`` entry, else the
        default."""
        if checkpoint is not None:
            base = checkpoint.rstrip("/").rsplit("/", 1)[-1]
            for pattern, processor_id in self.vision_processor_ids.items():
                if fnmatch.fnmatch(checkpoint, pattern) or fnmatch.fnmatch(base, pattern):
                    return processor_id
        return self.vision_processor_id

    def config_for_size(self, size: str) -> Any:
        """A config of the named shape (``"tiny"``: ``tiny_config``) for a random init; ``KeyError`` if unknown."""
        if size == "tiny":
            return self.tiny_config()
        return self.shapes[size]()

    def thinking_modes_for(self, checkpoint: str | None) -> tuple[ThinkingMode, ...]:
        """The thinking modes a checkpoint (``None``: a random init) offers."""
        return tuple(m for m in self.thinking_modes if m.available_for(checkpoint))

    def summary(self) -> dict[str, Any]:
        """A JSON-ready view of the descriptor (what ``vlmreg families --json`` prints)."""
        return {
            "name": self.name,
            "model_types": list(self.model_types),
            "vision_encoder_attr": self.vision_encoder_attr,
            "language_model_attr": self.language_model_attr,
            "lm_head_attr": self.lm_head_attr,
            "connector_attrs": list(self.connector_attrs),
            "connector_parameters": list(self.connector_parameters),
            "vision_blocks_attr": self.vision_blocks_attr,
            "layers_attr": self.layers_attr,
            "weight_prefix": self.weight_prefix,
            "supports_vision": self.supports_vision,
            "max_images_per_message": self.max_images_per_message,
            "max_videos_per_message": self.max_videos_per_message,
            "video_placeholder": self.video_placeholder,
            "video_sampling": attrs.asdict(self.video_sampling),
            "vision_processor_id": self.vision_processor_id,
            "vision_processor_ids": dict(self.vision_processor_ids),
            "lora_presets": {
                name: {"modules": list(p.modules), "parameters": list(p.parameters), "scopes": list(p.scopes)}
                for name, p in self.lora_presets.items()
            },
            "default_lora_preset": self.default_lora_preset,
            "thinking_modes": [
                {
                    "name": m.name,
                    "chat_template_kwargs": dict(m.chat_template_kwargs),
                    "checkpoints": list(m.checkpoints),
                }
                for m in self.thinking_modes
            ],
            "default_thinking_mode": self.default_thinking_mode,
            "default_thinking_budget": self.default_thinking_budget,
            "vision_tokens": attrs.asdict(self.vision_tokens) if self.vision_tokens else None,
            "image_placeholder": self.image_placeholder,
            "turn_end_tokens": list(self.turn_end_tokens),
            "thinking_end": self.thinking_end,
            "thinking_start": self.thinking_start,
            "collate_images": _callable_name(self.collate_images),
            "processor_layout": _callable_name(self.processor_layout),
            "packing": self.packing,
            "prefix_lm": self.prefix_lm,
            "transformers_range": self.transformers_range,
            "model_class": self.model_class,
            "shapes": ["tiny", *self.shapes],
            "engine_image": _callable_name(self.engine_image),
            "engine_video": _callable_name(self.engine_video),
            "vllm_video_wrapper": list(self.vllm_video_wrapper) if self.vllm_video_wrapper else None,
            "vllm_unsupported": self.vllm_unsupported,
            "vllm_args": list(self.vllm_args),
            "description": self.description,
        }
