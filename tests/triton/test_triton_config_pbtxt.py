"""trtllm_backend.triton.config_pbtxt: reading and editing config.pbtxt parameters, the edited repository copy."""

from __future__ import annotations


import pytest

from trtllm_backend.triton import server
from trtllm_backend.triton.config_pbtxt import apply_overrides, model_parameters, read_parameters, set_parameters
from trtllm_backend.triton.params import PARAMS, ParamError

from tests import ROOT

CONFIG = ROOT / "model_repository" / "smollm2" / "config.pbtxt"


def test_shipped_config_lists_every_parameter_at_its_default():
    values = read_parameters(CONFIG.read_text())
    assert values == {p.name: p.default for p in PARAMS}


def test_set_parameters_replaces_and_appends():
    text = 'name: "m"\nparameters: {\n  key: "block_size"\n  value: { string_value: "16" }\n}\n'
    out = set_parameters(text, {"block_size": "32", "device": 'c"p\\u'})
    assert read_parameters(out) == {"block_size": "32", "device": 'c"p\\u'}
    assert out.count("parameters") == 2


def test_set_parameters_keeps_the_rest_of_the_file():
    text = CONFIG.read_text()
    out = set_parameters(text, {"block_size": "32"})
    assert out != text and read_parameters(out)["block_size"] == "32"
    assert set_parameters(out, {"block_size": "16"}) == text  # comments and layout untouched


def test_overrides_are_validated_before_any_server_starts():
    repo = ROOT / "model_repository"
    with pytest.raises(ParamError, match="'block_size'"):
        model_parameters(repo, "smollm2", {"block_size": "zero"})
    with pytest.raises(ParamError, match="'nope'"):
        server.launch(repo, params={"nope": "1"}, build_fragments=False)
    parsed = model_parameters(repo, "smollm2", {"block_size": "32"})
    assert parsed.engine["block_size"] == 32


def test_apply_overrides_writes_an_edited_copy(tmp_path):
    repo = tmp_path / "repo"
    (repo / "m" / "1").mkdir(parents=True)
    (repo / "m" / "1" / "model.py").write_text("# model")
    (repo / "m" / "config.pbtxt").write_text('parameters: { key: "block_size" value: { string_value: "16" } }\n')
    (repo / "other").mkdir()
    dest = apply_overrides(repo, "m", {"block_size": "8", "max_queue_size": "2"}, tmp_path / "copy")
    assert read_parameters((dest / "m" / "config.pbtxt").read_text()) == {"block_size": "8", "max_queue_size": "2"}
    assert (dest / "m" / "1").is_symlink() and (dest / "m" / "1" / "model.py").read_text() == "# model"
    assert (dest / "other").is_symlink()
    assert read_parameters((repo / "m" / "config.pbtxt").read_text()) == {"block_size": "16"}
