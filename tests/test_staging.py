"""shared.staging: a step's integer inputs in one buffer, one copy."""

import torch

from shared.staging import to_device_packed


def test_packed_views_hold_the_values_in_their_dtypes_and_stay_aligned():
    parts = [
        ([1, 2, 3], torch.int64),
        ([], torch.int64),
        ([-1 << 40], torch.int64),
        ([7, 8, 9, 10, 11], torch.int32),
        ([2**31 - 1, -(2**31)], torch.int32),
    ]
    out = to_device_packed(parts, "cpu")
    base = out[0].untyped_storage().data_ptr()
    assert len(out) == len(parts)
    for (values, dtype), t in zip(parts, out, strict=True):
        assert t.dtype == dtype and t.dim() == 1 and t.is_contiguous()
        assert t.tolist() == values
        assert (t.data_ptr() - base) % 16 == 0
        assert t.untyped_storage().data_ptr() == base  # one buffer
    # a 2-D view of an int32 part, as ForwardBatch's block tables
    assert out[3][:4].reshape(2, 2).tolist() == [[7, 8], [9, 10]]


def test_pack_into_a_given_buffer_and_views_of_its_device_copy():
    """pack with `into` writes the parts into the buffer it hands over (a PinnedRing's); views
    of a copy of that buffer read the same values."""
    from shared.staging import pack, views

    given = []

    def into(n):
        given.append(torch.full((n,), 0xAB, dtype=torch.uint8))
        return given[-1]

    parts = [([5, -6], torch.int64), ([1, 2, 3], torch.int32), ([], torch.int32)]
    buf, layout = pack(parts, into)
    assert buf is given[0] and buf.numel() == 16 + 16
    assert [t.tolist() for t in views(buf, layout)] == [v for v, _ in parts]
    assert [t.tolist() for t in views(buf.clone(), layout)] == [v for v, _ in parts]


def test_batch_built_into_host_memory_and_moved_matches_the_direct_build():
    from shared.model import ForwardBatch, SeqChunk

    chunks = [SeqChunk([4, 5, 6], 0, [2, 3]), SeqChunk([9], 17, [0, 1], "last")]
    direct = ForwardBatch.build(chunks, 16, "cpu", extra=[-1, 0, -1, 1])
    host = ForwardBatch.build(
        chunks, 16, "cpu", extra=[-1, 0, -1, 1], pinned=lambda n: torch.empty(n, dtype=torch.uint8)
    )
    assert host.packed is not None and direct.packed is None
    moved = host.on_device("cpu")
    assert moved.packed is None and moved.on_device("cpu") is moved
    for b in (host, moved):
        for name in ("token_ids", "positions", "slot_mapping", "block_tables", "logits_rows",
                     "query_start_loc_t", "seq_lens_t", "extra"):  # fmt: skip
            assert torch.equal(getattr(b, name), getattr(direct, name)), name
