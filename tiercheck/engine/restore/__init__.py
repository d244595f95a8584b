"""A restore: inventory, agree, fetch; nothing stored is changed.

In order: :mod:`.restore` takes every rank's inventory of what it holds (``inventory``),
reaches one verdict on the version and the tier to restore from (``verdict``), and fetches:
this rank's blob read and verified (:mod:`.read`, over :mod:`.kept` for a node's own blobs and
the peer replicas it holds), put straight into the caller's tensors (:mod:`.inplace`;
``written``), or resharded from a save made by another number of ranks (:mod:`.elastic`); every
rank says it loaded (``loaded``). After a restore the run goes on from the restored version:
:mod:`.timeline` settles it at the first save, setting aside whole the versions past it in a
durable tier (:mod:`.setaside`; ``set-aside-list``, ``-copy``, ``-complete``, ``-remove``).
"""
