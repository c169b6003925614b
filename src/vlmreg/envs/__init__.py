"""Environments beyond one process: the HTTP protocol, its server and client, and the gymnasium adapter.

What a plugin registers (`vlmreg.sdk.EnvironmentSpec`) is the SDK's; the HTTP parts (`vlmreg.envs.remote`,
`vlmreg.envs.server`) load only when a run or ``vlmreg env serve`` uses them.
"""
