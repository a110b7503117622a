"""The reward model learnt from people's preferences: its training with the exact pairwise
accumulation (``training.py``), its held-out report (``report.py``) and its gate (``gate.py``)."""
