"""Loading models and processors for a family."""

from vlmreg.loading.build import build_model, load_config, model_class_for, read_model_type, tiny_config_of

__all__ = ["build_model", "load_config", "model_class_for", "read_model_type", "tiny_config_of"]
