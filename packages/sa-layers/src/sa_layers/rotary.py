"""Rotary tables: `cat(cos, sin)` at integer positions, computed once per model forward.

The table builder lives beside the QSA RoPE it feeds (`sa_routing.rotary_table`); the layers
re-export it so that a model's code imports it from one place.
"""

from sa_routing import rotary_table

__all__ = ["rotary_table"]
