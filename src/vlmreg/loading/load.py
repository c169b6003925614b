"""`vlmreg.load`: model, processor and ResolvedFamily from a run config, strictly.

The model comes from a local safetensors checkpoint (or a Hub id: read from the local cache, downloaded as
transformers would unless ``HF_HUB_OFFLINE=1``) or a random init of a named shape. It is resolved against its family at
once, the vision tower is frozen per config, LoRA is applied through peft with targets checked one by one, and the
processor is checked to really be
a processor (transformers silently returns a bare tokenizer when torchvision is missing).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
import torch
from torch import nn

from vlmreg.config import load_config
from vlmreg.config.resolve import (
    METADATA_FILES,
    WEIGHT_FILES,
    ResolvedConfig,
    find_processor,
    hub_snapshot,
    is_hub_id,
    resolve_config,
)
from vlmreg.config.schema import RunConfig
from vlmreg.loading.build import build_model, model_class_for, shallower
from vlmreg.modeling.attention import register_varlen_attention, use_varlen_vision
from vlmreg.resolution import ResolvedFamily, resolve
from vlmreg.resolution.lora import LoraTargetSet, adapted_names
from vlmreg.sdk.errors import ResolutionError, VlmregError

if TYPE_CHECKING:
    from peft import PeftModel
    from transformers import PreTrainedModel

__all__ = ["LoadedModel", "LoraReport", "choose_device", "choose_dtype", "load", "load_processor"]

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@attrs.frozen
class LoraReport:
    """Exactly what LoRA adapted, and how many parameters train."""

    targets: str
    modules: tuple[str, ...]
    parameters: tuple[str, ...]
    trainable_parameters: int
    total_parameters: int


@attrs.frozen(eq=False)
class LoadedModel:
    model: PreTrainedModel | PeftModel  # the family's model, or a peft model around it with LoRA
    processor: Any
    resolved: ResolvedFamily
    config: ResolvedConfig
    device: torch.device
    dtype: torch.dtype
    lora: LoraReport | None
    frozen_parameters: int


def choose_device(setting: str) -> torch.device:
    """The trainer's device. A GPU always gets its index (the current one: under torchrun, the rank's own): a bare
    ``cuda`` means the current device of whichever thread uses it, and a helper thread's is GPU 0, so tensors a
    thread builds (the next micro-batch) would land on another rank's GPU."""
    if setting.startswith("cuda") and not torch.cuda.is_available():
        raise VlmregError(f"trainer.device = {setting!r}, but torch sees no CUDA device")
    if setting == "auto":
        setting = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(setting)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def choose_dtype(setting: str, device: torch.device) -> torch.dtype:
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[setting]


def _load_pretrained(rc: ResolvedConfig, device: torch.device, dtype: torch.dtype) -> PreTrainedModel:
    directory = rc.checkpoint_dir
    assert directory is not None
    name = rc.config.model.name
    hub = name is not None and is_hub_id(name)
    if name is not None and hub:
        # A Hub id: its safetensors weights come from the cache, downloaded as transformers would unless offline.
        directory = hub_snapshot(name, (*METADATA_FILES, *WEIGHT_FILES))
    if not any(directory.glob("*.safetensors")):
        found = sorted(p.name for p in directory.iterdir() if p.suffix in {".bin", ".pt", ".pth", ".ckpt"})
        extra = f" (found {', '.join(found[:3])}: pickle files are never loaded)" if found else ""
        if hub and not found:
            extra = f" in the Hugging Face cache's snapshot of {name!r} (with HF_HUB_OFFLINE=1 nothing is downloaded)"
        raise VlmregError(f"{directory}: no *.safetensors weights{extra}")
    cls = model_class_for(rc.family)
    model = cls.from_pretrained(
        directory,
        local_files_only=True,
        use_safetensors=True,
        dtype=dtype,
        attn_implementation=rc.config.model.attn_implementation,
    )
    return model.to(device)


def load_processor(rc: ResolvedConfig) -> Any:
    """The processor of a resolved config, from where resolution found it (`ResolvedConfig.processor`): the family's
    tiny one for a random init, else a local directory (the checkpoint's own, ``model.processor``, or the family's
    processor id for the checkpoint), loaded by the family's ``load_processor`` or ``AutoProcessor``."""
    family, model = rc.family, rc.config.model
    source = rc.processor
    if (source.kind == "tiny") if source is not None else (model.processor is None and model.init == "random"):
        if family.tiny_processor is None:
            raise VlmregError(
                f"family {family.name} has no tiny_processor; set model.processor to a local processor directory"
            )
        return family.tiny_processor()
    directory: Path | None
    if source is not None and source.directory is not None:
        directory = source.directory
    else:  # a ResolvedConfig put together by hand
        directory = find_processor(model.processor) if model.processor is not None else rc.checkpoint_dir
    assert directory is not None
    if family.load_processor is not None:
        processor = family.load_processor(directory)
    else:
        # deferred: start-up cost (loads transformers)
        from transformers import AutoProcessor  # noqa: PLC0415

        processor = AutoProcessor.from_pretrained(directory, local_files_only=True)
    if family.supports_vision and getattr(processor, "image_processor", None) is None:
        raise VlmregError(
            f"{directory}: the processor loaded is a {type(processor).__name__} without an image processor "
            "(transformers returns only the tokenizer when it cannot build the rest, e.g. without torchvision); "
            f"family {family.name} should set load_processor"
        )
    return processor


