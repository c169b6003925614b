"""Conformance of the bundled qwen3_vl family, through the same checks a third-party plugin runs."""

from vlmreg.testing import FamilyConformance


class TestQwen3VlConformance(FamilyConformance):
    family = "qwen3_vl"
    distribution = "vlmreg-qwen3-vl"
