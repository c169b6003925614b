"""Conformance of the bundled qwen3_vl_moe family, through the same checks a third-party plugin runs."""

from vlmreg.testing import FamilyConformance


class TestQwen3VlMoeConformance(FamilyConformance):
    family = "qwen3_vl_moe"
    distribution = "vlmreg-qwen3-vl-moe"
