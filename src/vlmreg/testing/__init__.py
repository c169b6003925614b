"""Testing helpers for family plugins: the conformance suite and tiny models.

``FamilyConformance`` is the suite every bundled family runs and any third-party plugin can run;
the pytest plugin (``vlmreg.testing.pytest_plugin``) adds registry fixtures.
"""

from vlmreg.testing.conformance import FamilyConformance, tiny_forward_inputs, tiny_model

__all__ = ["FamilyConformance", "tiny_forward_inputs", "tiny_model"]
