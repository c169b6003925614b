"""Bundled training tasks (generated offline with PIL); registered by the built-in plugin `vlmreg.builtin.tasks`.

``colour``: the colour (Red, Green or Blue) of one large shape, answered in one word. ``count``: how many
shapes (1-6), answered as ``\\boxed{N}``. Look tasks up with ``vlmreg.get_task_registry().get(name)``.
"""
