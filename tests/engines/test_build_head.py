"""The INT8 embedding / LM head as part of the default fragment set: `build_fragments --if-missing` (tools/setup.sh's
step) adds it to a set that predates it, re-ranks it when the layer order is re-profiled, rebuilds it when it no
longer verifies, and is a no-op when it is up to date. Runs on an overlay of the real set (its files linked); the
head's scoring (engines.layer_importance.head_rank on the whole model, tests/engine/test_head_unit.py) is replaced by a
recorder here, so the test is about what setup decides."""

import json

import pytest
from tests.engine_fixtures import fragment_dir

from engines import build_fragments as bf
from trtllm_backend.errors import FragmentError
from trtllm_backend.manifest import HEAD_UNIT, MANIFEST, Manifest, write_manifest
from trtllm_backend.precision import Precision

pytestmark = pytest.mark.needs_model


@pytest.fixture
def old_set(tmp_path):
    """An overlay of the real set as it was before the head unit: no "lm_head" entry, no head file."""
    out = tmp_path / "fragments"
    bf.link_set(fragment_dir(), out)
    data = Manifest(out).data
    data.pop(HEAD_UNIT, None)
    write_manifest(out, data)
    (out / bf.head_file(Precision.INT8)).unlink(missing_ok=True)
    assert data.get("swap_order_profile", {}).get("rounds"), "the real set's layer order is not profiled (make setup)"
    return out


@pytest.fixture
def scored(monkeypatch, tmp_path):
    """Replaces the head's scoring with a recorder that ranks it third; the text it would read is a file here."""
    calls = []

    def fake(fragment_dir, profile, corpus):
        assert corpus.is_file()
        calls.append(bf.profile_key(profile))
        return 3, {"lrs": 0.99, "mds": 0.999, "lis": 0.996}

    monkeypatch.setattr(bf, "score_head_rank", fake)
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("text")
    return calls, ["--corpus", str(corpus)]


def head_path(out):
    return out / bf.head_file(Precision.INT8)


def test_if_missing_adds_the_head_to_a_set_that_predates_it_then_does_nothing(old_set, scored):
    calls, corpus = scored
    assert bf.head_state(old_set) == "missing"
    assert bf.main(["--if-missing", "--out", str(old_set), *corpus]) == 0
    m = Manifest(old_set)
    assert bf.head_state(old_set) == "ok" and len(calls) == 1
    assert (old_set / bf.layer_file(0, Precision.FULL)).is_symlink()  # the layers were not rebuilt
    assert m.data["layers"] == Manifest(fragment_dir()).data["layers"]
    assert not head_path(old_set).is_symlink() and m.head_swappable()
    assert m.data[HEAD_UNIT]["fragments"][Precision.INT8]["source_sha256"] == m.data["shared"]["sha256"]
    assert m.unit_order()[3] == HEAD_UNIT and m.data[HEAD_UNIT]["rank_profile"]["lis"] == 0.996
    # Up to date: setup's two steps leave it alone (no rewrite, no scoring).
    stamp = head_path(old_set).stat().st_mtime_ns, head_path(old_set).stat().st_ino
    before = (old_set / MANIFEST).read_text()
    assert bf.main(["--if-missing", "--out", str(old_set), *corpus]) == 0
    assert bf.main(["--lm-head-int8", "--if-missing", "--out", str(old_set), *corpus]) == 0
    assert len(calls) == 1 and (head_path(old_set).stat().st_mtime_ns, head_path(old_set).stat().st_ino) == stamp
    assert (old_set / MANIFEST).read_text() == before


def test_a_reprofiled_order_re_ranks_and_a_damaged_head_is_rebuilt(old_set, scored):
    calls, corpus = scored
    bf.main(["--lm-head-int8", "--out", str(old_set), *corpus])
    stamp = head_path(old_set).stat().st_ino
    # The layer order re-profiled (tools.profile_layers rewrites swap_order_profile): only the rank is redone.
    data = Manifest(old_set).data
    data["swap_order_profile"]["seconds"] += 1.0
    write_manifest(old_set, data)
    assert bf.head_state(old_set) == "unranked"
    assert bf.main(["--lm-head-int8", "--if-missing", "--out", str(old_set), *corpus]) == 0
    assert len(calls) == 2 and calls[-1] == bf.profile_key(data["swap_order_profile"])
    assert head_path(old_set).stat().st_ino == stamp and bf.head_state(old_set) == "ok"
    # A corrupt head file is rebuilt (and ranked again).
    raw = bytearray(head_path(old_set).read_bytes())
    raw[-8] ^= 1
    head_path(old_set).write_bytes(raw)
    assert bf.head_state(old_set) == "missing"
    assert bf.main(["--if-missing", "--out", str(old_set), *corpus]) == 0
    assert bf.head_state(old_set) == "ok" and len(calls) == 3
    # The profile dropped: the stale rank goes too (first in the order, as for an unprofiled set).
    data = Manifest(old_set).data
    del data["swap_order_profile"]
    write_manifest(old_set, data)
    assert bf.head_state(old_set) == "unranked"
    bf.ensure_head(old_set)
    m = Manifest(old_set)
    assert m.data[HEAD_UNIT]["swap_rank"] is None and m.unit_order()[0] == HEAD_UNIT and len(calls) == 3
    assert bf.head_state(old_set) == "ok"


def test_no_lm_head_and_untied_models_build_no_head(old_set, scored):
    calls, corpus = scored
    assert bf.main(["--if-missing", "--no-lm-head", "--out", str(old_set)]) == 0
    assert bf.head_state(old_set) == "missing" and not head_path(old_set).exists()
    with pytest.raises(SystemExit):
        bf.main(["--lm-head-int8", "--no-lm-head", "--out", str(old_set)])
    data = json.loads((old_set / MANIFEST).read_text())
    data["config"]["tie_word_embeddings"] = False
    write_manifest(old_set, data)
    assert bf.head_state(old_set) == "untied"
    assert bf.main(["--if-missing", "--out", str(old_set), *corpus]) == 0  # nothing to add: not an error
    assert HEAD_UNIT not in Manifest(old_set).data and not calls
    with pytest.raises(FragmentError, match="not tied"):
        bf.main(["--lm-head-int8", "--out", str(old_set), *corpus])
