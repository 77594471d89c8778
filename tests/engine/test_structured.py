"""trtllm_backend.structured: guides refused by name when bad, and constrained outputs that always parse and
validate: hypothesis-generated JSON schemas driven through a batch of matchers by random logits (the grammar
alone must guarantee validity, whatever the model prefers), then the real model through the engine."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engines.build_fragments import default_fragment_dir
from trtllm_backend.errors import InvalidRequest
from trtllm_backend.manifest import Manifest
from trtllm_backend.sampling import SamplingParams
from trtllm_backend.structured import GrammarCompiler, Guide, MaskBatch, advance
from trtllm_backend.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tools():
    manifest = Manifest(default_fragment_dir())
    tokenizer = Tokenizer(manifest)
    eos = sorted(tokenizer.eos_token_ids)
    return tokenizer, GrammarCompiler(tokenizer.to_json(), manifest.config.vocab_size, eos), eos


@pytest.mark.parametrize(
    "guide, match",
    [
        (lambda: Guide("xml", "x"), "type must be one of"),
        (lambda: Guide("regex"), "needs its text"),
    ],
)
def test_bad_guides_are_refused_when_made(guide, match):
    with pytest.raises(InvalidRequest, match=f"^guide: .*{match}"):
        guide()


@pytest.mark.parametrize(
    "guide",
    [
        Guide("json_schema", "{not json"),
        Guide("json_schema", "[1]"),
        Guide("regex", "(unclosed"),
        Guide("grammar", "start: undefined_rule"),
    ],
)
@pytest.mark.needs_model
def test_bad_guide_text_is_refused_when_compiled(tools, guide):
    with pytest.raises(InvalidRequest, match="^guide: "):
        tools[1].matcher(guide)


def test_a_guide_excludes_a_forced_length():
    with pytest.raises(InvalidRequest, match="^min_tokens"):
        SamplingParams(min_tokens=3, guide=Guide("json"))
    with pytest.raises(InvalidRequest, match="^ignore_eos"):
        SamplingParams(ignore_eos=True, guide=Guide("json"))


# --- any schema, any logits: the output parses and validates ------------------------------------------------------
leaf = st.one_of(
    st.just({"type": "string", "maxLength": 12}),
    st.just({"type": "integer"}),
    st.just({"type": "boolean"}),
    st.just({"type": "number"}),
    st.just({"type": "null"}),
    st.lists(st.text("abcxyz", min_size=1, max_size=4), min_size=1, max_size=3, unique=True).map(lambda v: {"enum": v}),
    st.integers(0, 50).map(lambda lo: {"type": "integer", "minimum": lo, "maximum": lo + 100}),
)
names = st.text("abcdefgh_", min_size=1, max_size=6)


def objects(children):
    return st.dictionaries(names, children, min_size=1, max_size=4).flatmap(
        lambda props: st.builds(
            lambda required, extra: {
                "type": "object",
                "properties": props,
                "required": required,
                "additionalProperties": extra,
            },
            st.lists(st.sampled_from(sorted(props)), unique=True),
            st.just(False),
        )
    )


schemas = st.recursive(
    leaf,
    lambda children: st.one_of(
        objects(children), children.map(lambda items: {"type": "array", "items": items, "maxItems": 3})
    ),
    max_leaves=6,
)


def run_constrained(tools, guides: list[Guide], seed: int, max_steps: int = 400) -> list[str | None]:
    """Random logits, tilted towards closing tokens so most documents end; None for a row still open at the end."""
    tokenizer, compiler, eos = tools
    matchers = [compiler.matcher(g) for g in guides]
    vocab = compiler.vocab_size
    bias = torch.zeros(vocab)
    for text in ('"', "}", "]", ",", " ", "0", "1", "true", "null"):
        bias[tokenizer.encode(text)] = 6.0
    bias[eos] = 8.0
    gen = torch.Generator().manual_seed(seed)
    masks, outputs, live = MaskBatch(), [[] for _ in guides], list(range(len(guides)))
    for _ in range(max_steps):
        if not live:
            break
        logits = torch.randn(len(live), vocab, generator=gen) * 2 + bias
        masks.apply(logits, list(range(len(live))), [matchers[r] for r in live])
        tokens = torch.multinomial(torch.softmax(logits, dim=-1), 1, generator=gen).view(-1).tolist()
        for r, tok in zip(list(live), tokens):
            advance(matchers[r], tok)
            if tok in eos:
                live.remove(r)
            else:
                outputs[r].append(tok)
    return [None if r in live else tokenizer.decode(ids) for r, ids in enumerate(outputs)]


@pytest.mark.needs_model
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(schema=st.one_of(objects(schemas), schemas), seed=st.integers(0, 2**16))
def test_any_schema_under_any_logits_parses_and_validates(tools, schema, seed):
    texts = run_constrained(tools, [Guide("json_schema", json.dumps(schema))] * 3, seed)  # one batch of three rows
    finished = [t for t in texts if t is not None]
    assert finished, "no row ended in 400 steps"
    for text in finished:
        jsonschema.validate(json.loads(text), schema)


@pytest.mark.needs_model
def test_json_object_and_regex_guides(tools):
    for text in run_constrained(tools, [Guide("json")] * 2, seed=1):
        assert text is None or isinstance(json.loads(text), dict)
    for text in run_constrained(tools, [Guide("regex", r"[0-9]{3}-[a-z]{2}")] * 2, seed=2):
        assert text is not None and len(text) == 6 and text[3] == "-"


@pytest.mark.needs_model
def test_the_engine_serves_a_schema_beside_free_requests():
    from tests.engine_fixtures import make_engine

    engine = make_engine()
    schema = {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer"}},
        "required": ["name", "age"],
        "additionalProperties": False,
    }
    prompt = engine.tokenizer.chat_prompt("Give me a person as JSON.")
    outs: dict[str, list] = {}
    for rid, guide in (
        ("schema", Guide("json_schema", json.dumps(schema))),
        ("free", None),
        ("regex", Guide("regex", r"(yes|no)")),
    ):
        engine.add_request(
            prompt,
            SamplingParams(max_tokens=48, guide=guide),
            lambda o, rid=rid: outs.setdefault(rid, []).append(o),
            request_id=rid,
        )
    engine.run_until_idle()
    text = "".join(o.text for o in outs["schema"])
    assert outs["schema"][-1].finish_reason == "stop", text
    jsonschema.validate(json.loads(text), schema)
    assert "".join(o.text for o in outs["regex"]) in ("yes", "no")
