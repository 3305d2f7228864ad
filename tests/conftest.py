"""Tiny random targets and drafters built from configs (no downloads)."""

from __future__ import annotations

import pytest
import torch

from dflash_core import DFlashDraftModel
from dflash_core.config import DFlashConfig, build_target_layer_ids
from dflash_core.timing import cache_root

# Tiny models run fastest on one thread, and the suite stays fast when the machine is busy with other jobs.
torch.set_num_threads(1)


def make_target(family: str = "llama", vocab: int = 64, layers: int = 4, hidden: int = 32, seed: int = 0,
                dtype: torch.dtype = torch.float64, init: float = 0.2):
    """A tiny random Llama or Qwen3 causal LM; a wide init makes its distributions peaked (fewer near-ties)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    common = dict(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  initializer_range=init, tie_word_embeddings=False)
    if family == "llama":
        config = LlamaConfig(**common)
    elif family == "qwen3":
        config = Qwen3Config(**common, head_dim=hidden // 4)
    else:
        raise ValueError(family)
    config._attn_implementation = "sdpa"
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(config).to(dtype).eval()


def make_draft(target, block_size: int = 4, layers: int = 1, taps: int = 2, mask_token_id: int | None = None,
               seed: int = 1, dtype: torch.dtype | None = None) -> DFlashDraftModel:
    cfg = target.config
    n_layers = cfg.num_hidden_layers
    config = DFlashConfig(
        hidden_size=cfg.hidden_size, num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
        head_dim=cfg.hidden_size // 4, intermediate_size=2 * cfg.hidden_size, vocab_size=cfg.vocab_size,
        target_layer_ids=tuple(build_target_layer_ids(n_layers, taps)) if n_layers >= 4 else tuple(range(taps)),
        mask_token_id=cfg.vocab_size - 1 if mask_token_id is None else mask_token_id,
        num_target_layers=n_layers, block_size=block_size, rope_theta=10000.0,
    )
    torch.manual_seed(seed)
    draft = DFlashDraftModel(config)
    with torch.no_grad():
        for p in draft.parameters():
            if p.dim() == 2:
                p.normal_(0, 0.2)
    return draft.to(dtype or next(target.parameters()).dtype).eval()


def forward_one(adapter, ids: torch.Tensor, positions: torch.Tensor, cache, visibility: torch.Tensor | None = None,
                with_features: bool = True):
    """One sequence's forward of ``ids`` [n] on top of its whole cache through the adapter's one (batch) forward:
    (logits [n, V], features [n, F] or None); ``visibility`` [n, n] among the new tokens (None: causal)."""
    past, n = cache.get_seq_length(), len(ids)
    visible = None
    if visibility is not None:
        visible = torch.ones(1, n, past + n, dtype=torch.bool)
        visible[0, :, past:] = visibility
    out = adapter.forward(ids[None], positions[None], cache, visible, None, with_features)
    return out.logits, None if out.features is None else out.features[0]


def prompt(seed: int, length: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (1, length), generator=g)


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def family(request):
    return request.param


def pytest_configure(config):
    config.addinivalue_line("markers", "measured: the test measures real seconds with ddtree.cost's timer (its "
                                       "subject is the measurement; nothing it asserts may depend on the values)")


@pytest.fixture(autouse=True)
def isolated_caches(request, tmp_path_factory, monkeypatch):
    """Every test starts from empty measured caches (``$DDTREE_CACHE``: cost curves, kernel choices), so no test
    depends on which tests ran before it in its worker. The embedded model's dequantized
    copy (the same weights on every machine, not a measurement) stays shared when it is complete.

    No test branches on the wall clock either: the round clocks of ``ddtree_generate(lookup=True)`` and ``auto``'s
    online curve tick (:func:`steady_clocks`), and the cost curves ``auto`` measures are a fixed calibration
    (:func:`fixed_samples`: every timed call still runs, each costs ``FIXED_SECONDS``) unless a test is marked
    ``measured``. Which branch a test exercises (skip the drafter or not, the tree size) is then the same on an idle
    and on a loaded machine."""
    import ddtree.cost

    real = cache_root()
    mine = tmp_path_factory.mktemp("ddtree-cache")
    for folder in real.glob("smollm2-*") if real.is_dir() else ():
        if (folder / "model.safetensors").is_file() and (folder / "tokenizer.json").is_file():
            (mine / folder.name).symlink_to(folder, target_is_directory=True)
    monkeypatch.setenv("DDTREE_CACHE", str(mine))
    steady_clocks(monkeypatch)
    if request.node.get_closest_marker("measured") is None:
        monkeypatch.setattr(ddtree.cost, "time_samples", fixed_samples)
    yield


FIXED_SECONDS = 1e-3


def fixed_samples(functions, repeats: int, device=None, warmup: int = 0) -> list[list[float]]:
    """The stand-in for :func:`dflash_core.timing.time_samples` in tests: runs every function as often as the real
    timer (so what a measurement does is still checked) and reports ``FIXED_SECONDS`` per call: a flat, load-free
    cost curve, on which ``auto`` verifies trees of more than one node."""
    for _ in range(warmup + repeats):
        for fn in functions:
            fn()
    return [[FIXED_SECONDS] * repeats for _ in functions]


class TickClock:
    """A deterministic stand-in for ``time.perf_counter``: every read is ``step`` seconds after the previous one."""

    def __init__(self, step: float = 0.01) -> None:
        self.now, self.step = 0.0, step

    def perf_counter(self) -> float:
        self.now += self.step
        return self.now


def steady_clocks(monkeypatch, step: float = 0.01) -> TickClock:
    """Replace the wall clock that ``ddtree_generate(lookup=True)`` and ``auto``'s online curve read with a
    :class:`TickClock`, so which branch they take (skip the drafter or not, the corrected curve) does not depend on
    the machine's load."""
    import ddtree.budget
    import ddtree.generate

    clock = TickClock(step)
    monkeypatch.setattr(ddtree.generate, "time", clock)
    monkeypatch.setattr(ddtree.budget, "time", clock)
    return clock


