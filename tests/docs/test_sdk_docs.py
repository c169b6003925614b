"""docs/reference.md lists every name of ``vlmreg.sdk``; the plugin code in the docs imports only public modules and
runs; importing the whole SDK loads no torch."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import vlmreg.sdk
from tests.test_import_graph import is_public, public_names

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = (ROOT / "docs" / "reference.md").read_text()
PAGES = sorted((ROOT / "docs").glob("*.md")) + [ROOT / "README.md", ROOT / "CONTRIBUTING.md"]


def sdk_section() -> str:
    match = re.search(r"^## `vlmreg\.sdk`\n(.*?)(?=^## )", REFERENCE, re.S | re.M)
    assert match, "docs/reference.md has no section '## `vlmreg.sdk`'"
    return match.group(1)


def listed_names() -> set[str]:
    """The names in the first column of the section's table."""
    names = set()
    for row in re.findall(r"^\| (`[^|]*`) \|", sdk_section(), re.M):
        names |= set(re.findall(r"`(\w+)`", row))
    return names


def test_every_sdk_name_is_in_the_reference_and_every_listed_name_exists():
    exported = set(vlmreg.sdk.__all__)
    listed = listed_names()
    assert exported - listed == set(), "vlmreg.sdk names missing from docs/reference.md's `vlmreg.sdk` table"
    assert listed - exported == set(), "names in docs/reference.md's `vlmreg.sdk` table that vlmreg.sdk does not export"
    assert all(hasattr(vlmreg.sdk, name) for name in exported)


def test_the_listing_check_can_fail(monkeypatch):
    monkeypatch.setattr(vlmreg.sdk, "__all__", [*vlmreg.sdk.__all__, "NotDocumented"])
    with pytest.raises(AssertionError, match="missing from docs/reference.md"):
        test_every_sdk_name_is_in_the_reference_and_every_listed_name_exists()


def test_importing_the_whole_sdk_loads_no_torch():
    code = (
        "import sys; from vlmreg.sdk import *; import vlmreg; print(sorted(m for m in ('torch', 'transformers', "
        "'PIL') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.strip()
    assert out == "[]"


def plugin_blocks() -> list[tuple[str, str]]:
    """The docs' Python blocks that are plugin code (they implement a hook)."""
    blocks = []
    for page in PAGES:
        for block in re.findall(r"```python\n(.*?)```", page.read_text(), re.S):
            if "@hookimpl" in block:
                blocks.append((page.name, block))
    return blocks


def test_the_docs_plugin_code_imports_only_public_modules():
    blocks = plugin_blocks()
    assert len(blocks) >= 6
    exported = public_names()
    bad = []
    for page, block in blocks:
        for node in ast.walk(ast.parse(block)):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "vlmreg":
                if not is_public(node.module, [a.name for a in node.names], exported):
                    bad.append(f"{page}: from {node.module} import {', '.join(a.name for a in node.names)}")
            elif isinstance(node, ast.Import):
                bad += [
                    f"{page}: import {a.name}"
                    for a in node.names
                    if a.name.startswith("vlmreg.") and not is_public(a.name, [], exported)
                ]
    assert bad == [], f"{len(bad)} imports of vlmreg's internals in the docs' plugin code:\n" + "\n".join(bad)


def test_the_objective_in_training_md_is_reinforce_over_the_step():
    """docs/training.md's plugin objective, run on two samples: token-mean of -w A logp over the whole step's tokens,
    computed here by hand (the step has 10 loss tokens, this micro-batch 3 of them)."""
    block = next(b for page, b in plugin_blocks() if page == "training.md" and "plain_reinforce" in b)
    namespace: dict = {}
    exec(compile(block, "training.md", "exec"), namespace)
    logp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    x = vlmreg.sdk.LossInputs(
        logp=logp,
        logp_old=logp.detach(),
        logp_rollout=logp.detach(),
        advantages=torch.tensor([1.0, 1.0, -2.0]),
        weights=torch.tensor([1.0, 0.5, 1.0]),
        sequence=torch.tensor([0, 0, 1]),
        clip_low=0.2,
        clip_high=0.2,
        total_tokens=10,
        num_samples=4,
        max_tokens=8,
        aggregation="token-mean",
    )
    loss, clipped = namespace["plain_reinforce"](x)
    expected = -(1.0 * 1.0 * -1.0 + 0.5 * 1.0 * -2.0 + 1.0 * -2.0 * -0.5) / 10
    assert loss.item() == pytest.approx(expected)
    assert clipped.dtype == torch.bool and not clipped.any()
