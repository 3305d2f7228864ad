"""Train drafter variants on one GPU of an offline box, evaluate them there, and bring the best back.

The embedded target (SmolLM2-135M-Instruct) and everything a run needs travel as files: the target's GGUF
(``DDTREE_SMOLLM2_GGUF``), the training sequences packed here (:mod:`.pack`: the committed response shards with their
prompts rebuilt on this machine, since prompt sources differ between machines) and the protocol's prompts. On the GPU
(:mod:`.run`) several arms (:mod:`.arms`: depth, draft vocabulary) train at once from the shipped drafter, each its own
process for the same wall-clock minutes (:mod:`.worker`: joint training of every weight, a teacher-forced target pass
per sequence, every response position an anchor). The target's greedy continuations of the protocol prompts are
computed there, every drafter's rounds are replayed on them (:mod:`.protocol_replay`), and the best drafters'
weights come back split into files under the transfer limit (:func:`.pack.join` rebuilds them).

    python -m experiments.studies.gpu_train pack --out .gpu/pack          # here: training and protocol data
    python -m experiments.studies.gpu_train smoke                         # on the GPU: a tiny end-to-end check
    python -m experiments.studies.gpu_train run --pack .gpu/pack --out $OUT --minutes 6
    python -m experiments.studies.gpu_train join --results DIR --arm l3 --out runs/gpu-l3   # here, afterwards
"""