FP32_TIE = 1e-4  # logits: multi-token and one-token fp32 forwards differ by ~1e-5 (see test_default_pair)


def equal_or_fp32_tie(record) -> bool:
    """A benchmark record's output equals plain decoding's, or (greedy) first leaves it where plain decoding's two
    best logits tie in fp32: the margin the record itself measured there is at most ``FP32_TIE``, as
    ``test_default_pair`` admits ties across CPUs. Leaving it at a clear margin, or without a measured margin (a
    sampled record: its draws do not tie), is a real difference."""
    from experiments.bench.schema import EXTRA_AR_MARGIN

    if record.matches_ar:
        return True
    margin = record.extra.get(EXTRA_AR_MARGIN)
    return record.matches_ar is False and record.temperature == 0 and margin is not None and margin <= FP32_TIE


def record_masks(monkeypatch) -> list[bool]:
    """Spy on every target forward of the loop: the list gets, per forward, whether it took a tree mask."""
    from dflash_core.target import TargetAdapter

    masks: list[bool] = []
    real_forward = TargetAdapter.forward

    def forward(self, token_ids, position_ids, cache, visible=None, *args, **kwargs):
        masks.append(visible is not None)
        return real_forward(self, token_ids, position_ids, cache, visible, *args, **kwargs)

    monkeypatch.setattr(TargetAdapter, "forward", forward)
    return masks


@pytest.fixture(scope="module")
def one_thread():
    """Torch on one thread for a module (``pytestmark = pytest.mark.usefixtures("one_thread")``): tiny models gain
    nothing from threads, and on a busy 2-core machine threads make them crawl."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


SAMPLES_PER_CALL = 100


def sampled_answers(generate, n: int, per_call: int = SAMPLES_PER_CALL) -> list:
    """The results of ``n`` sampled runs with seeds 0..n-1, decoded ``per_call`` sequences per call:
    ``generate(seeds)`` decodes one batch (sequence j with seed ``seeds[0] + j``: the call's ``seed=seeds[0]``) and
    returns one result per seed. A sequence in a batch commits exactly its solo run with that seed
    (test_batch.test_sampling_in_a_batch_reproduces_each_solo_run_with_its_seed), so a chi-square test over these
    results tests the solo runs, at a fraction of the per-call cost."""
    results = []
    for start in range(0, n, per_call):
        seeds = list(range(start, min(n, start + per_call)))
        out = generate(seeds)
        assert len(out) == len(seeds)
        results += out
    return results


def answer_counts(results) -> dict[tuple, int]:
    """How often each answer (the tuple of new token ids) occurs among ``results``."""
    counts: dict[tuple, int] = {}
    for r in results:
        counts[tuple(r.new_token_ids)] = counts.get(tuple(r.new_token_ids), 0) + 1
    return counts
