"""The config a run directory keeps (``OUTPUT/config.toml``), and what ``--resume`` does when the new config differs.

Every run writes its resolved config (the family's values filled in, ``trainer.output_dir`` the directory itself) to
``OUTPUT/config.toml``, a config `vlmreg train` can read back. ``--resume`` compares the new resolved config with it,
key by key, before the model loads:

- a change to a key in `RUN_DEFINING` makes the run another run (another model, objective, group size, data or
  reward): it is refused, naming each such key with its old and new value, unless ``allow_config_change``
  (``--allow-config-change``) says to go on;
- every other change (steps, learning rate, logging, eval cadence, ...) is printed, ``key: old -> new``, and accepted.

Once the checkpoint has loaded, ``config.toml`` holds the new config. A run directory written before vlmreg kept its
config has no ``config.toml``: its resume is a note, compares nothing, and writes one.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from vlmreg.config.schema import RunConfig
from vlmreg.config.toml_out import _value, to_toml
from vlmreg.sdk.errors import VlmregError

__all__ = ["CONFIG_NAME", "RUN_DEFINING", "ConfigChange", "check_resumed_config", "config_changes", "write_run_config"]

CONFIG_NAME = "config.toml"

#: Dotted keys (a trailing ``.``: every key under it) whose change makes a resumed run another run.
RUN_DEFINING = (
    # which weights, which architecture, what trains (LoRA, freezing), the processor: all but the kernel below
    "model.",
    "trainer.algorithm",
    "trainer.loss_aggregation",  # the objective, and how its per-token terms are summed
    "rollout.group_size",  # the groups advantages are measured in
    "rollout.thinking_mode",  # the prompt format the policy is trained in
    "rollout.environment",  # what the episodes are
    "data.task",
    "data.paths",
    "data.format",
    "data.prompt_key",
    "data.answer_key",
    "data.image_keys",
    # which examples, in which order (the checkpoint's data position)
    "data.system_prompt",
    "data.num_samples",
    "data.seed",
    "reward.functions",  # what the run maximises
)
#: Keys under a run-defining prefix that are not: how attention is computed changes no result.
_NOT_DEFINING = ("model.attn_implementation",)
#: Keys never compared: the directory is the run, however its path is spelled.
_IGNORED = ("trainer.output_dir",)
_HEADER = (
    "# The resolved config of the run in this directory, written by `vlmreg train`. `vlmreg train ... --resume`\n"
    "# compares the new config with it: changes that make the run another run are refused (--allow-config-change).\n"
)


def run_defining(key: str) -> bool:
    """Whether a change to ``key`` (dotted) makes a resumed run another run."""
    if key in _NOT_DEFINING:
        return False
    return any(key.startswith(p) if p.endswith(".") else key == p for p in RUN_DEFINING)


@attrs.frozen
class ConfigChange:
    """One key whose value differs between the stored and the new config (``None``: unset in that one)."""

    key: str
    old: Any
    new: Any

    @property
    def defining(self) -> bool:
        return run_defining(self.key)

    def __str__(self) -> str:
        return f"{self.key}: {_shown(self.old)} -> {_shown(self.new)}"


def _shown(value: Any) -> str:
    return "(unset)" if value is None else _value(value)


def _value_tables(obj: Any, prefix: str = "") -> set[str]:
    """Dotted keys of the config whose values are mappings (``reward.functions``), not sections."""
    out: set[str] = set()
    for field in attrs.fields(type(obj)):
        value = getattr(obj, field.name)
        if attrs.has(type(value)):
            out |= _value_tables(value, f"{prefix}{field.name}.")
        elif isinstance(value, Mapping) or str(field.type).startswith(("dict[", "Mapping[")):  # set or unset
            out.add(f"{prefix}{field.name}")
    return out


def _flatten(table: Mapping[str, Any], values: set[str], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, value in table.items():
        key = f"{prefix}{name}"
        if isinstance(value, Mapping) and key not in values:
            out |= _flatten(value, values, f"{key}.")
        else:
            out[key] = value
    return out


def config_changes(stored: Mapping[str, Any], config: RunConfig) -> list[ConfigChange]:
    """Each key whose value differs between ``stored`` (a parsed ``config.toml``) and ``config``, in the new config's
    key order (keys only the stored config has come last); ``trainer.output_dir`` is not compared."""
    values = _value_tables(config)
    old = _flatten(stored, values)
    new = _flatten(tomllib.loads(to_toml(config)), values)  # through TOML, as the stored one went: unset is absent
    keys = [*new, *(k for k in old if k not in new)]
    return [ConfigChange(k, old.get(k), new.get(k)) for k in keys if k not in _IGNORED and old.get(k) != new.get(k)]


def _as_run(config: RunConfig, output_dir: Path) -> RunConfig:
    return attrs.evolve(config, trainer=attrs.evolve(config.trainer, output_dir=str(output_dir)))


def write_run_config(output_dir: Path, config: RunConfig) -> Path:
    """Write ``OUTPUT/config.toml`` atomically (a temporary file renamed into place)."""
    path = output_dir / CONFIG_NAME
    partial = output_dir / f".{CONFIG_NAME}.tmp"
    try:
        partial.write_text(_HEADER + to_toml(_as_run(config, output_dir)), encoding="utf-8")
        os.replace(partial, path)
    except OSError as exc:
        raise VlmregError(f"could not write {path}: {exc.strerror or exc}") from exc
    return path


def check_resumed_config(
    output_dir: Path, config: RunConfig, *, allow_change: bool, log: Callable[[str], None]
) -> None:
    """Compare ``config`` with the one the run in ``output_dir`` keeps (see the module doc): refuse run-defining
    changes unless ``allow_change``, print the others. Writes nothing."""
    path = output_dir / CONFIG_NAME
    if not path.is_file():
        log(
            f"note: {path} is missing (a run from before vlmreg kept its config): the config is not compared; "
            "it is written once the run resumes"
        )
        return
    try:
        stored = tomllib.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as exc:
        raise VlmregError(
            f"--resume: {path} (the run's config) cannot be read ({exc}); restore it, or delete it to resume without "
            "comparing configs"
        ) from exc
    changes = config_changes(stored, _as_run(config, output_dir))
    defining = [c for c in changes if c.defining]
    if defining and not allow_change:
        raise VlmregError(
            f"--resume: the config changes what defines the run in {output_dir} ({path}): "
            f"{'; '.join(map(str, defining))}. Resume with the run's values, start another run (another --output-dir, "
            "or --overwrite), or pass --allow-config-change to continue this one anyway"
        )
    for change in changes:
        note = " (changes the run; allowed by --allow-config-change)" if change.defining else ""
        log(f"--resume: config changed: {change}{note}")
