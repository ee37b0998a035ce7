"""The step timeline's arithmetic (zeroplug.benchmarking.timeline) on hand-made traces:
overlapping streams count once, exposed communication is what no compute hides, gaps name
their neighbours."""
import json

import pytest

from zeroplug.benchmarking.timeline import analyse, format_summary, main, subtract, union


def k(ts, dur, name, stream=7, cat="kernel"):
    return {"ph": "X", "cat": cat, "ts": ts, "dur": dur, "name": name, "args": {"stream": stream}}


def test_union_and_subtract():
    assert union([(5, 7), (0, 2), (1, 3), (7, 8)]) == [(0, 3), (5, 8)]
    assert subtract([(0, 10)], [(2, 3), (5, 12)]) == [(0, 2), (3, 5)]
    assert subtract([(0, 2), (4, 6)], []) == [(0, 2), (4, 6)]
    assert subtract([(0, 2)], [(0, 2)]) == []


def test_exposed_comm_and_idle():
    # compute 0-1000 and 1500-2500 us; an all-gather 800-1800 (500 us of it exposed: 1000-1500),
    # a reduce-scatter 2600-3000 after the last kernel (all exposed), a copy hidden under compute,
    # nothing 2500-2600 (idle); a CPU-side event that must be ignored
    ev = [k(0, 1000, "ampere_bf16_gemm"), k(1500, 1000, "flash_fwd"),
          k(800, 1000, "ncclDevKernel_AllGather_RING_LL", stream=20),
          k(2600, 400, "ncclDevKernel_ReduceScatter_Sum_f32", stream=20),
          k(100, 200, "Memcpy HtoD (Pinned -> Device)", stream=9, cat="gpu_memcpy"),
          {"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 9000, "name": "aten::mm"}]
    s = analyse(ev, steps=1)
    assert s.window_ms == pytest.approx(3.0)
    assert s.compute_ms == pytest.approx(2.0)
    assert s.comm_ms == pytest.approx(1.4)
    assert s.exposed_comm_ms == pytest.approx(0.9)
    assert s.copy_ms == pytest.approx(0.2) and s.exposed_copy_ms == 0
    assert s.idle_ms == pytest.approx(0.1)
    assert s.comm_kernels == {"allgather": (1, pytest.approx(1.0)), "reducescatter": (1, pytest.approx(0.4))}
    gap = s.gaps[0]
    assert gap[0] == pytest.approx(0.5) and gap[1] == "ampere_bf16_gemm" and gap[2] == "flash_fwd"
    assert gap[3] == "allgather"
    text = format_summary(s)
    assert "exposed    0.9" in text and "gap   0.50 ms" in text


def test_per_step_and_cli(tmp_path, capsys):
    ev = [k(0, 1000, "gemm"), k(1000, 1000, "gemm")]
    s = analyse(ev, steps=2)
    assert s.window_ms == pytest.approx(1.0) and s.idle_ms == 0 and s.gaps == []
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": ev}))
    assert main([str(path), "2"]) == 0
    assert "GPU step     1.0 ms" in capsys.readouterr().out
    with pytest.raises(ValueError, match="no device events"):
        analyse([{"ph": "X", "cat": "cpu_op", "ts": 0, "dur": 1, "name": "x"}])
