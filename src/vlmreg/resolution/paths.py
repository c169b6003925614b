"""Walking dotted attribute paths on a real module tree, strictly.

Only registered submodules count (what ``named_children()`` lists): a property or plain attribute of
the same name is not followed, because weight names, FSDP wrapping and LoRA all go by the module tree.
"""

from __future__ import annotations

from torch import nn

from vlmreg.sdk.errors import ResolutionError, did_you_mean

__all__ = ["resolve_module", "resolve_parameter"]

_MAX_LISTED = 12


def _listing(names: list[str]) -> str:
    if not names:
        return "it has no submodules"
    if len(names) > _MAX_LISTED:
        if all(n.isdigit() for n in names):
            return f"its children are '0' .. '{len(names) - 1}'"
        return "its children: " + ", ".join(names[:_MAX_LISTED]) + f", ... ({len(names)} in all)"
    return "its children: " + ", ".join(names)


def resolve_module(root: nn.Module, path: str, field: str, *, shown: str | None = None) -> nn.Module:
    """Return the submodule at ``path`` or raise `ResolutionError` naming the field, the step and the candidates
    (``shown``: the path to name instead, when ``path`` is the module part of a longer one)."""
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
                note = (
                    f" ({part!r} exists as a {type(getattr(current, part)).__name__} attribute, not a registered "
                    "submodule)"
                )
            raise ResolutionError(
                f"{field} = {(shown or path)!r} does not resolve: {where} ({kind}) has no submodule {part!r}{note}."
                f"{did_you_mean(part, names)} At {where}, {_listing(names)}."
            )
        current = children[part]
        walked.append(part)
    return current


def resolve_parameter(root: nn.Module, path: str, field: str) -> nn.Parameter:
    """Return the parameter registered at ``path`` (its module by `resolve_module`, then the module's own parameter)
    or raise `ResolutionError` naming the field and the parameters that module does have."""
    owner_path, _, name = path.rpartition(".")
    owner = resolve_module(root, owner_path, field, shown=path) if owner_path else root
    own = dict(owner.named_parameters(recurse=False))
    if name not in own:
        where = owner_path or "the model"
        listing = ", ".join(own) if own else "none"
        raise ResolutionError(
            f"{field} = {path!r} does not resolve: {where} ({type(owner).__name__}) has no parameter {name!r} of its "
            f"own.{did_you_mean(name, list(own))} Its own parameters: {listing}."
        )
    return own[name]
