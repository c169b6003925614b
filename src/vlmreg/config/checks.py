"""Value checks for config fields, collected rather than raised one at a time.

A config class lists its checks in field metadata (``attrs.field(metadata=checks(positive))``) and derives
from `Section`; constructing it runs every check and raises one `SectionInvalid` holding every problem,
so a file with five mistakes gets five messages.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, cast

import attrs

Check = Callable[[Any], "str | None"]


class FieldProblem(ValueError):
    """One bad value: the field, what is wrong, and the value."""

    def __init__(self, field: str, message: str, value: Any) -> None:
        super().__init__(f"{field}: {message} (got {value!r})")
        self.field, self.message, self.value = field, message, value


class SectionInvalid(ExceptionGroup):
    """Every problem found in one config section."""

    def derive(self, excs):  # keep the class when ExceptionGroup.split/subgroup rebuild it
        return SectionInvalid(self.message, excs)


def checks(*fns: Check) -> dict[str, tuple[Check, ...]]:
    return {"checks": fns}


class Section:
    """Mixin for attrs config classes: run every field check and `cross_checks`, raise them all together."""

    def __attrs_post_init__(self) -> None:
        problems: list[FieldProblem] = []
        # the mixin's subclasses are attrs classes
        for field in attrs.fields(cast("type[attrs.AttrsInstance]", type(self))):
            value = getattr(self, field.name)
            if isinstance(value, float) and not math.isfinite(value):  # inf passes "> 0", and means nothing here
                problems.append(FieldProblem(field.name, "must be a finite number", value))
                continue
            for check in field.metadata.get("checks", ()):
                if value is None:
                    break
                message = check(value)
                if message:
                    problems.append(FieldProblem(field.name, message, value))
                    break
        if not problems:
            problems.extend(self.cross_checks())
        if problems:
            raise SectionInvalid(f"invalid {type(self).__name__}", problems)

    def cross_checks(self) -> list[FieldProblem]:
        """Checks that involve several fields of the section; override to add some."""
        return []


def positive(value: float) -> str | None:
    return None if value > 0 else "must be > 0"


def non_negative(value: float) -> str | None:
    return None if value >= 0 else "must be >= 0"


def at_least(minimum: float) -> Check:
    def check(value: float) -> str | None:
        return None if value >= minimum else f"must be >= {minimum}"

    return check


def in_range(low: float, high: float, *, low_open: bool = False, high_open: bool = False) -> Check:
    def check(value: float) -> str | None:
        ok_low = value > low if low_open else value >= low
        ok_high = value < high if high_open else value <= high
        if ok_low and ok_high:
            return None
        return f"must be in {'(' if low_open else '['}{low}, {high}{')' if high_open else ']'}"

    return check


def non_empty(value: Any) -> str | None:
    return None if len(value) else "must not be empty"
