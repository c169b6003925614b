from vlmreg.testing import FamilyConformance


class TestGemma3Conformance(FamilyConformance):
    family = "gemma3"
    distribution = "vlmreg-tiny-gemma3"
