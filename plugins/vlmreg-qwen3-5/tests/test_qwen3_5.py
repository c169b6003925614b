"""Conformance of the bundled qwen3_5 family, through the same checks a third-party plugin runs."""

from vlmreg.testing import FamilyConformance


class TestQwen35Conformance(FamilyConformance):
    family = "qwen3_5"
    distribution = "vlmreg-qwen3-5"
