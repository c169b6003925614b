"""Hub ids: reaching a Hub repository through the local Hugging Face cache, as transformers does (downloading what
is missing unless ``HF_HUB_OFFLINE=1``), and saying why not when it cannot; and a checkpoint's ``model_type``, read
from its config.json without transformers (`read_model_type`)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from vlmreg.sdk.errors import VlmregError, did_you_mean

__all__ = ["METADATA_FILES", "config_dict", "config_file", "hub_snapshot", "is_hub_id", "read_model_type"]

#: What resolution reads of a Hub repository: config, tokenizer, processor configs and chat templates.
METADATA_FILES = ("*.json", "*.jinja", "additional_chat_templates/*.jinja", "*.txt", "*.model")


def _offline() -> bool:
    # deferred: start-up cost (loads huggingface_hub)
    from huggingface_hub import constants  # noqa: PLC0415

    return constants.is_offline_mode() or os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in {
        "1",
        "ON",
        "YES",
        "TRUE",
    }


def _hub_cache() -> str:
    # deferred: start-up cost (loads huggingface_hub)
    from huggingface_hub import constants  # noqa: PLC0415

    return os.environ.get("HF_HUB_CACHE") or constants.HF_HUB_CACHE


def is_hub_id(name: str) -> bool:
    """Whether ``name`` reads as a Hub id (``org/name``) rather than a local path."""
    return name.count("/") == 1 and not name.startswith(("/", ".", "~")) and not Path(name).expanduser().exists()


def hub_snapshot(repo_id: str, patterns: Sequence[str] = METADATA_FILES) -> Path:
    """A Hub repository's snapshot directory in the local Hugging Face cache (``HF_HUB_CACHE``), as transformers
    reaches it: files matching ``patterns`` that are missing or stale are downloaded, unless offline mode is on
    (``HF_HUB_OFFLINE=1``), when only the cache is read."""
    # deferred: start-up cost (loads huggingface_hub)
    from huggingface_hub import snapshot_download  # noqa: PLC0415

    # deferred: start-up cost (loads huggingface_hub)
    from huggingface_hub.utils import HFValidationError, validate_repo_id  # noqa: PLC0415

    offline, cache = _offline(), _hub_cache()
    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:  # no Hub repository can have this name, online or not
        raise VlmregError(
            f"{repo_id!r} is not a local directory, nor a valid Hub id: {str(exc).splitlines()[0]}"
        ) from None
    try:
        return Path(
            snapshot_download(repo_id, allow_patterns=list(patterns), cache_dir=cache, local_files_only=offline)
        )
    except Exception as exc:  # the hub's errors: not cached, no such repository, gated, no network
        head = f"{repo_id!r} is not a local directory and not in the Hugging Face cache ({cache})"
        if offline:
            raise VlmregError(
                f"{head}, and offline mode is on (HF_HUB_OFFLINE=1): download it where there is network "
                f"(`hf download {repo_id}`), or unset HF_HUB_OFFLINE.{_cached_like(repo_id, cache)}"
            ) from None
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise VlmregError(f"{head}; downloading it failed: {reason}") from None


def _cached_like(repo_id: str, cache: str) -> str:
    """Offline, a misspelt id and a correct one not downloaded look alike: name the cached models close to it, or say
    that none is and that its spelling cannot be checked here."""
    try:
        cached = sorted(
            p.name.removeprefix("models--").replace("--", "/")
            for p in Path(cache).iterdir()
            if p.name.startswith("models--")
        )
    except OSError:
        cached = []
    close = did_you_mean(repo_id, cached)
    if close:
        return f"{close} (in the cache)"
    return (
        f" No model in the cache is close to it ({len(cached)} cached); offline, vlmreg cannot ask the Hub whether "
        "it exists: check its spelling there"
    )


def config_file(target: str | Path) -> Path:
    """The config.json of a local model directory, or ``target`` itself when it is a file."""
    path = Path(target)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise VlmregError(f"{path}: no config.json in this directory")
        return path / "config.json"
    if path.is_file():
        return path
    raise VlmregError(f"{path}: no such model directory or config.json (vlmreg reads local files only)")


def config_dict(file: Path) -> dict[str, Any]:
    """A config.json read as JSON, checked to name its ``model_type``."""
    try:
        data = json.loads(file.read_text())
    except (OSError, ValueError) as exc:
        raise VlmregError(f"{file}: not a readable JSON config ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("model_type"), str):
        raise VlmregError(f"{file}: no 'model_type' key; is this a transformers config.json?")
    return data


def read_model_type(target: str | Path) -> str:
    """The ``model_type`` of a local model directory or config.json, read without transformers."""
    return config_dict(config_file(target))["model_type"]
