"""engines.offline_model.suffix_nll: a prefix's KV written under one layer binding and read under another (what
a prefix-cache hit across a morph swap serves), on the real model."""

import pytest
import torch
import torch.nn.functional as F

from engines.build_fragments import default_fragment_dir

pytestmark = pytest.mark.needs_model

PREFIX = 48  # three whole 16-token blocks, as the prefix cache shares them
CHUNKING_NOISE = 1e-4  # relative; measured 1.6e-5


@pytest.fixture(scope="module")
def model():
    from engines.offline_model import OfflineModel
    from trtllm_backend.kernel_numerics import KernelNumerics

    # The kernels read process-wide switches that engine tests set: pin those a fresh process starts with, which
    # tools.eval_quality runs under (INT4 prefill dequantized to fp32: the weights' own cost).
    before = KernelNumerics.in_force()
    KernelNumerics("int8", "float32", "float32").put_in_force()
    yield OfflineModel(default_fragment_dir(), max_len=64, weight_dtype=torch.float16, kv_dtype=torch.float16)
    if before is not None:
        before.put_in_force()


@pytest.fixture(scope="module")
def ids(model):
    from engines.offline_model import corpus_tokens
    from tools.eval_quality import DEFAULT_CORPUS
    from trtllm_backend.tokenizer import Tokenizer

    return corpus_tokens(Tokenizer(model.manifest), DEFAULT_CORPUS, 0.9, 1.0, 2, 64)


def _one_pass_suffix_nll(model, ids, layers) -> float:
    model.set_quantized(layers)
    states, _, _ = model.layer_inputs(ids)
    logits = model.logits(states[-1]).view(ids.shape[0], ids.shape[1], -1)
    tail = logits[:, PREFIX:-1]
    return float(F.cross_entropy(tail.reshape(-1, tail.shape[-1]), ids[:, PREFIX + 1 :].reshape(-1), reduction="sum"))


def test_two_chunks_at_full_precision_equal_one_pass(model, ids):
    # At full precision only float rounding differs (the chunked attention sums in another order). INT4 layers'
    # prefill numerics depend on how many rows a call carries (0.14% here), which is why the check's exact
    # baseline is the same two chunks under one binding, not a single pass.
    nll, n = model.suffix_nll(ids, PREFIX, [], [])
    assert n == ids.shape[0] * (ids.shape[1] - PREFIX - 1)
    assert nll == pytest.approx(_one_pass_suffix_nll(model, ids, []), rel=CHUNKING_NOISE)


def test_the_prefix_kv_comes_from_the_writer_binding(model, ids):
    every = model.manifest.swap_order()
    exact, _ = model.suffix_nll(ids, PREFIX, [], [])
    crossed, _ = model.suffix_nll(ids, PREFIX, every, [])
    all_int4, _ = model.suffix_nll(ids, PREFIX, every, every)
    # The reader sees the INT4-written KV, not its own, and runs its own layers on the suffix: both differences
    # stand well above the chunking's rounding.
    assert abs(crossed / exact - 1) > 10 * CHUNKING_NOISE
    assert abs(crossed / all_int4 - 1) > 10 * CHUNKING_NOISE
    assert model.suffix_nll(ids, PREFIX, every, [])[0] == crossed  # deterministic


@pytest.mark.parametrize("prefix", [0, 63, 64])
def test_a_prefix_that_leaves_nothing_to_score_is_refused(model, ids, prefix):
    with pytest.raises(ValueError, match="prefix_len"):
        model.suffix_nll(ids, prefix, [], [])
