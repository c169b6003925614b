"""Testing helpers for family plugins: the conformance suite, parity checks and tiny models.

``FamilyConformance`` is the suite every bundled family runs and any third-party plugin can run (it
needs pytest, imported only when it is used); `vlmreg.testing.parity` holds the parity checks it and
``vlmreg check`` run; the pytest plugin (``vlmreg.testing.pytest_plugin``) adds registry fixtures.
``tiny_model`` and the parity checks work without pytest installed.
"""

from typing import Any

from vlmreg.testing.parity import tiny_model, tiny_processor
from vlmreg.testing.rollout_parity import parity_report

__all__ = ["FamilyConformance", "parity_report", "tiny_forward_inputs", "tiny_model", "tiny_processor"]


def __getattr__(name: str) -> Any:
    if name in ("FamilyConformance", "tiny_forward_inputs"):
        # deferred: a lazy attribute of the package (PEP 562)
        from vlmreg.testing import conformance  # noqa: PLC0415

        return getattr(conformance, name)
    raise AttributeError(f"module 'vlmreg.testing' has no attribute {name!r}")
