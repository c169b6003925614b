"""Render a model's module tree with rich, marking the parts a family resolved to."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping

from rich.markup import escape
from rich.tree import Tree
from torch import nn


def _count(n: int) -> str:
    for unit, size in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= size:
            return f"{n / size:.1f}{unit}"
    return str(n)


def parameter_counts(model: nn.Module) -> dict[str, int]:
    """Parameters under every module path ("" is the whole model); works on the meta device."""
    counts: dict[str, int] = defaultdict(int)
    for name, param in model.named_parameters():
        parts = name.split(".")[:-1]
        counts[""] += param.numel()
        for i in range(1, len(parts) + 1):
            counts[".".join(parts[:i])] += param.numel()
    return counts


def module_tree(model: nn.Module, marks: Mapping[str, str], depth: int) -> Tree:
    """The tree down to ``depth`` levels, always expanded along the marked paths.

    A ModuleList of same-typed modules shows as one row ``[0..N-1] × Type``, expanded through item 0.
    """
    counts = parameter_counts(model)
    on_path = {p.rsplit(".", i)[0] for p in marks for i in range(p.count(".") + 1)} | set(marks)

    def label(path: str, name: str, module: nn.Module, repeat: int = 0) -> str:
        each = " each" if repeat else ""
        shown = f"[0..{repeat - 1}]" if repeat else name
        text = f"{escape(shown)} [dim]({type(module).__name__}, {_count(counts.get(path, 0))} params{each})[/]"
        if path in marks:
            text = f"[bold green]{text}  ◀ {escape(marks[path])}[/]"
        return text

    def add(node: Tree, module: nn.Module, prefix: str, level: int) -> None:
        children = list(module.named_children())
        same = len(children) > 1 and isinstance(module, nn.ModuleList) and len({type(c) for _, c in children}) == 1
        if same:
            name, child = children[0]
            path = f"{prefix}{name}"
            branch = node.add(label(path, name, child, repeat=len(children)))
            if level < depth or path in on_path:
                add(branch, child, path + ".", level + 1)
            return
        for name, child in children:
            path = f"{prefix}{name}"
            if level >= depth and path not in on_path:
                continue
            branch = node.add(label(path, name, child))
            add(branch, child, path + ".", level + 1)

    root = Tree(f"[bold]{type(model).__name__}[/] [dim]({_count(counts[''])} params)[/]")
    add(root, model, "", 1)
    return root
