"""Fill a `RunConfig` with what the family descriptor knows, and reject what contradicts it.

The result, `ResolvedConfig`, records which values came from the descriptor (``from_family``) so
``vlmreg config --resolved`` can mark them, where the processor comes from (`ProcessorSource`), and the registered
parts the config names (``specs``, looked up once by `vlmreg.config.rules`, whose rules run here too).
A checkpoint is a local directory or a Hub id, reached through the local Hugging Face cache as transformers
reaches it (downloading what is missing unless ``HF_HUB_OFFLINE=1``). Nothing here imports torch.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import attrs

from vlmreg.config.hub import METADATA_FILES, hub_snapshot, is_hub_id, read_model_type
from vlmreg.config.load import ConfigError, blame_sets
from vlmreg.config.rules import Specs, check_rules, resolve_specs
from vlmreg.config.schema import RunConfig
from vlmreg.sdk.descriptor import FamilyDescriptor, ThinkingMode
from vlmreg.sdk.errors import UnknownFamilyError, VlmregError, did_you_mean
from vlmreg.sdk.registry import get_registry

__all__ = [
    "METADATA_FILES",
    "PROCESSOR_FILES",
    "WEIGHT_FILES",
    "ProcessorSource",
    "ResolvedConfig",
    "Specs",
    "check_names",
    "find_checkpoint",
    "find_processor",
    "hub_snapshot",
    "is_hub_id",
    "missing_processor_files",
    "resolve_config",
]

#: What loading adds: safetensors weights (pickle files are never fetched nor loaded).
WEIGHT_FILES = ("*.safetensors", "*.safetensors.index.json")
_VOCABULARIES = ("vocab.json", "tokenizer.model", "vocab.txt")
#: The files a processor is made of (any one present means the directory meant to hold a processor).
PROCESSOR_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    *_VOCABULARIES,
    "merges.txt",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
)


@attrs.frozen
class ProcessorSource:
    """Where the processor comes from.

    ``kind``: ``"checkpoint"`` (the checkpoint's own directory), ``"model.processor"`` (the config names it),
    ``"family"`` (the family's processor id for this checkpoint, because the checkpoint has no processor files)
    or ``"tiny"`` (the family's tiny processor, for a random init). ``name`` is the path or Hub id (``None`` for
    ``tiny``), ``directory`` the local directory it is loaded from, ``note`` one line saying where it came from.
    """

    kind: Literal["checkpoint", "model.processor", "family", "tiny"]
    name: str | None
    directory: Path | None
    note: str


@attrs.frozen
class ResolvedConfig:
    """A run config with the family's values filled in, the family itself, the checkpoint's directory, the processor's
    source, and ``specs``: the registered parts the config names (task, rewards, objective, engine, transport, sinks,
    environment), each looked up once; read them here rather than asking a registry again."""

    config: RunConfig
    family: FamilyDescriptor
    checkpoint_dir: Path | None
    from_family: dict[str, str]
    source: str = "<config>"
    processor: ProcessorSource | None = None
    specs: Specs = attrs.field(factory=Specs)

    @property
    def checkpoint_name(self) -> str | None:
        """The checkpoint's name as written (a Hub id or a path); ``None`` for a random init."""
        return self.config.model.name

    @property
    def thinking_mode(self) -> ThinkingMode | None:
        """The run's thinking mode (``rollout.thinking_mode``, resolved), or ``None`` when the checkpoint has none."""
        name = self.config.rollout.thinking_mode
        return next((m for m in self.family.thinking_modes if m.name == name), None)

    @property
    def chat_template_kwargs(self) -> dict[str, Any]:
        """What the thinking mode passes to ``apply_chat_template`` (empty when the mode is the checkpoint's own)."""
        mode = self.thinking_mode
        return dict(mode.chat_template_kwargs) if mode is not None else {}


def find_checkpoint(name: str) -> Path:
    """A local directory holding ``config.json``: ``name`` itself, or the Hugging Face cache's snapshot of the Hub id
    ``name`` (its config, tokenizer and processor files downloaded as transformers would, unless offline)."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise VlmregError(f"{path} has no config.json; is it a transformers checkpoint directory?")
        return path
    if is_hub_id(name):
        snapshot = hub_snapshot(name)
        if not (snapshot / "config.json").is_file():
            raise VlmregError(f"{name!r} (cached at {snapshot}) has no config.json; is it a transformers checkpoint?")
        return snapshot
    raise VlmregError(f"{name!r}: no such checkpoint directory")


def find_processor(name: str) -> Path:
    """The local directory of a processor: ``name`` itself, or the Hugging Face cache's snapshot of the Hub id
    ``name``."""
    path = Path(name).expanduser()
    if path.is_dir():
        return path
    if is_hub_id(name):
        return hub_snapshot(name)
    raise VlmregError(f"{name!r}: no such processor directory")


def _has_chat_template(directory: Path) -> bool:
    if any((directory / f).is_file() for f in ("chat_template.jinja", "chat_template.json")):
        return True
    if any(directory.glob("additional_chat_templates/*.jinja")):
        return True
    for config in ("tokenizer_config.json", "processor_config.json"):
        try:
            if json.loads((directory / config).read_text(encoding="utf-8")).get("chat_template"):
                return True
        except (OSError, ValueError, AttributeError):
            continue
    return False


def missing_processor_files(directory: Path, vision: bool) -> list[str]:
    """What a processor directory lacks for loading: tokenizer files, a chat template, and (``vision``) an image
    processor config; one entry per missing part, naming the files that would do."""
    missing = []
    has = {name: (directory / name).is_file() for name in PROCESSOR_FILES}
    if not has["tokenizer.json"]:
        if has["tokenizer_config.json"] and has["vocab.json"] and not has["merges.txt"]:
            missing.append("merges.txt (beside vocab.json)")
        elif not (has["tokenizer_config.json"] and any(has[v] for v in _VOCABULARIES)):
            missing.append(
                "tokenizer.json (or tokenizer_config.json with vocab.json + merges.txt, tokenizer.model or vocab.txt)"
            )
    if vision and not (has["preprocessor_config.json"] or has["processor_config.json"]):
        missing.append("preprocessor_config.json (or processor_config.json)")
    if not _has_chat_template(directory):
        missing.append(
            'a chat template (chat_template.json, chat_template.jinja, or "chat_template" in tokenizer_config.json)'
        )
    return missing


def _where(name: str, directory: Path) -> str:
    return str(directory) if Path(name).expanduser().is_dir() else f"{name!r} (cached at {directory})"


def _processor(
    model: Any, family: FamilyDescriptor, checkpoint_dir: Path | None, problems: list[str]
) -> ProcessorSource | None:
    """Where the processor comes from, checked to hold what loading needs; problems are appended, not raised."""
    vision = family.supports_vision
    if model.processor is not None:
        try:
            directory = find_processor(model.processor)
        except VlmregError as exc:
            problems.append(f"model.processor: {exc}")
            return None
        missing = missing_processor_files(directory, vision)
        if missing:
            problems.append(f"model.processor: {_where(model.processor, directory)} lacks {'; '.join(missing)}")
            return None
        return ProcessorSource("model.processor", model.processor, directory, "the config (model.processor)")
    if model.init == "random":
        if family.tiny_processor is None:
            problems.append(
                f"model.processor: family {family.name} has no tiny processor for a random init; "
                "set model.processor to a processor directory or Hub id"
            )
            return None
        return ProcessorSource("tiny", None, None, f"family {family.name}, its tiny processor (random init)")
    if checkpoint_dir is None:
        return None  # model.name is already reported
    where = _where(model.name, checkpoint_dir)
    missing = missing_processor_files(checkpoint_dir, vision)
    if not missing:
        return ProcessorSource("checkpoint", model.name, checkpoint_dir, "the checkpoint directory")
    processor_id = family.processor_id_for(model.name)
    if any((checkpoint_dir / f).is_file() for f in PROCESSOR_FILES) or processor_id is None:
        problems.append(
            f"model.name: {where} lacks {'; '.join(missing)}. Add them (the base checkpoint has them), or set "
            "model.processor"
        )
        return None
    # A checkpoint saved without any processor files (a model-only save): the family's processor for its name.
    try:
        directory = find_processor(processor_id)
        lacking = missing_processor_files(directory, vision)
        if lacking:
            raise VlmregError(f"{_where(processor_id, directory)} lacks {'; '.join(lacking)}")
    except VlmregError as exc:
        problems.append(
            f"model.name: {where} has no processor files (it lacks {'; '.join(missing)}), and family {family.name}'s "
            f"processor for it, {processor_id!r}, cannot be used: {exc}. Set model.processor"
        )
        return None
    base = model.name.rstrip("/").rsplit("/", 1)[-1]
    note = f"family {family.name}, its processor for checkpoint {base!r} (the checkpoint has no processor files)"
    return ProcessorSource("family", processor_id, directory, note)


def _family(config: RunConfig, problems: list[str]) -> tuple[FamilyDescriptor | None, Path | None]:
    model = config.model
    registry = get_registry()
    checkpoint_dir = None
    model_type = None
    if model.init == "pretrained" and model.name is not None:
        try:
            checkpoint_dir = find_checkpoint(model.name)
            model_type = read_model_type(checkpoint_dir)
        except VlmregError as exc:
            problems.append(f"model.name: {exc}")
            return None, None
    try:
        if model.family is not None:
            family = registry.get(model.family)
        elif model_type is not None:
            family = registry.for_model_type(model_type)
        else:
            return None, None
    except UnknownFamilyError as exc:
        problems.append(f"model.{'family' if model.family else 'name'}: {exc}")
        return None, None
    if model_type is not None and model_type not in family.model_types:
        problems.append(
            f"model.family: {family.name!r} claims {', '.join(family.model_types)}, but the checkpoint's model_type "
            f"is {model_type!r} (family {registry.for_model_type(model_type).name!r} if installed); drop model.family"
        )
        return family, None  # the wrong family: its processor is not looked for
    return family, checkpoint_dir


def _check_image_roots(config: RunConfig, source: str, problems: list[str]) -> None:
    """Each ``data.image_roots`` entry must be an existing folder; relative ones are resolved against the config
    file's folder (left to data loading when ``source`` is not a file, as the folder is not known here)."""
    config_file = Path(source)
    base = config_file.resolve().parent if config_file.is_file() else None
    for index, entry in enumerate(config.data.image_roots):
        root = Path(entry).expanduser()
        if not root.is_absolute():
            if base is None:
                continue
            root = base / root
        where = repr(entry) if str(root) == entry else f"{entry!r} (looked for {root})"
        if not root.exists():
            problems.append(f"data.image_roots[{index}]: {where} does not exist; list existing image folders")
        elif not root.is_dir():
            problems.append(f"data.image_roots[{index}]: {where} is not a directory; list image folders")


def check_names(config: RunConfig, source: str, problems: list[str]) -> Specs:
    """The checks that do not read ``[model]``: every plugin name looked up once (`resolve_specs`), the rules of what
    those parts declare (`check_rules`) and the image folders; problems are appended. Returns the parts found."""
    specs = resolve_specs(config, problems)
    check_rules(config, specs, problems)
    _check_image_roots(config, source, problems)
    return specs


def resolve_config(config: RunConfig, source: str = "<config>", sets: Sequence[str] = ()) -> ResolvedConfig:
    """Fill descriptor-known values and check the config against the family; `ConfigError` lists every conflict,
    each one a ``--set`` override of ``sets`` caused reported against that ``--set KEY=VALUE``."""
    try:
        return _resolve(config, source)
    except ConfigError as exc:
        raise blame_sets(exc, sets) from None


def _resolve(config: RunConfig, source: str) -> ResolvedConfig:
    problems: list[str] = []
    specs = check_names(config, source, problems)
    family, checkpoint_dir = _family(config, problems)
    if family is None:
        raise ConfigError(source, problems)
    marks: dict[str, str] = {}
    origin = f"family {family.name}"

    def fill(section: Any, path: str, **values: Any) -> Any:
        changes = {k: v for k, v in values.items() if getattr(section, k) is None and v is not None}
        for key in changes:
            marks[f"{path}.{key}"] = origin
        return attrs.evolve(section, **changes) if changes else section

    model, rollout = config.model, config.rollout
    checkpoint = model.name if model.init == "pretrained" else None

    if model.init == "random" and model.size != "tiny" and model.size not in family.shapes:
        shapes = ["tiny", *family.shapes]
        problems.append(
            f"model.size: {model.size!r} is not a shape of family {family.name}.{did_you_mean(model.size, shapes)} "
            f"Shapes: {', '.join(shapes)}"
        )

    serves = specs.engine is not None and specs.engine.server
    if serves and rollout.server == "vllm" and family.vllm_unsupported:
        problems.append(
            f'rollout.server: "vllm" cannot serve family {family.name}: {family.vllm_unsupported} (use server = '
            '"vlmreg", or engine = "embedded")'
        )

    # Vision
    if rollout.use_vision and not family.supports_vision:
        problems.append(f"rollout.use_vision: true, but family {family.name} has no vision support")
    if rollout.max_images_per_step is not None and rollout.max_images_per_step > family.max_images_per_message:
        problems.append(
            f"rollout.max_images_per_step: {rollout.max_images_per_step} exceeds family {family.name}'s "
            f"max_images_per_message ({family.max_images_per_message})"
        )
    use_vision = family.supports_vision if rollout.use_vision is None else rollout.use_vision
    if rollout.use_vision is False and rollout.max_images_per_step:
        problems.append(
            f"rollout.max_images_per_step: {rollout.max_images_per_step}, but use_vision is false (no image reaches "
            "the model); drop one"
        )
    if rollout.image_only_mode and not use_vision:
        problems.append("rollout.image_only_mode: true needs images, but use_vision is false")

    # Thinking
    modes = [m.name for m in family.thinking_modes_for(checkpoint)]
    # The family's default when the checkpoint has it, else the checkpoint's only mode (the first the family lists
    # for it, when it has several): a Thinking-only checkpoint gets its thinking mode, not none.
    default_mode = (
        family.default_thinking_mode if family.default_thinking_mode in modes else (modes[0] if modes else None)
    )
    if rollout.thinking_mode is not None and rollout.thinking_mode not in modes:
        where = f"checkpoint {checkpoint!r}" if checkpoint else "a random init"
        problems.append(
            f"rollout.thinking_mode: {rollout.thinking_mode!r} is not available for {where} of family {family.name}"
            f"{did_you_mean(rollout.thinking_mode, modes)} (available: {', '.join(modes) or 'none'})"
        )
    # whether the engine applies a budget, as its Engine declares (None: unknown, reported)
    engine_budgets = specs.engine.thinking_budget if specs.engine is not None else None
    if rollout.thinking_budget is not None and not modes:
        problems.append(f"rollout.thinking_budget: set, but {checkpoint or 'this model'} has no thinking modes")
    elif rollout.thinking_budget is not None and not (family.thinking_start and family.thinking_end):
        problems.append(
            f"rollout.thinking_budget: family {family.name} declares no thinking markers (thinking_start, "
            "thinking_end) to end the thinking with"
        )
    elif rollout.thinking_budget is not None and engine_budgets is False:
        problems.append(
            f"rollout.thinking_budget: engine {rollout.engine!r} cannot end the thinking after a budget (its Engine "
            'declares thinking_budget = False); unset it, or use engine = "embedded" or "openai" (vLLM, vlmreg serve)'
        )
    budget_applies = bool(modes) and bool(engine_budgets) and bool(family.thinking_start and family.thinking_end)

    # LoRA and freezing
    lora = model.lora
    if lora is not None:
        targets = lora.targets if lora.targets is not None else family.default_lora_preset
        reaches_vision = False
        if isinstance(targets, str) and not targets.startswith("re:"):
            if targets not in family.lora_presets:
                problems.append(
                    f"model.lora.targets: {targets!r} is not a LoRA preset of family {family.name}."
                    f"{did_you_mean(targets, family.lora_presets)} Presets: {', '.join(family.lora_presets)}; or give "
                    "a list of module names"
                )
            else:
                reaches_vision = family.lora_presets[targets].reaches_vision and lora.scopes is None
        reaches_vision = reaches_vision or "vision_encoder" in (lora.scopes or ())
        if reaches_vision and model.vlm.freeze_vision_encoder:
            problems.append(
                f"model.lora.targets: {targets!r} adapts the vision encoder, but model.vlm.freeze_vision_encoder is "
                "true; set it to false, or pick targets that stay out of the vision tower"
            )
        lora = fill(lora, "model.lora", targets=family.default_lora_preset)

    processor = _processor(model, family, checkpoint_dir, problems)
    if problems or processor is None:
        raise ConfigError(source, problems or ["model: no processor found"])

    model = fill(model, "model", family=family.name, processor=processor.name if processor.kind == "family" else None)
    if processor.kind == "checkpoint":
        model = attrs.evolve(model, processor=processor.name)  # shown as the checkpoint's own, not as the family's
    model = attrs.evolve(model, lora=lora)
    rollout = fill(
        rollout,
        "rollout",
        use_vision=family.supports_vision,
        max_images_per_step=family.max_images_per_message if use_vision else 0,
        thinking_mode=default_mode,
        thinking_budget=family.default_thinking_budget if budget_applies else None,
    )
    resolved = attrs.evolve(config, model=model, rollout=rollout)
    return ResolvedConfig(
        config=resolved,
        family=family,
        checkpoint_dir=checkpoint_dir,
        from_family=marks,
        source=source,
        processor=processor,
        specs=specs,
    )
