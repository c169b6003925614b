"""HTTP for vlmreg's own servers and the requests it makes to them (stdlib only).

`vlmreg.http.client`: one JSON client (retries, per-attempt timeouts and a total deadline, bearer auth, errors that
name the URL) for the OpenAI engine, the remote environments and the trainer's weight syncs.
`vlmreg.http.server`: one hardened server base (connection and handler caps, idle and read timeouts, a deadline for
each request to arrive, body limits, auth before any state change) under ``vlmreg serve`` and ``vlmreg env serve``;
`vlmreg.http.connections` receives its connections and `vlmreg.http.auth` checks its keys.
"""
