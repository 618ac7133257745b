"""Config's buffer sizing (the kernels' layouts through ``_C``; the reference backend's Python copy of their arithmetic
where the extension is not built, checked against them here), and argument errors."""

from __future__ import annotations

import pytest

from ep_dispatcher import Config
from ep_dispatcher.backends import reference_layout
from ep_dispatcher.config import DEFAULT_MAX_TOKENS_PER_RANK, FP8_GROUP_SIZE, internode_layout_bytes

SHAPES = [
    # (hidden_bytes, num_ranks, num_ranks_per_node, max_tokens)
    (7168 * 2, 16, 8, 4096),
    (7168 * 2, 8, 4, 4096),
    (7168 * 2, 8, 2, 100),
    (2048 * 2, 4, 2, 1),
    ((1024 + 8) * 2, 4, 2, 333),
    (1024 * 4, 8, 4, 0),
    (16, 128, 32, 7),
]


def test_rdma_hint_is_zero_within_one_node() -> None:
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 8) == 0
    assert Config().get_rdma_buffer_size_hint(7168 * 2, 4, num_ranks_per_node=4) == 0


@pytest.mark.parametrize("shape", SHAPES)
def test_rdma_hint_is_the_layout(shape) -> None:
    hidden_bytes, ranks, per_node, tokens = shape
    expected = internode_layout_bytes(hidden_bytes, ranks, per_node, tokens)
    hint = Config().get_rdma_buffer_size_hint(hidden_bytes, ranks, per_node, num_max_tokens_per_rank=tokens)
    assert hint == expected
    assert Config().get_rdma_buffer_size_hint(hidden_bytes, ranks, per_node) == internode_layout_bytes(
        hidden_bytes, ranks, per_node, DEFAULT_MAX_TOKENS_PER_RANK
    )


@pytest.mark.parametrize("shape", SHAPES)
def test_layout_matches_the_extension(shape) -> None:
    _C = pytest.importorskip("ep_dispatcher._C")
    hidden_bytes, ranks, per_node, tokens = shape
    layout = _C.internode_layout(hidden_bytes, ranks, per_node, tokens)
    assert internode_layout_bytes(*shape) == layout.total_bytes  # the hint reads the kernels' layout
    assert reference_layout.internode_layout_bytes(*shape) == layout.total_bytes  # the reference's copy agrees
    assert layout.max_tokens == tokens and layout.num_nodes == ranks // per_node
    assert 0 == layout.signal_offset < layout.notify_area_offset < layout.data_offset <= layout.recv_offset
    assert layout.recv_offset + layout.recv_bytes <= layout.total_bytes
    # A buffer of exactly the hint holds exactly that many tokens (the kernels size themselves from the bytes).
    hint = layout.total_bytes
    got = _C.internode_max_tokens(hint, hidden_bytes, ranks, per_node)
    assert got >= tokens
    assert internode_layout_bytes(hidden_bytes, ranks, per_node, got) <= hint
    assert internode_layout_bytes(hidden_bytes, ranks, per_node, got + 1) > hint


def test_hints_without_the_extension_use_the_reference_arithmetic(monkeypatch) -> None:
    from ep_dispatcher import Buffer
    from ep_dispatcher import config as config_module

    monkeypatch.setattr(config_module, "_extension", lambda: None)
    shape = SHAPES[0]
    assert internode_layout_bytes(*shape) == reference_layout.internode_layout_bytes(*shape)
    assert Buffer.get_low_latency_rdma_size_hint(128, 7168, 8, 256) == reference_layout.low_latency_layout_bytes(
        128, 7168, 8, 256
    )


def test_rdma_hint_errors_name_the_argument() -> None:
    with pytest.raises(ValueError, match="num_ranks_per_node: expected a positive int, got 0"):
        Config().get_rdma_buffer_size_hint(16, 8, num_ranks_per_node=0)
    with pytest.raises(ValueError, match="num_ranks: expected a multiple of num_ranks_per_node=4, got 10"):
        Config().get_rdma_buffer_size_hint(16, 10, num_ranks_per_node=4)
    with pytest.raises(ValueError, match="num_max_tokens_per_rank: expected a non-negative int, got -1"):
        Config().get_rdma_buffer_size_hint(16, 8, num_ranks_per_node=4, num_max_tokens_per_rank=-1)
    with pytest.raises(ValueError, match="hidden_bytes"):
        Config().get_rdma_buffer_size_hint(15, 16)


