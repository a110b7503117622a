"""Preference feedback (layer 2): what people said about a model's replies. :mod:`.rows` reads
a feedback file's pair and rating rows and makes ratings into pairs; :mod:`.records` reads the
JSONL and Parquet records beneath them; :mod:`.fields` names the fields and the error."""
