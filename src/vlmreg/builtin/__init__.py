"""vlmreg's own plugins, one module per registry, registered through the same hooks a third party's use.

`vlmreg.sdk.plugins` loads each of them with the plugin manager (``BUILTIN_PLUGINS``), under the plugin names
``vlmreg.tasks``, ``vlmreg.rewards``, ``vlmreg.objectives``, ``vlmreg.engines``, ``vlmreg.sinks``,
``vlmreg.transports`` and ``vlmreg.environments``: `tasks`, `rewards`, `objectives`, `engines`, `sinks`,
`transports` and `environments` here. Each module is cheap to import (torch loads when a part is built), since they
load whenever a registry does; the code they name lives in the rooms that hold it (`vlmreg.train.losses`,
`vlmreg.inference`, `vlmreg.broadcast`, `vlmreg.rewards`, `vlmreg.tasks`, `vlmreg.envs`).
"""
