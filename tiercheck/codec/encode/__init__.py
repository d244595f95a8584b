"""Encoding: a live state to a blob.

:mod:`.flatten` turns a state into a skeleton and tensors and writes the raw payload;
:mod:`.plan` caches that layout for a state that repeats, with :mod:`.copyprogram` its copy in
few calls; :mod:`.encoder` makes the full blob (the payload as is) or the packed one
(:mod:`tiercheck.codec.packed`).
"""
