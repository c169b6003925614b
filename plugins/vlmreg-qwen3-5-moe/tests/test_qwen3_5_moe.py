"""Conformance of the bundled qwen3_5_moe family, through the same checks a third-party plugin runs."""

from vlmreg.testing import FamilyConformance


class TestQwen35MoeConformance(FamilyConformance):
    family = "qwen3_5_moe"
    distribution = "vlmreg-qwen3-5-moe"
