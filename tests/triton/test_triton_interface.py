"""trtllm_backend.triton.interface: both TensorRT-LLM name sets in one table, config.pbtxt declaring exactly that
table, every LLM-API backend input served or refused by name, the outputs a request asks for, the tables in
docs/configuration.md."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
from tests import ROOT

from trtllm_backend.errors import InvalidRequest
from trtllm_backend.logprobs import TokenLogprob
from trtllm_backend.outputs import KVReuse, RequestTimings
from trtllm_backend.triton import interface
from trtllm_backend.triton.interface import Piece, Returns, decode_request, response_outputs

CONFIG = ROOT / "model_repository" / "smollm2" / "config.pbtxt"
# Every input of TensorRT-LLM's triton_backend/all_models/llmapi/tensorrt_llm/config.pbtxt (and the named
# logits post-processor its helpers read).
LLMAPI_INPUTS = (
    "text_input",
    "image_url",
    "streaming",
    "sampling_param_best_of",
    "sampling_param_temperature",
    "sampling_param_top_k",
    "sampling_param_top_p",
    "sampling_param_frequency_penalty",
    "sampling_param_presence_penalty",
    "sampling_param_max_tokens",
    "sampling_param_stop",
    "sampling_param_seed",
    "sampling_param_exclude_input_from_output",
    "sampling_param_return_perf_metrics",
    "return_finish_reason",
    "return_stop_reason",
    "return_cumulative_logprob",
    "stop",
    "lora_id",
    "lora_name",
    "lora_path",
    "lora_ckpt_source",
    "sampling_param_logits_post_processor_name",
)
LLMAPI_OUTPUTS = (
    "text_output",
    "finish_reason",
    "stop_reason",
    "cumulative_logprob",
    "kv_cache_reused_block",
    "kv_cache_missed_block",
    "kv_cache_alloc_new_blocks",
    "kv_cache_alloc_total_blocks",
    "kv_cache_hit_rate",
    "arrival_time_ns",
    "first_scheduled_time_ns",
    "first_token_time_ns",
    "last_token_time_ns",
    "acceptance_rate",
    "total_accepted_draft_tokens",
    "total_draft_tokens",
)


def declared(section: str) -> dict[str, tuple[str, str]]:
    text = CONFIG.read_text()
    body = re.search(rf"^{section} \[\n(.*?)^\]", text, re.S | re.M).group(1)
    return {
        m["name"]: (m["type"], m["dims"].strip())
        for m in re.finditer(r'name: "(?P<name>[^"]+)"\s+data_type: (?P<type>\w+)\s+dims: \[(?P<dims>[^\]]+)\]', body)
    }


def scalar(value, dtype):
    return np.array([[value]], dtype=dtype)


def text(value: str):
    return np.array([[value.encode()]], dtype=np.object_)


def test_config_declares_exactly_the_table():
    assert declared("input") == {n: (s.dtype, s.dims) for s in interface.INPUTS for n in s.names}
    assert declared("output") == {o.name: (o.dtype, o.dims) for o in interface.OUTPUTS}


def test_every_llmapi_input_and_output_is_declared():
    assert set(LLMAPI_INPUTS) <= set(interface.BY_NAME)
    assert set(LLMAPI_OUTPUTS) <= {o.name for o in interface.OUTPUTS}


def test_both_name_sets_decode_to_the_same_request():
    trt = decode_request(
        {
            "text_input": text("Hi"),
            "max_tokens": scalar(5, np.int32),
            "temperature": scalar(0.5, np.float32),
            "top_k": scalar(3, np.int32),
            "top_p": scalar(0.9, np.float32),
            "random_seed": scalar(7, np.uint64),
            "stop_words": np.array([[b"a", b""]], dtype=np.object_),
            "stream": scalar(True, np.bool_),
            "frequency_penalty": scalar(0.5, np.float32),
        },
        {},
    )
    llm = decode_request(
        {
            "text_input": text("Hi"),
            "sampling_param_max_tokens": scalar(5, np.int32),
            "sampling_param_temperature": scalar(0.5, np.float32),
            "sampling_param_top_k": scalar(3, np.int32),
            "sampling_param_top_p": scalar(0.9, np.float32),
            "sampling_param_seed": scalar(7, np.uint64),
            "sampling_param_stop": np.array([[b"a"]], dtype=np.object_),
            "streaming": scalar(True, np.bool_),
            "sampling_param_frequency_penalty": scalar(0.5, np.float32),
        },
        {},
    )
    assert trt.params == llm.params and trt.stream and llm.stream
    assert not trt.returns.cumulative_text and llm.returns.cumulative_text  # the LLM API streams the whole text
    assert trt.exclude_input and llm.exclude_input


def test_defaults_for_echo_differ_by_name_set_and_an_explicit_value_wins():
    assert not decode_request(
        {"text_input": text("Hi")}, {}
    ).exclude_input  # TensorRT-engine: echoed when not streaming
    assert decode_request(
        {"text_input": text("Hi"), "sampling_param_max_tokens": scalar(2, np.int32)}, {}
    ).exclude_input
    assert not decode_request(
        {"text_input": text("Hi"), "sampling_param_exclude_input_from_output": scalar(False, np.bool_)}, {}
    ).exclude_input


@pytest.mark.parametrize(
    "arrays, name",
    [
        (
            {"max_tokens": scalar(3, np.int32), "sampling_param_max_tokens": scalar(4, np.int32)},
            "sampling_param_max_tokens",
        ),
        ({"random_seed": scalar(3, np.uint64), "seed": scalar(4, np.uint64)}, "seed"),
        ({"lora_id": scalar(1, np.uint64)}, "lora_id"),
        ({"lora_name": text("x")}, "lora_name"),
        ({"image_url": np.array([[b"http://x"]], dtype=np.object_)}, "image_url"),
        ({"sampling_param_logits_post_processor_name": text("p")}, "sampling_param_logits_post_processor_name"),
        ({"sampling_param_best_of": scalar(2, np.int32)}, "sampling_param_best_of"),
        ({"streaming": scalar(3, np.int32)}, "streaming"),
        ({"top_logprobs": scalar(2.5, np.float32)}, "top_logprobs"),
        ({"no_such_input": scalar(1, np.int32)}, "no_such_input"),
    ],
)
def test_bad_or_unsupported_inputs_are_refused_by_name(arrays, name):
    with pytest.raises(InvalidRequest, match=f"^{name}: "):
        decode_request({"text_input": text("Hi")} | arrays, {})


def test_the_same_value_under_both_names_is_fine():
    d = decode_request(
        {"text_input": text("Hi"), "max_tokens": scalar(3, np.int32), "sampling_param_max_tokens": scalar(3, np.int64)},
        {},
    )
    assert d.params.max_tokens == 3


def test_log_prob_inputs_set_the_sampling_fields():
    d = decode_request(
        {
            "text_input": text("Hi"),
            "top_logprobs": scalar(3, np.int32),
            "return_prompt_log_probs": scalar(True, np.bool_),
        },
        {},
    )
    assert (d.params.logprobs, d.params.prompt_logprobs, d.returns.log_probs) == (3, 3, True)
    d = decode_request({"text_input": text("Hi"), "return_cumulative_logprob": scalar(True, np.bool_)}, {})
    assert d.params.logprobs == 0 and d.params.prompt_logprobs is None and not d.returns.log_probs
    assert decode_request({"text_input": text("Hi")}, {}).params.logprobs is None


def test_outputs_are_those_asked_for_with_consistent_shapes():
    lp = [TokenLogprob(5, -0.5, ((5, -0.5), (6, -1.5))), TokenLogprob(7, -2.0, ((8, -0.1), (7, -2.0)))]
    piece = Piece(
        "ab",
        [5, 7],
        [0, 0],
        lp,
        prompt_ids=[1, 2],
        prompt_logprobs=[None, TokenLogprob(2, -3.0, ((2, -3.0), (4, -4.0)))],
        num_prompt_tokens=2,
        finish_reason="stop",
        stop_reason="\n",
        cumulative_logprob=-2.5,
        timings=RequestTimings(arrival=1.0, scheduled=1.5, first_token=2.0, last_token=3.0),
        kv_reuse=KVReuse(0, 1, 1, 1),
    )
    plain = response_outputs(piece, Returns())
    assert set(plain) == {
        "text_output",
        "output_token_count",
        "int4_layers",
        "prompt_token_count",
        "prompt_cached_token_count",
        "finish_reason",
    }
    full = response_outputs(
        piece,
        Returns(
            log_probs=True,
            top_logprobs=2,
            prompt_log_probs=True,
            stop_reason=True,
            cumulative_logprob=True,
            perf_metrics=True,
        ),
    )
    assert set(full) == {o.name for o in interface.OUTPUTS}
    assert full["output_ids"].tolist() == [[5, 7]] and full["output_log_probs"].tolist() == [[-0.5, -2.0]]
    assert full["output_top_ids"].shape == (1, 2, 2) and full["output_top_ids"][0, 1].tolist() == [8, 7]
    assert math.isnan(full["prompt_log_probs"][0, 0]) and full["prompt_log_probs"][0, 1] == -3.0
    assert full["prompt_top_ids"][0, 0].tolist() == [-1, -1]
    assert full["stop_reason"][0, 0] == b"\n" and full["cumulative_logprob"][0, 0] == -2.5
    assert full["arrival_time_ns"][0, 0] == 1_000_000_000 and full["last_token_time_ns"][0, 0] == 3_000_000_000
    assert full["kv_cache_missed_block"][0, 0] == 1 and full["kv_cache_hit_rate"][0, 0] == 0.0
    for o in interface.OUTPUTS:  # every array has the batch dimension and the declared rank
        assert full[o.name].shape[0] == 1 and full[o.name].ndim == 1 + len(o.dims.split(","))


def test_docs_tables_are_generated_from_the_table():
    assert interface.markdown_tables() in (ROOT / "docs" / "configuration.md").read_text(), (
        "regenerate: python -m trtllm_backend.triton.interface"
    )
