"""Every problem of a run config in one report: the schema, the registered names, the checks across sections and
against the family, together (`vlmreg validate`).

`load_config` stops at the schema: a config with a mistyped value never reaches the registry checks (an unknown
objective showed only once the other mistakes were fixed). Here the document is structured with its bad entries
dropped (`parse_document`), and what remains is checked too, leaving out any problem that would judge a dropped
value's default rather than what was written.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import attrs

from vlmreg.config.load import ConfigError, ParsedDocument, load_document, parse_document
from vlmreg.config.resolve import ResolvedConfig, check_names, resolve_config

__all__ = ["Validation", "validate_config"]


@attrs.frozen
class Validation:
    """What `validate_config` found: every problem (one line each), the resolved config when there are none, and the
    parsed document (``parsed.config`` is the config with bad entries dropped, for checks that can still run)."""

    source: str
    problems: list[str]
    resolved: ResolvedConfig | None
    parsed: ParsedDocument

    def clean(self, *tables: str) -> bool:
        """Whether no problem lies in (or dropped an entry of) any of ``tables`` (``"data"``, ``"eval"``)."""
        locations = [p.split(":", 1)[0] for p in self.problems] + list(self.parsed.dropped)
        return not any(loc == t or loc.startswith((f"{t}.", f"{t}[")) for loc in locations for t in tables)

    def error(self, extra: Sequence[str] = ()) -> ConfigError:
        return ConfigError(self.source, [*self.problems, *extra])


def validate_config(path: str | Path, sets: Sequence[str] = ()) -> Validation:
    """Check a run config file (plus ``--set`` overrides) completely; `ConfigError` only when it cannot be read."""
    source = str(path)
    parsed = parse_document(load_document(path, sets), source)
    if parsed.config is not None and not parsed.problems:
        try:
            return Validation(source, [], resolve_config(parsed.config, source), parsed)
        except ConfigError as exc:
            return Validation(source, exc.problems, None, parsed)
    problems = list(parsed.problems)
    if parsed.config is not None:
        found: list[str] = []
        if parsed.model_stand_in:  # [model] is a stand-in: only the checks that do not read it
            check_names(parsed.config, source, found)
        else:
            try:
                resolve_config(parsed.config, source)
            except ConfigError as exc:
                found = exc.problems
        problems.extend(p for p in found if p not in problems and not parsed.depends_on_dropped(p))
    problems.sort(key=lambda line: line.split(":", 1)[0])
    return Validation(source, problems, None, parsed)
