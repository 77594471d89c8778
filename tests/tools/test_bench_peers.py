"""tools.bench_peers without servers: rounds combined into medians and ranges, the report from them."""

from __future__ import annotations

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
    assert "20.0-30.0 GB/s" in text and "| llama.cpp | 100.0 | 250 | 100 | 40% [33%, 50%] |" in text
    assert bench_peers.floor_lines({"levels": [bench_peers.combine_rounds(4, rounds)]}) == []  # not one stream


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
