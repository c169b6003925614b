"""Plugin skeletons for new families (``vlmreg new-family``), found on the real transformers class.

`discover` builds the model of a ``model_type`` on the meta device and reads the descriptor paths off its module
tree; `shrink` turns the type's default config into a tiny one; `render` writes the plugin's files. Everything
here imports torch and transformers only when called.
"""

from vlmreg.scaffold.discover import FamilyLayout, build_on_meta, check_model_type, find_layout
from vlmreg.scaffold.render import TODO, distribution_name, render_plugin
from vlmreg.scaffold.shrink import ConfigSpec, tiny_config_spec

__all__ = [
    "TODO",
    "ConfigSpec",
    "FamilyLayout",
    "build_on_meta",
    "check_model_type",
    "distribution_name",
    "find_layout",
    "render_plugin",
    "tiny_config_spec",
]
