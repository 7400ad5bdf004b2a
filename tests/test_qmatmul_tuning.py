"""The packed-matmul tuner: M buckets, candidate tiles that compute the right product, the on-disk
table keyed by device, type, shape, bucket and activation dtype, and the agreement guard."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as T

from shared.kernels.qmatmul.layout import CHUNK
from shared.kernels.qmatmul.packed import pack, unpack
from shared.kernels.qmatmul.packed_matmul import default_config, packed_matmul
from shared.kernels.qmatmul.tuning import BUCKETS, Tuner, agrees, bucket, candidates, reference
from tests.test_kernel_packed_matmul import random_raw

KERNELS = torch.cuda.is_available() or os.environ.get("TRITON_INTERPRET") == "1"
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_buckets() -> None:
    assert [bucket(m) for m in (1, 2, 16, 17, 64, 65, 4096)] == [1, 16, 16, 64, 64, 512, 512]
    assert BUCKETS[0] == 1


@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0])
def test_candidates_are_complete_configs(qtype: T) -> None:
    pw = pack(random_raw(qtype, 16, 4096, seed=0), qtype, (16, 4096))
    chunks = 4096 // CHUNK[qtype]
    for m in BUCKETS:
        cands = candidates(m, pw)
        assert cands, m
        keys = {"BLOCK_N", "SPLIT_K", "num_warps"} if m == 1 else {"BLOCK_M", "BLOCK_N"}
        tile = {"BLOCK_N", "CH", "num_warps", "INT8"}  # the one-tile GEMV: CH sets the split
        assert all(keys <= set(c) or c.get("DEQUANT") or tile <= set(c) for c in cands)
        assert (m == 1) == any(c.get("TILE") for c in cands)
    assert {"DEQUANT": 1} in candidates(512, pw)  # prefill: the dense path competes
    unrolled = [c for c in candidates(1, pw) if c.get("UNROLL")]
    assert unrolled and all(-(-chunks // c["SPLIT_K"]) <= 16 for c in unrolled)


@pytest.mark.skipif(not KERNELS, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("qtype", [T.Q4_K, T.Q6_K, T.Q8_0])
def test_unrolled_candidates_compute_the_product(qtype: T) -> None:
    n, k = 24, 2048
    pw = pack(random_raw(qtype, n, k, seed=3).to(DEVICE), qtype, (n, k))
    x = torch.randn(1, k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    want = x.double() @ unpack(pw).double().T
    for cfg in [c for c in candidates(1, pw) if c.get("UNROLL")][:4]:
        assert agrees(packed_matmul(x, pw, torch.float32, cfg), want), cfg


def test_agrees_rejects_wrong_and_nonfinite_results() -> None:
    ref = torch.randn(4, 8)
    assert agrees(ref + 1e-7 * torch.randn(4, 8), ref)
    assert not agrees(ref * 1.01, ref)
    bad = ref.clone()
    bad[0, 0] = float("nan")
    assert not agrees(bad, ref)


def test_tuner_reads_its_table_and_falls_back_to_defaults(tmp_path: Path) -> None:
    pw = pack(random_raw(T.Q8_0, 8, 256, seed=1), T.Q8_0, (8, 256))
    tuned = {"BLOCK_N": 8, "SPLIT_K": 2, "num_warps": 1}
    key = f"cpu|{int(T.Q8_0)}|8x256|m1|bfloat16"
    (tmp_path / "qmatmul-tuning.json").write_text(json.dumps({key: tuned}))
    tuner = Tuner(torch.device("cpu"), cache_dir=tmp_path)
    assert tuner.config(pw, 1, torch.bfloat16) == tuned
    # another dtype or bucket has no entry: the defaults
    assert tuner.config(pw, 1, torch.float32) == default_config(1, 8, 256, torch.device("cpu"))
    assert tuner.config(pw, 300, torch.bfloat16) == default_config(300, 8, 256, torch.device("cpu"))
    tuner.tune(pw, torch.bfloat16)  # timing needs CUDA: a no-op here, nothing written
    assert json.loads((tmp_path / "qmatmul-tuning.json").read_text()) == {key: tuned}


def test_tuner_survives_a_corrupt_table(tmp_path: Path) -> None:
    (tmp_path / "qmatmul-tuning.json").write_text("{not json")
    tuner = Tuner(torch.device("cpu"), cache_dir=tmp_path)
    assert not any(key.startswith("cpu|") for key in tuner.table)
    tuner.table["cpu|x"] = {"BLOCK_N": 8}
    tuner._save()
    assert json.loads((tmp_path / "qmatmul-tuning.json").read_text()) == {"cpu|x": {"BLOCK_N": 8}}


def test_shipped_tables_load_under_the_local_cache(tmp_path: Path, monkeypatch) -> None:
    import shared.kernels.qmatmul.tuning as tuning

    shipped = tmp_path / "tuned"
    shipped.mkdir()
    a, b = "cpu|8|8x256|m1|bfloat16", "cpu|8|8x256|m16|bfloat16"
    (shipped / "dev.json").write_text(json.dumps({a: {"BLOCK_N": 8}, b: {"BLOCK_N": 16}}))
    (tmp_path / "qmatmul-tuning.json").write_text(json.dumps({b: {"BLOCK_N": 32}}))
    monkeypatch.setattr(tuning, "SHIPPED", shipped)
    tuner = Tuner(torch.device("cpu"), cache_dir=tmp_path)
    assert tuner.table[a] == {"BLOCK_N": 8} and tuner.table[b] == {"BLOCK_N": 32}
    tuner.table["other-device|8|8x256|m1|bfloat16"] = {"BLOCK_N": 64}
    tuner._save()  # the cache keeps only this device's entries
    assert set(json.loads((tmp_path / "qmatmul-tuning.json").read_text())) == {a, b}


def test_weight_copies_exceed_twice_the_cache() -> None:
    from shared.kernels.qmatmul.timing import weight_copies

    pw = pack(random_raw(T.Q4_K, 16, 512, seed=2), T.Q4_K, (16, 512))
    copies = weight_copies(pw, l2=5 * pw.nbytes)
    assert len(copies) == 10 and copies[0] is pw
    assert all(torch.equal(c.q, pw.q) and c.q.data_ptr() != pw.q.data_ptr() for c in copies[1:])
    assert all(torch.equal(c.sc, pw.sc) and c.qtype == pw.qtype for c in copies)
    assert len(weight_copies(pw, l2=1)) == 2 and len(weight_copies(pw, l2=1 << 40)) == 64


@pytest.mark.skipif(
    not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1",
    reason="needs CUDA or TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("m", [1, 16, 64])
def test_exact_candidates_agree_with_the_reference(m: int) -> None:
    """The tuner keeps a candidate only if it agrees with `reference`: every exact GEMM must
    (at 64 rows Q4_K's default is the fp16-formed GEMM; as the reference it rejected them all,
    and the H200's test_tuner_times_every_bucket_on_cuda failed)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    pw = pack(random_raw(T.Q4_K, 64, 512, seed=3).to(device), T.Q4_K, (64, 512))
    x = torch.randn(m, 512, generator=torch.Generator().manual_seed(m)).half().to(device)
    ref = reference(x, pw)
    want = x.double() @ (unpack(pw).double() if m == 1 else unpack(pw).half().double()).T
    assert agrees(ref, want.to(device), 1e-5)
    exact = [c for c in candidates(m, pw) if not {"F16", "INT8"} & c.keys()][:3]
    assert exact and all(agrees(packed_matmul(x, pw, torch.float32, c), ref) for c in exact)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing needs CUDA")
def test_tuner_times_every_bucket_on_cuda(tmp_path: Path, monkeypatch) -> None:
    import shared.kernels.qmatmul.tuning as tuning

    monkeypatch.setenv("SKIFF_QMATMUL_TUNE", "1")
    full = tuning.candidates  # three per bucket: each is a compile
    monkeypatch.setattr(tuning, "candidates", lambda m, pw: full(m, pw)[:3])
    n, k = 256, 512
    pw = pack(random_raw(T.Q4_K, n, k, seed=3).cuda(), T.Q4_K, (n, k))
    tuner = Tuner(torch.device("cuda"), cache_dir=tmp_path)
    tuner.tune(pw, torch.float16)
    saved = json.loads((tmp_path / "qmatmul-tuning.json").read_text())
    assert len([key for key in saved if f"|{n}x{k}|" in key and key.endswith("|float16")]) == 4
    dense = unpack(pw).float()
    for m in BUCKETS:
        cfg = tuner.config(pw, m, torch.float16)
        assert cfg in candidates(m, pw)[:3]
        x = torch.randn(m, k, device="cuda", dtype=torch.float16)
        got = packed_matmul(x, pw, torch.float32, cfg)
        assert agrees(got, x.float() @ dense.T, tol=5e-3)
    # a second tuner reads the table and times nothing
    again = Tuner(torch.device("cuda"), cache_dir=tmp_path)
    assert again.config(pw, 1, torch.float16) == tuner.config(pw, 1, torch.float16)


def test_quick_candidates_are_few_compiles_of_complete_configs() -> None:
    from shared.kernels.qmatmul.tuning import quick_candidates

    pw = pack(random_raw(T.Q4_K, 16, 4096, seed=0), T.Q4_K, (16, 4096))
    quick = quick_candidates(pw)
    assert not any(c.get("TILE") for c in quick)  # the one-tile GEMV: full tuning only
    assert all({"BLOCK_N", "SPLIT_K", "num_warps"} <= set(c) for c in quick)
    compiles = {
        (c["BLOCK_N"], c["num_warps"], c.get("FACTOR", 0), c.get("TPR", 0), c.get("PREFETCH", 0),
         c.get("QX", 0))
        for c in quick
    }  # fmt: skip
    assert len(compiles) == 13 and any(c.get("FACTOR") for c in quick)
    assert sum(1 for c in compiles if c[3]) == 8 and all(c.get("INT8") for c in quick if "TPR" in c)
    assert all(c[4] for c in compiles if c[5])  # QX only with PREFETCH
    q3 = pack(random_raw(T.Q3_K, 16, 4096, seed=0), T.Q3_K, (16, 4096))
    assert not any(c.get("INT8") for c in quick_candidates(q3))  # no int8 GEMV for Q3_K


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="timing needs CUDA")
def test_a_first_load_tunes_batch_one_decode_only(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("SKIFF_QMATMUL_TUNE", raising=False)
    pw = pack(random_raw(T.Q8_0, 256, 512, seed=4).cuda(), T.Q8_0, (256, 512))
    tuner = Tuner(torch.device("cuda"), cache_dir=tmp_path)
    tuner.tune(pw, torch.bfloat16)
    saved = json.loads((tmp_path / "qmatmul-tuning.json").read_text())
    assert [key.split("|")[-2] for key in saved if "|256x512|" in key] == ["m1"]
    monkeypatch.setenv("SKIFF_QMATMUL_TUNE", "0")
    other = pack(random_raw(T.Q8_0, 128, 512, seed=5).cuda(), T.Q8_0, (128, 512))
    tuner.tune(other, torch.bfloat16)  # off: nothing timed, nothing written
    assert not any("|128x512|" in key for key in tuner.table)


def test_an_interleaved_weight_has_its_own_batch_one_entries(tmp_path: Path) -> None:
    """Batch 1 of a row-interleaved weight runs the rows GEMV: its table entry has a key of its
    own (``|rows``) and its candidates are the rows GEMV's; other buckets share the plain
    weight's entries (the GEMMs read either layout)."""
    from shared.kernels.qmatmul.packed_rows import interleave
    from shared.kernels.qmatmul.tuning import quick_candidates

    pw = pack(random_raw(T.Q4_K, 32, 512, seed=2), T.Q4_K, (32, 512))
    iw = interleave(pw)
    plain = {"BLOCK_N": 16, "SPLIT_K": 2, "num_warps": 1, "INT8": 1}
    rows = {"ROWS": 1, "INT8": 1, "num_warps": 2, "SPLIT_K": 1}
    gemm = {"BLOCK_M": 16, "BLOCK_N": 32, "num_warps": 4, "num_stages": 2}
    key = f"cpu|{int(T.Q4_K)}|32x512"
    table = {f"{key}|m1|bfloat16": plain, f"{key}|m1|bfloat16|rows": rows,
             f"{key}|m16|bfloat16": gemm}  # fmt: skip
    (tmp_path / "qmatmul-tuning.json").write_text(json.dumps(table))
    tuner = Tuner(torch.device("cpu"), cache_dir=tmp_path)
    assert tuner.config(pw, 1, torch.bfloat16) == plain
    assert tuner.config(iw, 1, torch.bfloat16) == rows
    assert tuner.config(iw, 9, torch.bfloat16) == gemm == tuner.config(pw, 9, torch.bfloat16)
    quick = quick_candidates(iw)
    assert quick == candidates(1, iw) and all(c["ROWS"] and c["INT8"] for c in quick)
    assert len({(c["num_warps"], c["PREFETCH"], c["QX"]) for c in quick}) == 5


def test_interleaved_weights_keep_the_default_split_at_batch_one() -> None:
    """A load times no batch-1 config of an interleaved weight (the default split beat every
    timed pick in the engine), but still its other buckets under full tuning."""
    from shared.kernels.qmatmul.packed_rows import interleave
    from shared.kernels.qmatmul.tuning import timed_buckets

    pw = pack(random_raw(T.Q4_K, 32, 512, seed=2), T.Q4_K, (32, 512))
    iw = interleave(pw)
    assert timed_buckets(pw, "decode") == (1,) and timed_buckets(pw, "1") == BUCKETS
    assert timed_buckets(iw, "decode") == ()
    assert timed_buckets(iw, "1") == tuple(m for m in BUCKETS if m != 1)
