"""Checkpoint files: one safe reader, one atomic writer, key-layout conversion, loading
into a model.

Filled in step by step; the public names are re-exported here.
"""
