from vlmreg.testing import FamilyConformance


class TestLlavaConformance(FamilyConformance):
    family = "llava"
    distribution = "vlmreg-tiny-llava"
