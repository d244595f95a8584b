"""Consistency: the node's manifest, global commit, the COMMIT record, retention and recovery.

The manifest knows keys and versions, never tensors; retention and recovery are pure policy
over what the tiers hold; coordinators carry the few bytes ranks must exchange to agree.
"""
