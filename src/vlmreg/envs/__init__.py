"""Environments beyond one process: the registered-environment spec, the HTTP protocol, its server and client.

`EnvironmentSpec` (what ``vlmreg_register_environments`` registers) imports nothing heavy; the HTTP parts
(`vlmreg.envs.remote`, `vlmreg.envs.server`) load only when a run or ``vlmreg env serve`` uses them.
"""

from vlmreg.envs.spec import EnvironmentSpec, UnknownEnvironmentError

__all__ = ["EnvironmentSpec", "UnknownEnvironmentError"]
