"""trtllm_backend.huge_pages: buffers on 2 MiB pages, layers packed into one, and the engine's weights and KV there."""

import os

import pytest
import torch

from trtllm_backend import huge_pages

needs_thp = pytest.mark.skipif(
    huge_pages.thp_mode() not in ("always", "madvise"), reason="the kernel offers no transparent huge pages here"
)


def test_small_buffers_are_plain_and_large_ones_start_on_a_page():
    assert huge_pages.empty(1000).numel() == 1000
    buf = huge_pages.empty(5 * huge_pages.HUGE_PAGE + 123)
    assert buf.numel() == 5 * huge_pages.HUGE_PAGE + 123 and buf.dtype == torch.uint8
    assert buf.data_ptr() % huge_pages.HUGE_PAGE == 0
    t = huge_pages.empty_tensor((3, 1024, 1024), torch.float16)
    assert t.shape == (3, 1024, 1024) and t.dtype == torch.float16 and t.is_contiguous()


@needs_thp
def test_a_touched_buffer_lies_on_huge_pages():
    before = huge_pages.anon_huge_bytes()
    buf = huge_pages.empty(8 * huge_pages.HUGE_PAGE)
    buf.fill_(1)
    # all 8 pages, or nearly: the kernel may not find a free 2 MiB page for every one on a fragmented machine
    assert huge_pages.anon_huge_bytes() - before >= 6 * huge_pages.HUGE_PAGE
    del buf


def test_a_dropped_buffer_gives_its_memory_back():
    def rss():
        return int(open("/proc/self/statm").read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    before = rss()
    t = huge_pages.empty_tensor((8, 1 << 20), torch.float32)  # 32 MiB
    t.fill_(1.0)
    view = t[3]
    assert rss() - before >= 30 << 20
    del t
    assert view.sum().item() == 1 << 20  # a view keeps the mapping
    del view
    assert rss() - before < 4 << 20


def test_pack_copies_side_by_side_in_one_buffer():
    g = torch.Generator().manual_seed(0)
    parts = [
        torch.randn(700, 576, generator=g).half(),
        torch.randn(3),
        torch.randint(-128, 127, (1000, 577), generator=g, dtype=torch.int8),
        torch.randn(5, 7).t(),
    ]
    moved = huge_pages.pack(parts)
    for a, b in zip(parts, moved):
        assert b.dtype == a.dtype and b.shape == a.shape and b.is_contiguous() and torch.equal(a, b)
        assert b.data_ptr() != a.data_ptr() and b.data_ptr() % huge_pages.ALIGN == 0
    storages = {t.untyped_storage().data_ptr() for t in moved}
    assert len(storages) == 1
    ends = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()) for t in moved)
    assert all(e <= s for (_, e), (s, _) in zip(ends, ends[1:]))  # no overlap


@pytest.mark.parametrize(
    "text, reason",
    [
        ("always [madvise] never\n", None),
        ("[always] madvise never\n", None),
        ("always madvise [never]\n", "off"),
        (None, "no transparent huge pages"),
    ],
)
def test_the_reason_for_no_huge_pages_names_the_setting(tmp_path, monkeypatch, text, reason):
    setting = tmp_path / "enabled"
    if text is not None:
        setting.write_text(text)
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    why = huge_pages.unavailable_reason()
    assert why is None if reason is None else (reason in why and str(setting) in why)


def test_pack_of_nothing_on_the_cpu_is_the_input():
    assert huge_pages.pack([]) == []


def test_a_layer_packs_into_one_buffer_and_computes_the_same():
    from plugins.quant_matmul import Int4Linear, Int8Linear
    from trtllm_backend.layers import DenseLinear, LayerWeights

    g = torch.Generator().manual_seed(1)
    w = lambda o, i: torch.randn(o, i, generator=g) * 0.05  # noqa: E731
    layer = LayerWeights(
        torch.rand(576, generator=g),
        torch.rand(576, generator=g),
        Int4Linear.from_float(w(960, 576)),
        DenseLinear(w(576, 576).half()),
        Int8Linear.from_float(w(3072, 576)),
        Int4Linear.from_float(w(576, 1536), pre_scale=torch.rand(1536) + 0.5),
    )
    x, x2 = torch.randn(3, 576, generator=g), torch.randn(3, 1536, generator=g)
    ops = (layer.qkv, layer.o, layer.gate_up)
    before = [op(x) for op in ops] + [layer.down(x2)]
    nbytes = layer.nbytes
    assert layer.pack_on_huge_pages() is layer
    after = [op(x) for op in ops] + [layer.down(x2)]
    assert all(torch.equal(a, b) for a, b in zip(before, after))
    assert layer.nbytes == nbytes
    held = [
        layer.input_layernorm,
        layer.post_attention_layernorm,
        *(t for op in (*ops, layer.down) for t in op.resident_tensors()),
    ]
    assert len({t.untyped_storage().data_ptr() for t in held}) == 1


def test_an_int8_table_adopts_its_bytes_in_the_layout_it_holds():
    from plugins.int8_linear import Int8Table

    table = Int8Table.from_float(torch.randn(64, 128, generator=torch.Generator().manual_seed(2)))
    x = torch.randn(2, 128)
    ref, rows = table.linear(x), table.weight.clone()
    table.adopt(huge_pages.pack(table.resident_tensors()))
    assert torch.equal(table.linear(x), ref) and torch.equal(table.weight, rows)
    assert torch.equal(table.lookup(torch.tensor([0, 63])), rows[[0, 63]].float() * table.scales[[0, 63], None])


@pytest.mark.needs_model
def test_the_engine_puts_weights_and_kv_on_huge_pages_and_decodes_bitwise_the_same():
    from tests.engine_fixtures import make_engine

    from trtllm_backend.sampling import SamplingParams

    logits = {}
    for on in (False, True):
        # half the layers INT4, fp16-stored full ones: every kind of weight the store loads
        engine = make_engine(morph_policy="int4:15", weight_dtype="float16", huge_pages=on)
        assert engine.store.huge_pages is on and engine.pool.huge_pages is on
        if on:
            assert engine.pool.segments[0].kv.data_ptr() % huge_pages.HUGE_PAGE == 0
            table = engine.model.embed  # the INT8 table where the policy morphed the head unit too
            table = table if isinstance(table, torch.Tensor) else table.resident_tensors()[0]
            assert table.data_ptr() % huge_pages.HUGE_PAGE == 0
        for slot in engine.model.slots:
            w = slot.weights
            held = [w.input_layernorm, *(t for op in (w.qkv, w.o, w.gate_up, w.down) for t in op.resident_tensors())]
            assert (len({t.untyped_storage().data_ptr() for t in held}) == 1) is on
        rows = logits[on] = []
        engine.on_logits = lambda rid, row: rows.append(row.clone())
        list(engine.generate("The capital of France is", SamplingParams(max_tokens=6)))
    assert len(logits[True]) == 6 and all(torch.equal(a, b) for a, b in zip(logits[False], logits[True]))


@pytest.mark.needs_model
def test_an_engine_says_at_load_when_the_kernel_offers_no_huge_pages(tmp_path, monkeypatch, caplog):
    from tests.engine_fixtures import make_engine

    setting = tmp_path / "enabled"
    setting.write_text("always madvise [never]\n")
    monkeypatch.setattr(huge_pages, "THP_SETTING", setting)
    with caplog.at_level("WARNING", logger="morphserve.engine"):
        make_engine(max_tokens_in_paged_kv_cache=256)
    assert [r for r in caplog.records if "stay on 4 KiB pages" in r.getMessage() and "never" in r.getMessage()]
