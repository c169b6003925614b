"""`gather_all`: await many tasks together, and on the first failure cancel the rest before raising it.

`asyncio.gather` alone leaves the other tasks running after one fails (a reward model call, an environment's step),
to finish or fail later with nobody awaiting them.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["gather_all"]


async def gather_all(tasks: Sequence[Any]) -> list[Any]:
    """Every task's result (``tasks``: asyncio futures), in order; the first exception cancels the others (awaited) and
    is raised."""
    # deferred: importing vlmreg.rewards stays cheap
    import asyncio  # noqa: PLC0415

    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
