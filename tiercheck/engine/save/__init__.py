"""One save, from the caller's tensors to the tiers' writer lanes. No collective runs here.

In order: :mod:`.schedule` decides which versions may be saved and applies back-pressure,
:mod:`.plan` decides what a save becomes (full or delta, which tiers, which encoding),
:mod:`.stage` copies the caller's tensors into host memory (the copy itself, and the marks a
caller's step waits on, in :mod:`.staging`), and :mod:`.encode` turns the staged snapshot into
one blob per encoding and hands them to each tier's pipeline
(:mod:`tiercheck.engine.commit`).
"""
