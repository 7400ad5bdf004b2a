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
