from vlmreg.testing import FamilyConformance


class TestIdefics3Conformance(FamilyConformance):
    family = "idefics3"
    distribution = "vlmreg-tiny-idefics3"
