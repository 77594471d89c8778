"""trtllm_backend.triton.params: the parameter table, parsing, validation messages, the table in docs/configuration.md."""

from __future__ import annotations

import dataclasses

import pytest

from trtllm_backend.triton import params as triton_params
from trtllm_backend.triton.params import BY_NAME, PARAMS, ParamError, parse_assignment, parse_params

from tests import ROOT


def test_defaults_parse_and_fill_every_target():
    parsed = parse_params({})
    assert parsed.engine["block_size"] == 16 and parsed.engine["max_model_len"] is None
    assert parsed.sampling == {"max_tokens": 64, "temperature": 0.0, "top_k": 0, "top_p": 1.0}
    assert parsed.model.drain_timeout_s == 5.0
    assert {f.name for f in dataclasses.fields(triton_params.ModelSettings)} == {
        p.field for p in PARAMS if p.scope == "model"
    }


def test_names_are_unique_and_targets_well_formed():
    assert len(BY_NAME) == len(PARAMS)
    assert all(p.scope in ("engine", "sampling", "model") and p.field for p in PARAMS)


def test_sampling_targets_are_sampling_params_fields():
    from trtllm_backend.sampling import SamplingParams

    names = {f.name for f in dataclasses.fields(SamplingParams)}
    assert {p.field for p in PARAMS if p.scope == "sampling"} <= names
    SamplingParams(**parse_params({}).sampling)  # the defaults are a valid request


# NOTE: deliberate differences between what the server serves and the engine library's default.
# fp16 storage of weights and KV served; EngineConfig keeps the exact fp32 reference.
SERVED_DEFAULTS = {"weight_dtype": "float16", "kv_cache_dtype": "float16"}


def test_engine_targets_are_engine_config_fields_with_the_same_defaults():
    config = pytest.importorskip("trtllm_backend.config")
    assert {p.field.partition(".")[0] for p in PARAMS if p.scope == "engine"} <= triton_params.config_field_names()
    defaults = {f.name: f.default for f in dataclasses.fields(config.EngineConfig)}
    for p in PARAMS:
        if p.scope == "engine" and p.name != "fragment_dir" and "." not in p.field:  # no engine default / dict keys
            if p.name in SERVED_DEFAULTS:
                assert p.default == SERVED_DEFAULTS[p.name] and p.parse(p.default) != defaults[p.field], p.name
            else:
                assert p.parse(p.default) == defaults[p.field], p.name


@pytest.mark.parametrize(
    "name,value,needle",
    [
        ("block_size", "abc", "must be an int"),
        ("block_size", "0", "must be >= 1"),
        ("max_tokens_in_paged_kv_cache", "1.5", "must be an int"),
        ("default_top_p", "0", "in (0.0, 1.0]"),
        ("default_temperature", "nan", "must be a float"),
        ("default_temperature", "-0.5", ">= 0.0"),
        ("device", "tpu", "cpu / cuda"),
        ("fragment_dir", "", "non-empty"),
        ("metrics_interval_s", "0", "> 0.0"),
        ("max_model_len", "0", ">= 1"),
    ],
)
def test_bad_values_name_the_parameter(name, value, needle):
    with pytest.raises(ParamError) as info:
        parse_params({name: value})
    assert info.value.name == name and f"parameter '{name}'" in str(info.value) and needle in str(info.value)


def test_unknown_parameter_is_an_error():
    with pytest.raises(ParamError, match="'blocksize': unknown parameter"):
        parse_params({"blocksize": "16"})


def test_morph_thresholds_fill_only_what_is_set():
    assert "morph_overrides" not in parse_params({}).engine  # the policy keeps its own values
    parsed = parse_params({"morph_policy": "int4:4", "morph_down_persist": "3", "morph_up_quiet_s": "1.5"})
    assert parsed.engine["morph_policy"] == "int4:4"
    assert parsed.engine["morph_overrides"] == {"down_persist": 3, "up_quiet_s": 1.5}
    with pytest.raises(ParamError, match="'morph_policy'"):
        parse_params({"morph_policy": "turbo"})


def test_morph_threshold_names_match_the_controller():
    controller = pytest.importorskip("trtllm_backend.controller")
    assert {p.field.partition(".")[2] for p in PARAMS if p.field.startswith("morph_overrides.")} == set(
        controller.MorphPolicy.TUNABLE
    )


def test_optional_values_and_whitespace():
    parsed = parse_params({"max_model_len": "", "num_threads": " 2 "})
    assert parsed.engine["max_model_len"] is None and parsed.engine["num_threads"] == 2


def test_fragment_dir_is_relative_to_the_version_folder():
    assert parse_params({}, base_dir="/m/smollm2/1").engine["fragment_dir"] == "/m/smollm2/1/fragments"
    assert parse_params({"fragment_dir": "/abs/frags"}, base_dir="/m/1").engine["fragment_dir"] == "/abs/frags"


def test_parse_assignment():
    assert parse_assignment("block_size=32") == ("block_size", "32")
    assert parse_assignment("max_model_len=") == ("max_model_len", "")
    with pytest.raises(ParamError):
        parse_assignment("block_size")


def test_engine_config_errors_name_the_parameter():
    pytest.importorskip("trtllm_backend.config")
    parsed = parse_params({})
    parsed.engine["block_size"] = -3  # bypass the table's check: EngineConfig's own checks must be re-raised
    with pytest.raises(ParamError, match="block_size"):
        triton_params.engine_config(parsed)


# --- the docs ----------------------------------------------------------------------------------------------------
def test_docs_table_is_generated_from_the_table():
    doc = (ROOT / "docs" / "configuration.md").read_text()
    assert triton_params.markdown_table() in doc, "regenerate: python -m trtllm_backend.triton.params"


def test_morph_policy_accepts_exactly_the_controllers_names():
    from trtllm_backend.controller import POLICY_NAMES

    for spec in (*POLICY_NAMES, "int4:0", "int4:12"):
        assert parse_params({"morph_policy": spec}).engine["morph_policy"] == spec
    for spec in ("int4:", "int4:x", "full,int4", ""):
        with pytest.raises(ParamError, match="'morph_policy'"):
            parse_params({"morph_policy": spec})
    assert BY_NAME["morph_policy"].check.doc == " / ".join(POLICY_NAMES) + " / int4:N"
