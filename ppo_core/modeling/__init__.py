"""Layer 2 of ppo_core: model I/O.

Loading policy / value / reference / reward models, generation, scoring, checkpoints and the
embedded tiny default (``ppo_core.modeling.tiny_default``). Submodules import transformers and
other heavy libraries themselves, so importing this package stays cheap (docs/design.md section 7).
"""
