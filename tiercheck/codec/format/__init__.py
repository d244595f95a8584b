"""The stored format: what a blob is, byte for byte.

:mod:`.blobformat` (the preamble and header, and their parse), :mod:`.skeleton` (the skeleton's
tags and the one walk over a stored skeleton), :mod:`.layout` (where each tensor sits in the
payload), :mod:`.dtypes` (the dtypes stored and their names), :mod:`.dtensor` (DTensor
records), :mod:`.digest` (checksums) and :mod:`.stages` (the versioned stage names a header
carries).
"""
