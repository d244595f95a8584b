"""Resharding: what new rank ``q`` of ``M`` would have saved, from ``N`` old blobs.

:mod:`.reshard` plans it, :mod:`.shards` checks and cuts the old shards of each DTensor, and
:mod:`.boxes` reshards by region for meshes of any number of dimensions.
"""
