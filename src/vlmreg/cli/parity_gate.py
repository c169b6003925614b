"""`vlmreg train`'s parity gate: the family's ``vlmreg check --tiny`` parity, before a run starts.

A family whose tiny model fails the parity checks would train on inputs or logprobs that are not the model's own
(a prefix-LM family before ``prefix_lm``: the sampler's logprobs 9.4e-3 from a plain forward's, and training ran
without a word). ``vlmreg train`` runs the checks ``vlmreg check --tiny FAMILY`` runs (prompt, logprobs alone / padded /
packed, turn end, sampler, turns, video) and refuses to start when one fails, naming each failure, the requirement
of the processor contract and the descriptor fields; ``--ignore-parity`` starts anyway, with the same list as a
warning. The checks use the family's tiny model and tiny processor, not the run's checkpoint: ``vlmreg check
CHECKPOINT`` compares a checkpoint's own processor.

A pass is remembered in ``parity/`` of the cache folder (``VLMREG_CACHE_DIR``, else ``$XDG_CACHE_HOME/vlmreg``, else
``~/.cache/vlmreg``), under a key made of the family's name, the source files of its plugin module and of vlmreg, and
the versions of transformers and torch: each family is checked once per change of any of them (5-10 s on a CPU).
Under ``torchrun`` only rank 0 checks (the others wait for it as they wait for its other start-up work).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from vlmreg.sdk.errors import VlmregError

__all__ = ["ParityGateError", "cache_key", "check_family_parity"]


class ParityGateError(VlmregError):
    """The run's family fails its parity checks; ``--ignore-parity`` trains anyway."""


def _cache_folder() -> Path:
    if os.environ.get("VLMREG_CACHE_DIR"):
        return Path(os.environ["VLMREG_CACHE_DIR"]) / "parity"
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "vlmreg" / "parity"


def _sources(module_name: str) -> list[Path]:
    """The Python files of a module: every one under its package's folder, or the module's own file."""
    module = sys.modules.get(module_name)
    if module is None:
        return []
    paths = getattr(module, "__path__", None)
    if paths:
        return sorted(p for folder in paths for p in Path(folder).rglob("*.py"))
    file = getattr(module, "__file__", None)
    return [Path(file)] if file else []


def cache_key(descriptor: Any) -> str:
    """What a parity verdict depends on: the family's name, its plugin's files and vlmreg's, transformers and torch."""
    # deferred: start-up cost (loads torch, transformers)
    import torch  # noqa: PLC0415
    import transformers  # noqa: PLC0415

    owner = getattr(descriptor.tiny_config, "__module__", "") or ""
    digest = hashlib.sha256()
    digest.update(f"{descriptor.name}\0{transformers.__version__}\0{torch.__version__}\0".encode())
    for path in [*_sources(owner.split(".")[0]), *_sources("vlmreg")]:
        digest.update(str(path).encode() + b"\0")
        try:
            digest.update(path.read_bytes())
        except OSError:
            digest.update(b"unreadable")
    return digest.hexdigest()[:32]


def _passed_before(key: str) -> bool:
    try:
        return json.loads((_cache_folder() / f"{key}.json").read_text()).get("ok") is True
    except (OSError, ValueError):
        return False


def _remember_pass(key: str, family: str) -> None:
    folder = _cache_folder()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        (folder / f"{key}.json").write_text(json.dumps({"family": family, "ok": True}))
    except OSError:  # a read-only cache: the checks run again next time, which is all a cache saves
        pass


def _run_checks(family: str) -> list[Any]:
    # deferred: start-up cost (loads torch)
    import torch  # noqa: PLC0415

    # deferred: `vlmreg` starts without it (vlmreg.testing)
    from vlmreg.testing.parity import Parity  # noqa: PLC0415
    from vlmreg.testing.rollout_parity import parity_report  # noqa: PLC0415
    from vlmreg.testing.video_parity import video_parity_report  # noqa: PLC0415

    with torch.random.fork_rng():  # the checks seed torch: the run's own random state stays as it was
        try:
            return [*parity_report(family), *video_parity_report(family)]
        except VlmregError as exc:  # no tiny processor, a processor that breaks the contract, ...
            return [Parity("parity checks", False, str(exc))]


def check_family_parity(descriptor: Any, *, ignore: bool, log: Callable[[str], None]) -> None:
    """Raise `ParityGateError` when the family fails ``vlmreg check --tiny``'s parity (``ignore``: log it, go on)."""
    if os.environ.get("RANK", "0") != "0":
        return
    key = cache_key(descriptor)
    if _passed_before(key):
        return
    # deferred: `vlmreg` starts without it (vlmreg.testing)
    from vlmreg.testing.hints import contract_hint  # noqa: PLC0415

    results = _run_checks(descriptor.name)
    failed = [r for r in results if not r.ok]
    if not failed:
        _remember_pass(key, descriptor.name)
        return
    lines = []
    for r in failed:
        lines.append(f"  {r.name}: {r.detail}")
        if contract_hint(r.name):
            lines.append(f"    hint: {contract_hint(r.name)}")
    what = (
        f"family {descriptor.name} fails {len(failed)} of the parity checks of `vlmreg check --tiny {descriptor.name}` "
        "(its inputs or logprobs are not the model's own, so training would learn from wrong numbers):\n"
        + "\n".join(lines)
    )
    if ignore:
        log(f"warning: {what}\n  --ignore-parity: training anyway")
        return
    raise ParityGateError(f"{what}\nFix the family, or pass --ignore-parity to train anyway")
