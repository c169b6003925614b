"""Resolution: a family descriptor checked against one loaded model (imports torch)."""

from vlmreg.resolution.family import OVERRIDABLE, ResolvedFamily, resolve
from vlmreg.resolution.lora import LoraTargetSet, match_lora
from vlmreg.resolution.paths import resolve_module

__all__ = ["OVERRIDABLE", "LoraTargetSet", "ResolvedFamily", "match_lora", "resolve", "resolve_module"]