def test_recommended_num_sms_reads_the_tuned_table(tmp_path, monkeypatch):
    """A configs/<gpu>.json written by bench_intranode.py --tune-sms is found, per call and rank count."""
    import json

    from ep_dispatcher import config as config_module

    (tmp_path / "testgpu.json").write_text(
        json.dumps({"dispatch": {}, "combine": {}, "num_sms": {"dispatch": {"8": 12}, "combine": {"8": 16}}})
    )
    monkeypatch.setenv("EP_DISPATCHER_CONFIG_DIR", str(tmp_path))
    monkeypatch.setattr(config_module, "gpu_config_name", lambda: "testgpu")
    config_module._load_config_table.cache_clear()
    try:
        assert config_module.recommended_num_sms("dispatch", 8) == 12
        assert config_module.recommended_num_sms("combine", 8) == 16
        assert config_module.recommended_num_sms("dispatch", 4) is None
        with pytest.raises(ValueError, match="kind: expected 'dispatch' or 'combine'"):
            config_module.recommended_num_sms("layout", 8)
    finally:
        config_module._load_config_table.cache_clear()


@pytest.mark.parametrize(
    "max_tokens, hidden, ranks, experts",
    [(128, 7168, 8, 256), (1, 128, 1, 1), (256, 7168, 16, 256), (32, 640, 4, 12), (64, 2048, 2, 288)],
)
def test_low_latency_hint_matches_the_kernels_layout(max_tokens, hidden, ranks, experts) -> None:
    _C = pytest.importorskip("ep_dispatcher._C")
    from ep_dispatcher import Buffer

    layout = _C.low_latency_layout(ranks, experts, max_tokens, hidden)
    assert layout.total_bytes == 2 * layout.half_bytes
    assert layout.recv_offset == layout.send_bytes and layout.ack_offset + ranks * 8 <= layout.half_bytes
    assert Buffer.get_low_latency_rdma_size_hint(max_tokens, hidden, ranks, experts) == layout.total_bytes
    assert reference_layout.low_latency_layout_bytes(max_tokens, hidden, ranks, experts) == layout.total_bytes


def test_nvl_hint_with_tokens_holds_every_row_a_rank_can_receive():
    cfg = Config()
    hidden, ranks, tokens, topk = 7168, 8, 4096, 8
    ring = cfg.get_nvl_buffer_size_hint(hidden * 2, ranks)
    sized = cfg.get_nvl_buffer_size_hint(hidden * 2, ranks, num_max_tokens_per_rank=tokens)
    # The intranode engine's dispatch row: BF16 payload, FP8 scales, top-k ids (int64) and weights (fp32), source.
    row = hidden * 2 + hidden // FP8_GROUP_SIZE * 4 + topk * 12 + 4
    assert sized >= ranks * tokens * row > ring
    assert cfg.get_nvl_buffer_size_hint(hidden * 2, ranks, num_max_tokens_per_rank=0) == ring
    with pytest.raises(ValueError, match="num_max_tokens_per_rank"):
        cfg.get_nvl_buffer_size_hint(hidden * 2, ranks, num_max_tokens_per_rank=-1)


def _buffer_cache_worker(rank: int, world: int) -> None:
    from ep_dispatcher.buffer_cache import BufferCache

    cache = BufferCache("EP_TEST_UNUSED_BACKEND_ENV")
    cache.backend_override = "reference"
    small = cache.get(None, 256, 100)
    assert cache.get(None, 256, 1000) is small  # same rounded token count: no new buffer
    large = cache.get(None, 256, 3000)
    assert large is not small and large.num_nvl_bytes > small.num_nvl_bytes
    assert cache.get(None, 128, 10) is large  # a smaller request reuses the larger buffer
    cache.clear()
    assert not cache.buffers


def test_buffer_cache_rounds_tokens_and_grows():
    from ep_dispatcher.buffer_cache import rounded_tokens
    from tests.dist import run

    assert [rounded_tokens(n) for n in (0, 1, 1024, 1025, 5000)] == [1024, 1024, 1024, 2048, 8192]
    run(_buffer_cache_worker, 2)
