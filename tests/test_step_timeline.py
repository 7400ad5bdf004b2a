"""tools.step_timeline: each kernel is charged what it moved the end of the work by."""

from tools.step_timeline import charges, kernels, largest_gaps


def _k(name, ts, dur, grid=(1, 1, 1)):
    return {"cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {"grid": list(grid)}}


def test_charges_add_up_to_the_span_with_overlap_gaps_and_host_time():
    trace = {
        "traceEvents": [
            _k("gemv<int>", 0.0, 10.0, (32, 2, 1)),
            _k("norm", 8.0, 4.0),  # launched early: charged 2 of its 4
            _k("gemv<int>", 14.0, 10.0, (32, 2, 1)),  # a 2 µs launch gap
            _k("tiny", 15.0, 1.0),  # inside the previous one: charged nothing
            _k("attn", 54.0, 6.0),  # 30 µs of host time before it
            {"cat": "cpu_op", "name": "aten::mm", "ts": 0.0, "dur": 99.0},
            {"cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 60.0, "dur": 2.0},
        ]
    }
    ks = kernels(trace)
    names = [k["name"] for k in ks]
    assert names == ["gemv<int>", "norm", "gemv<int>", "tiny", "attn", "Memcpy HtoD"]
    assert largest_gaps(ks, 2) == [(30.0, "gemv (32, 2, 1)", "attn (1, 1, 1)"),
                                   (2.0, "norm (1, 1, 1)", "gemv (32, 2, 1)")]  # fmt: skip
    rows, tot = charges(ks)
    assert tot["span"] == 62.0
    assert tot["host"] == 30.0 and tot["gaps"] == 2.0
    assert tot["exposed"] + tot["gaps"] + tot["host"] == tot["span"]
    assert rows["gemv (32, 2, 1)"] == [2, 20.0, 20.0, 2.0]
    assert rows["norm (1, 1, 1)"][2] == 2.0
    assert rows["tiny (1, 1, 1)"][2] == 0.0
    assert rows["attn (1, 1, 1)"][2:] == [6.0, 0.0]


def test_sequence_lists_starts_against_the_frontier(tmp_path, capsys):
    import gzip
    import json

    from tools.step_timeline import load, sequence

    trace = {"traceEvents": [_k("a", 0.0, 10.0), _k("b", 8.0, 4.0), _k("c", 13.0, 1.0)]}
    path = tmp_path / "t.json.gz"
    path.write_bytes(gzip.compress(json.dumps(trace).encode()))
    sequence(kernels(load(path)), 1, 2)
    lines = capsys.readouterr().out.splitlines()[1:]
    assert [line.split()[:4] for line in lines] == [
        ["0.00", "4.00", "4.00", "-2.00"],  # b began 2 µs before a ended
        ["5.00", "6.00", "1.00", "1.00"],  # c 1 µs after b ended
    ]
