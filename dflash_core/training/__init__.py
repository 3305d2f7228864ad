"""The drafter's training recipe, one idea per module.

* :mod:`.train_config` -- what a run is: the drafter's shape (``DraftSpec``) and ``TrainConfig``;
* :mod:`.prompts`  -- the training prompts (``build_prompts``), all offline and never benchmark-eligible;
* :mod:`.pools`    -- the prompt pools the benchmark and the recipe share, with the split that keeps them apart;
* :mod:`.responses` -- the target writes its own training responses in a batched, KV-cached loop that captures the
  tapped hidden states and the target's top-k next-token distributions from the very forwards that produce the tokens;
* :mod:`.shards`   -- the data those runs accumulate: committed-able token shards (response ids and prompt references
  only) with a manifest each, plus a local, rebuildable cache of features per shard;
* :mod:`.datagen`  -- ``python -m dflash_core.training.datagen``: generate (more) shards with :mod:`.responses`;
* :mod:`.corpus`   -- a training corpus from shards: sequences, their kept features, a draft vocabulary;
* :mod:`.anchors`  -- anchors in the response and position weights (the blocks themselves, inputs, labels and
  attention mask, are the core's :mod:`dflash_core.blocks`, which replay shares);
* :mod:`.loss`     -- the target's features and soft labels, and the drafter's weighted block loss;
* :mod:`.loop`     -- the training loop: schedule, checkpoints, DDP, logging, export;
* :mod:`.evaluate` -- the acceptance length tau with real greedy decoding;
* :mod:`.fit`      -- ``python -m dflash_core.training.fit``: train on accumulated shards (``--preset qwen3``: the
  published hyper-parameters for GPUs);
* :mod:`.recipe`   -- ``python -m dflash_core.training.recipe``: datagen then fit, resumable;
* :mod:`.stream`   -- the teacher-forced training stream (``python -m experiments.studies.drafter_stream``).
"""
