"""A vision encoder's per-call inputs, derived on the host while the micro-batch is built, handed to its forward.

Some encoders derive tensors from the images' grids at the start of each forward (segment tables, position ids,
interpolation taps). On a GPU that derivation reads values back, so the host stops until the GPU has finished all it
was given, and the GPU then idles until the host has queued more. A family whose encoder takes those values
precomputed declares ``vision_call_inputs`` (`vlmreg.FamilyDescriptor`): ``(encoder, image inputs on the host) ->
{input name: keyword arguments}``. The trainer calls it where it builds each micro-batch (`host_vision_inputs`),
moves the results to the device with the rest, and carries them in the model inputs under `VISION_CALLS`;
`vision_calls` takes them out before the model's forward and, during it, adds them to every call of the encoder that
receives the named input (the same tensor object). A call that receives none of them is left alone: the encoder
then derives its inputs itself, as without this, and `vision_calls` warns once that nothing was handed over.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from vlmreg.resolution import ResolvedFamily

__all__ = ["VISION_CALLS", "host_vision_inputs", "vision_calls"]

#: Model input holding `host_vision_inputs`'s result; never reaches the model (`vision_calls` takes it out).
VISION_CALLS = "vlmreg_vision_calls"

#: Families already warned that their precomputed inputs reached no encoder call.
_WARNED: set[str] = set()


def host_vision_inputs(resolved: ResolvedFamily, image_inputs: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """The family's precomputed encoder arguments for these image inputs (host tensors), ``{}`` when it declares none.

    Checked: each key names one of ``image_inputs``, each value is a mapping of argument names."""
    hook = resolved.descriptor.vision_call_inputs
    if hook is None or not image_inputs:
        return {}
    out = hook(resolved.vision_encoder, image_inputs)
    for name, arguments in out.items():
        if name not in image_inputs or not isinstance(arguments, Mapping):
            raise TypeError(
                f"family {resolved.descriptor.name}: vision_call_inputs must map names of the image inputs "
                f"({', '.join(image_inputs)}) to keyword arguments; it gave {name!r}: {type(arguments).__name__}"
            )
    return {name: dict(arguments) for name, arguments in out.items()}


@contextlib.contextmanager
def vision_calls(resolved: ResolvedFamily, inputs: dict[str, Any]) -> Iterator[dict[str, Any]]:
    """``inputs`` without `VISION_CALLS`; inside the block, each call of the family's vision encoder that receives one
    of the named inputs gets that input's precomputed arguments added to its keyword arguments."""
    calls = inputs.get(VISION_CALLS)
    model_inputs = {k: v for k, v in inputs.items() if k != VISION_CALLS}
    if not calls:
        yield model_inputs
        return
    targets = [(model_inputs[name], arguments) for name, arguments in calls.items() if name in model_inputs]
    handed: list[int] = []

    def hand(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict] | None:
        given = (*args, *kwargs.values())
        for target, arguments in targets:
            if any(value is target for value in given):
                handed.append(1)
                return args, {**kwargs, **arguments}
        return None

    # first, before any other pre-hook (FSDP2's may cast the arguments into new tensors)
    handle = resolved.vision_encoder.register_forward_pre_hook(hand, with_kwargs=True, prepend=True)
    try:
        yield model_inputs
    finally:
        handle.remove()
    name = resolved.descriptor.name
    if not handed and name not in _WARNED:
        _WARNED.add(name)
        warnings.warn(
            f"family {name}: its vision_call_inputs reached no call of its vision encoder (no call received "
            f"{' or '.join(calls)} as given), so the encoder derived them itself on the device",
            RuntimeWarning,
            stacklevel=3,
        )
