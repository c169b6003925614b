"""Environments: the built-in single-turn one (`single_turn`), calling many at once (`calls`: concurrent, bounded,
timed), the gymnasium adapter (`gym`), and environments beyond one process (the HTTP protocol `wire`, its `server`
and its client `remote`).

What a plugin registers (`vlmreg.sdk.EnvironmentSpec`) is the SDK's; the HTTP parts (`vlmreg.envs.remote`,
`vlmreg.envs.server`) load only when a run or ``vlmreg env serve`` uses them.
"""