def _check_processor(processor: Any, model: PreTrainedModel, family: Any, source: str) -> None:
    """The processor's vocabulary fits the model, and the family's image placeholder is one of its tokens."""
    tokenizer = getattr(processor, "tokenizer", processor)
    embeddings = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > embeddings:
        raise VlmregError(
            f"{source}: the tokenizer has {len(tokenizer)} tokens, the model's embeddings only {embeddings}"
        )
    if not family.supports_vision:
        return
    # deferred: start-up cost (loads urllib.request)
    from vlmreg.data.prompts import image_placeholder  # noqa: PLC0415

    placeholder = image_placeholder(processor, family)
    if tokenizer.convert_tokens_to_ids(placeholder) in (None, tokenizer.unk_token_id):
        raise VlmregError(
            f"{source}: the image placeholder {placeholder!r} (family {family.name}) is not a token of the processor's "
            "tokenizer"
        )


def _freeze(resolved: ResolvedFamily, rc: ResolvedConfig) -> int:
    vlm = rc.config.model.vlm
    connector_params = {id(p) for m in resolved.connectors.values() for p in m.parameters()}
    frozen = 0
    if vlm.freeze_vision_encoder:
        for p in resolved.vision_encoder.parameters():
            if id(p) not in connector_params and p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    if vlm.freeze_connectors:
        for p in [
            *(p for m in resolved.connectors.values() for p in m.parameters()),
            *resolved.connector_parameters.values(),
        ]:
            if p.requires_grad:
                p.requires_grad_(False)
                frozen += p.numel()
    return frozen


def _apply_lora(model: nn.Module, resolved: ResolvedFamily, rc: ResolvedConfig) -> tuple[nn.Module, LoraReport]:
    # deferred: start-up cost (loads peft)
    import peft  # noqa: PLC0415

    section = rc.config.model.lora
    assert section is not None
    targets: LoraTargetSet = resolved.lora_targets(
        section.targets, parameters=section.parameters, scopes=section.scopes, exclude=section.exclude
    )
    peft_config = peft.LoraConfig(
        r=section.r, lora_alpha=section.alpha, lora_dropout=section.dropout, **targets.peft_kwargs()
    )
    wrapped = peft.get_peft_model(model, peft_config)
    wanted = set(targets.modules) | {p.rsplit(".", 1)[0] for p in targets.parameters}
    missing = wanted - adapted_names(wrapped)
    if missing:
        raise ResolutionError(
            f"model.lora: peft did not adapt {len(missing)} resolved target(s), e.g. {sorted(missing)[0]}"
        )
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum(p.numel() for p in wrapped.parameters())
    return wrapped, LoraReport(targets.name, targets.modules, targets.parameters, trainable, total)


def load(config: RunConfig | ResolvedConfig | str | Path, sets: tuple[str, ...] | list[str] = ()) -> LoadedModel:
    """Load what a run config describes: model (resolved, frozen per config, LoRA applied) and processor."""
    if isinstance(config, (str, Path)):
        rc = resolve_config(load_config(config, sets), source=str(config), sets=sets)
    elif isinstance(config, RunConfig):
        rc = resolve_config(config)
    else:
        rc = config
    section = rc.config.model
    device = choose_device(rc.config.trainer.device)
    dtype = choose_dtype(section.dtype, device)
    varlen = section.attn_implementation == "varlen"
    if varlen:
        # the registered kernel's own name, outside the Literal of names a config may give
        section = attrs.evolve(section, attn_implementation=register_varlen_attention())  # type: ignore[arg-type]
        rc = attrs.evolve(rc, config=attrs.evolve(rc.config, model=section))
    # model.seed makes the weights; the caller's generators (trainer.seed) are left as they were
    if section.init == "random":
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
            torch.manual_seed(section.seed)
            what = f"{rc.family.name} {section.size}"
            shape = shallower(rc.family.config_for_size(section.size), section.layers, what=what)
            model = build_model(shape, rc.family, device=device, dtype=dtype)
        model.set_attn_implementation(section.attn_implementation)
    else:
        model = _load_pretrained(rc, device, dtype)
    resolved = resolve(model, section.vlm.overrides(), family=rc.family)
    if varlen:
        use_varlen_vision(resolved.vision_encoder)  # the encoder's images in one varlen call, not one call each
    processor = load_processor(rc)
    _check_processor(processor, model, rc.family, section.processor or section.name or f"tiny {rc.family.name}")
    frozen = _freeze(resolved, rc)
    report = None
    if section.lora is not None:
        model, report = _apply_lora(model, resolved, rc)
    return LoadedModel(model, processor, resolved, rc, device, dtype, report, frozen)
