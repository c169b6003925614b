"""Walking dotted attribute paths on a real module tree, strictly.

Only registered submodules count (what ``named_children()`` lists): a property or plain attribute of
the same name is not followed, because weight names, FSDP wrapping and LoRA all go by the module tree.
"""

from __future__ import annotations

from torch import nn

from vlmreg.sdk.errors import ResolutionError, did_you_mean

__all__ = ["resolve_module"]

_MAX_LISTED = 12


def _listing(names: list[str]) -> str:
    if not names:
        return "it has no submodules"
    if len(names) > _MAX_LISTED:
        if all(n.isdigit() for n in names):
            return f"its children are '0' .. '{len(names) - 1}'"
        return "its children: " + ", ".join(names[:_MAX_LISTED]) + f", ... ({len(names)} in all)"
    return "its children: " + ", ".join(names)


def resolve_module(root: nn.Module, path: str, field: str) -> nn.Module:
    """Return the submodule at ``path`` or raise `ResolutionError` naming the field, the step and the candidates."""
    current = root
    walked: list[str] = []
    for part in path.split("."):
        children = dict(current.named_children())
        if part not in children:
            where = ".".join(walked) if walked else "the model"
            kind = type(current).__name__
            names = list(children)
            note = ""
            if hasattr(current, part):
                note = f" ({part!r} exists as a {type(getattr(current, part)).__name__} attribute, not a registered submodule)"
            raise ResolutionError(
                f"{field} = {path!r} does not resolve: {where} ({kind}) has no submodule {part!r}{note}."
                f"{did_you_mean(part, names)} At {where}, {_listing(names)}."
            )
        current = children[part]
        walked.append(part)
    return current
