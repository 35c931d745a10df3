"""Models split across devices and datasets split across processes.

* ``qlens.distributed.harvest``: ``harvest(bridge, dataset, names, out_dir, batch_size)`` caches
  hook activations over a dataset, each ``torchrun`` rank writing its shard; also the command
  ``python -m qlens.distributed.harvest``.
* ``qlens.distributed.shards``: ``load_harvest(out_dir)`` / ``merge_shards(out_dir)`` reassemble
  the shards in example order.

Submodules are imported explicitly (``from qlens.distributed.harvest import harvest``) so that
``python -m qlens.distributed.harvest`` runs the command without importing it twice.
"""
