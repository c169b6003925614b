"""Bundled training tasks (generated offline with PIL); registered by the built-in plugin `vlmreg.tasks.builtin`."""
