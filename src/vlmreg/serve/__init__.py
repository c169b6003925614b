"""The embedded inference server: a run config's model behind an OpenAI-compatible HTTP API.

`Server` binds and answers; `serve_in_thread` loads and serves in one call (tests, and `vlmreg train` starting
a server beside itself). Requests are parsed strictly (`vlmreg.serve.protocol`) and batched by one worker
thread (`vlmreg.serve.worker`), which also runs functions between batches, e.g. to swap in new weights.
"""

from vlmreg.serve.protocol import RequestError
from vlmreg.serve.server import Server, serve_in_thread

__all__ = ["RequestError", "Server", "serve_in_thread"]
