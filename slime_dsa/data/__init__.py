"""Data: sample/trajectory types, prompt datasets, built-in task generators, and the built-in tokenizer.

Submodules are imported explicitly (e.g. `slime_dsa.data.tokenizer`) so that light ones stay light.
"""
