"""Helpers for a family's weight-broadcast tests: what the broadcaster sends, and what transformers makes of it.

    sent = sent_weights(tiny_model("my_family"))                 # published checkpoint names -> tensors
    assert_same_state(loaded_back(model, tmp_path).state_dict(), model.state_dict())

``loaded_back`` is the independent check: the sent tensors written as a checkpoint (the model's config beside them)
and read by transformers' own ``from_pretrained``, so a wrong name or shape shows up as a missing or mismatched
weight there, not in vlmreg's own mapping.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import vlmreg

__all__ = ["assert_same_state", "loaded_back", "sent_weights"]


def sent_weights(model: Any, *, include_frozen_vision: bool = True) -> dict[str, Any]:
    """What the weight broadcaster sends for ``model`` (a full sync by default): checkpoint name -> tensor (a copy)."""
    # deferred: start-up cost (loads safetensors, torch)
    from vlmreg.broadcast import WeightPlan  # noqa: PLC0415

    plan = WeightPlan.from_resolved(vlmreg.resolve(model), include_frozen_vision=include_frozen_vision)
    return {name: tensor.detach().contiguous().clone() for name, tensor in plan.tensors()}


def assert_same_state(a: dict[str, Any], b: dict[str, Any]) -> None:
    """The same names, and for each the same dtype, shape and values (exactly)."""
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    assert sorted(a) == sorted(b), (
        f"only in the first: {sorted(set(a) - set(b))[:5]}; only in the second: {sorted(set(b) - set(a))[:5]}"
    )
    differ = [k for k in a if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    assert differ == [], f"{len(differ)} tensor(s) differ, first {differ[:5]}"


def loaded_back(model: Any, directory: Path) -> Any:
    """``model``'s sent weights written to ``directory`` as one safetensors file with its config, and loaded by
    transformers' ``from_pretrained`` of the model's own class."""
    # deferred: start-up cost (loads safetensors)
    from safetensors.torch import save_file  # noqa: PLC0415

    directory = Path(directory)
    model.config.save_pretrained(directory)
    save_file(sent_weights(model), str(directory / "model.safetensors"), metadata={"format": "pt"})
    return type(model).from_pretrained(directory)
