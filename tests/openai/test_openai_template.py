"""The chat template shipped with the fragments, rendered by the gateway, against transformers' own renderer."""

import json
import os
from pathlib import Path

import pytest
from tests import ROOT

from trtllm_backend.openai.errors import OpenAIError
from trtllm_backend.openai.template import ChatTemplate, TemplateError


def fragment_dir() -> Path:
    # NOTE: not engine_fixtures.fragment_dir: the gateway needs no engine, and neither does its test.
    d = Path(os.environ.get("MORPHSERVE_TEST_FRAGMENTS") or ROOT / "model_repository" / "smollm2" / "1" / "fragments")
    assert (d / "manifest.json").is_file(), f"fragments missing in {d}: run `make setup` (tools/setup.sh) first"
    return d


CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}],
    [
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": "Blue."},
        {"role": "user", "content": "Another one, ünïcödé 😀"},
    ],
]


@pytest.mark.needs_model
@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_renders_as_transformers_does(messages):
    from transformers import PreTrainedTokenizerFast

    d = fragment_dir()
    manifest = json.loads((d / "manifest.json").read_text())
    reference = PreTrainedTokenizerFast(
        tokenizer_file=str(d / "tokenizer.json"),
        chat_template=manifest["tokenizer"]["chat_template"],
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    ours = ChatTemplate.from_fragments(d)
    for add in (True, False):
        expected = reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=add)
        assert ours.render(messages, add_generation_prompt=add) == expected


@pytest.mark.needs_model
def test_smollm2_template_is_chatml_with_its_default_system_prompt():
    out = ChatTemplate.from_fragments(fragment_dir()).render([{"role": "user", "content": "hi"}])
    assert out == (
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_refuses_is_a_400_naming_messages():
    t = ChatTemplate("{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    assert t.render([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(OpenAIError) as e:
        t.render([{"role": "assistant", "content": "x"}])
    assert e.value.status == 400 and e.value.param == "messages" and "first must be user" in e.value.message


def test_missing_or_broken_templates_are_named(tmp_path):
    with pytest.raises(TemplateError, match="manifest.json not found"):
        ChatTemplate.from_fragments(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"tokenizer": {"file": "tokenizer.json"}}))
    with pytest.raises(TemplateError, match="no tokenizer.chat_template"):
        ChatTemplate.from_fragments(tmp_path)
    with pytest.raises(TemplateError, match="does not parse"):
        ChatTemplate("{% for m in messages %}")
