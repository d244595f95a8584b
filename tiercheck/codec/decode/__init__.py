"""Decoding: a blob back to a state.

:mod:`.decoder` decodes a whole blob verified end to end (or only verifies it);
:mod:`.partial` reads part of one, only the byte ranges of the tensors wanted; :mod:`.scatter`
reads a full blob's payload from a file straight to where its tensors go; :mod:`.blobread` reads
one rank's blob back, verified, with its base and the replicas it refers to;
:mod:`.rebuild` turns a skeleton and its tensors back into the state; :mod:`.assembled` is a
state put together from other ranks' blobs; :mod:`.statetree` puts a decoded state into the
caller's live objects.
"""
