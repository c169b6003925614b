"""Training: the recipe, the update, samples, losses, checkpoints, metrics.

The package itself is callable: ``vlmreg.train(config, ...)`` runs a training (`vlmreg.train.api.train`), while
``vlmreg.train.recipe`` and the other modules stay importable as usual. Importing it is cheap (no torch).
"""

from __future__ import annotations

import sys
import types
from typing import Any


class _TrainPackage(types.ModuleType):
    """This package's module type: calling it runs `vlmreg.train.api.train`."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # deferred: start-up cost (loads cattrs)
        from vlmreg.train.api import train  # noqa: PLC0415

        return train(*args, **kwargs)


sys.modules[__name__].__class__ = _TrainPackage
