"""Fill a `RunConfig` with what the family descriptor knows, and reject what contradicts it.

The result, `ResolvedConfig`, records which values came from the descriptor (``from_family``) so
``vlmreg config --resolved`` can mark them. Nothing here imports torch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from vlmreg.config.load import ConfigError
from vlmreg.config.schema import RunConfig
from vlmreg.rewards.registry import reward_names, unknown_reward_message
from vlmreg.sdk.descriptor import FamilyDescriptor
from vlmreg.sdk.errors import UnknownFamilyError, UnknownTaskError, VlmregError, did_you_mean
from vlmreg.sdk.registry import get_registry, get_task_registry

__all__ = ["ResolvedConfig", "find_checkpoint", "resolve_config"]


@attrs.frozen
class ResolvedConfig:
    """A run config with the family's values filled in, the family itself, and the checkpoint's directory."""

    config: RunConfig
    family: FamilyDescriptor
    checkpoint_dir: Path | None
    from_family: dict[str, str]
    source: str = "<config>"

    @property
    def checkpoint_name(self) -> str | None:
        """The checkpoint's name as written (a Hub id or a path); ``None`` for a random init."""
        return self.config.model.name


def _hub_cache_dir(repo_id: str) -> Path | None:
    """The cached snapshot of a Hub model, found without any network access, or ``None``."""
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:  # pragma: no cover - transformers depends on it
        return None
    found = try_to_load_from_cache(repo_id, "config.json")
    return Path(found).parent if isinstance(found, str) else None


def find_checkpoint(name: str) -> Path:
    """A local directory holding ``config.json``: ``name`` itself, or the local Hub cache's snapshot of it."""
    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise VlmregError(f"{path} has no config.json; is it a transformers checkpoint directory?")
        return path
    if name.count("/") == 1 and not path.exists():
        cached = _hub_cache_dir(name)
        if cached is not None:
            return cached
        from huggingface_hub import constants

        raise VlmregError(
            f"{name!r} is not a local directory and not in the Hugging Face cache ({constants.HF_HUB_CACHE}). "
            f"vlmreg never downloads: fetch it where there is network (`hf download {name}`) or point at a local directory"
        )
    raise VlmregError(f"{name!r}: no such checkpoint directory")


def _family(config: RunConfig, problems: list[str]) -> tuple[FamilyDescriptor | None, Path | None]:
    model = config.model
    registry = get_registry()
    checkpoint_dir = None
    model_type = None
    if model.init == "pretrained" and model.name is not None:
        from vlmreg.loading.build import read_model_type

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
    return family, checkpoint_dir


def _check_task_and_rewards(config: RunConfig, problems: list[str]) -> None:
    """``data.task`` must be a registered task and every reward name (the run's, else the task's) a reward function."""
    task = None
    if config.data.task is not None:
        try:
            task = get_task_registry().get(config.data.task)
        except UnknownTaskError as exc:
            problems.append(f"data.task: {exc}")
    if config.reward.functions is not None:
        where, names = "reward.functions", config.reward.functions
    elif task is not None:
        where, names = f"data.task: the reward of task {task.name!r}", task.reward
    else:
        return
    known = reward_names()
    problems.extend(f"{where}: {unknown_reward_message(name)}" for name in names if name not in known)


def resolve_config(config: RunConfig, source: str = "<config>") -> ResolvedConfig:
    """Fill descriptor-known values and check the config against the family; `ConfigError` lists every conflict."""
    problems: list[str] = []
    _check_task_and_rewards(config, problems)
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
        problems.append(f"model.size: {model.size!r} is not a shape of family {family.name}.{did_you_mean(model.size, shapes)} Shapes: {', '.join(shapes)}")

    # Vision
    if rollout.use_vision and not family.supports_vision:
        problems.append(f"rollout.use_vision: true, but family {family.name} has no vision support")
    if rollout.max_images_per_step is not None and rollout.max_images_per_step > family.max_images_per_message:
        problems.append(
            f"rollout.max_images_per_step: {rollout.max_images_per_step} exceeds family {family.name}'s "
            f"max_images_per_message ({family.max_images_per_message})"
        )
    use_vision = family.supports_vision if rollout.use_vision is None else rollout.use_vision
    if rollout.image_only_mode and not use_vision:
        problems.append("rollout.image_only_mode: true needs images, but use_vision is false")

    # Thinking
    modes = [m.name for m in family.thinking_modes_for(checkpoint)]
    default_mode = family.default_thinking_mode if family.default_thinking_mode in modes else None
    if rollout.thinking_mode is not None and rollout.thinking_mode not in modes:
        where = f"checkpoint {checkpoint!r}" if checkpoint else "a random init"
        problems.append(
            f"rollout.thinking_mode: {rollout.thinking_mode!r} is not available for {where} of family {family.name}"
            f"{did_you_mean(rollout.thinking_mode, modes)} (available: {', '.join(modes) or 'none'})"
        )
    if rollout.thinking_budget is not None and not modes:
        problems.append(f"rollout.thinking_budget: set, but {checkpoint or 'this model'} has no thinking modes")

    # LoRA and freezing
    lora = model.lora
    if lora is not None:
        targets = lora.targets if lora.targets is not None else family.default_lora_preset
        reaches_vision = False
        if isinstance(targets, str) and not targets.startswith("re:"):
            if targets not in family.lora_presets:
                problems.append(
                    f"model.lora.targets: {targets!r} is not a LoRA preset of family {family.name}."
                    f"{did_you_mean(targets, family.lora_presets)} Presets: {', '.join(family.lora_presets)}; or give a list of module names"
                )
            else:
                reaches_vision = family.lora_presets[targets].reaches_vision and lora.scopes is None
        reaches_vision = reaches_vision or "vision_encoder" in (lora.scopes or ())
        if reaches_vision and model.vlm.freeze_vision_encoder:
            problems.append(
                f"model.lora.targets: {targets!r} adapts the vision encoder, but model.vlm.freeze_vision_encoder is true; "
                "set it to false, or pick targets that stay out of the vision tower"
            )
        lora = fill(lora, "model.lora", targets=family.default_lora_preset)

    if problems:
        raise ConfigError(source, problems)

    processor = None
    if model.processor is None and checkpoint_dir is None:
        processor = family.processor_id_for(checkpoint) if model.init == "pretrained" else None
    model = fill(model, "model", family=family.name, processor=processor)
    model = attrs.evolve(model, lora=lora)
    rollout = fill(
        rollout,
        "rollout",
        use_vision=family.supports_vision,
        max_images_per_step=family.max_images_per_message if use_vision else 0,
        thinking_mode=default_mode,
        thinking_budget=family.default_thinking_budget if modes else None,
    )
    resolved = attrs.evolve(config, model=model, rollout=rollout)
    return ResolvedConfig(config=resolved, family=family, checkpoint_dir=checkpoint_dir, from_family=marks, source=source)
