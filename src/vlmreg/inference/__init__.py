"""Inference: turning prompts into completions, in this process or in a server apart.

The engines (`embedded`: transformers' ``generate`` on the trainer's own weights; `openai_client`: an
OpenAI-compatible server, spread over several by `server_pool`), what their requests carry (`thinking` budgets,
`cache_scope`), and the servers apart: `server_link` launches or attaches them (`server_process`) and keeps their
weights the trainer's (`calls`: the JSON requests), `vllm_server` does that for vLLM, and `vllm_worker` /
`vllm_auth` run inside vLLM itself. ``vlmreg serve`` (`vlmreg.serve`) is the HTTP face of the embedded engine.

Importing this package is cheap: vLLM's workers import `vlmreg.inference.vllm_worker` with nothing else of vlmreg.
"""
