"""Adapters for other engines; imported only by those engines, never by vlmreg's core."""
