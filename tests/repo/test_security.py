"""docs/security.md, kept true: no pickle-based loading anywhere in the source, and a fragment whose
bytes do not match its manifest's sha256 is refused before use."""

import re
import shutil

import pytest

from tests import ROOT
from tests.engine_fixtures import fragment_dir

from trtllm_backend.errors import FragmentError
from trtllm_backend.manifest import Manifest

UNSAFE = re.compile(
    r"^\s*(import pickle|from pickle|import dill|import cloudpickle)|torch\.load\(|allow_pickle\s*=\s*True"
    r"|pd\.read_pickle",
    re.M,
)


def test_no_pickle_loading_in_the_source():
    hits = []
    for folder in ("trtllm_backend", "engines", "plugins", "tools", "model_repository", "docker"):
        for path in (ROOT / folder).rglob("*.py"):
            if UNSAFE.search(path.read_text(errors="replace")):
                hits.append(str(path.relative_to(ROOT)))
    assert not hits, f"pickle-based loading in {hits}"


@pytest.mark.needs_model
def test_a_fragment_not_matching_its_sha256_is_refused(tmp_path):
    src, dst = fragment_dir(), tmp_path / "fragments"
    shutil.copytree(src, dst, symlinks=False, ignore=shutil.ignore_patterns("*.safetensors"))
    m = Manifest(src)
    entry = m.fragment(0, m.precisions(0)[0])
    data = bytearray((src / entry["file"]).read_bytes())
    data[len(data) // 2] ^= 0x01  # one bit, same size
    (dst / entry["file"]).write_bytes(data)
    with pytest.raises(FragmentError, match="sha256"):
        Manifest(dst).verified_path(entry)
