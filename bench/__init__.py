"""The benchmarks, grouped by the question they answer; run each as a module from the repository's
root (``.venv/bin/python -m bench.<group>.<name>``). ``bench/common.py`` is what they share."""
