"""Evaluation (layer 3): held-out scoring of a policy against its reference, the report, and
Markdown escaping for reports."""
