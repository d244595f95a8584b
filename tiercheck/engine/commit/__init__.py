"""Each tier's pipeline: write, agree, keep.

:mod:`.tier` puts one tier's pipeline together: its writer lane (:mod:`.lane`) writes the
encoded versions in order; its commit rounds (:mod:`.commit`; collectives ``vote`` and ``ack``)
make the ranks agree, version by version, on what is whole in the tier; :mod:`.retain` applies
retention after each round and says what the tier counts as committed. :mod:`.pipe` is what a
lane and a round worker see of their pipeline.
"""
