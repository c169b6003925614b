from vlmreg.testing import FamilyConformance


class TestMistral3Conformance(FamilyConformance):
    family = "mistral3"
    distribution = "vlmreg-tiny-pixtral"
