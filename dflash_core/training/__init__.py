"""The drafter's training recipe, one idea per module.

* :mod:`.generate` -- the target writes its own training responses in a batched, KV-cached loop that captures the
  tapped hidden states and the target's top-k next-token distributions from the very forwards that produce the tokens;
* :mod:`.shards`   -- the data those runs accumulate: committed-able token shards (response ids and prompt references
  only) with a manifest each, plus a local, rebuildable cache of features per shard.

The training loop itself and the command line are ``dflash_core.train`` (``python -m dflash_core.train``).
"""
