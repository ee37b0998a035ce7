"""The metrics line's samples/s and tokens/s: the step's samples (tokens) over the wall time
between step ends, overlapped CPU work included; none on the first step measured (its
overlapped work ends in the next), no tokens/s for inputs without a sequence dimension."""
import time

import pytest
import torch

import zeroplug
from tests.support.toy import ToyNet

SLEEP = 0.3


class SlowForward(ToyNet):
    """A forward that takes a known wall time (a data-dependent op, a slow host)."""
    def forward(self, x, y=None):
        time.sleep(SLEEP)
        return super().forward(x, y)


@pytest.mark.parametrize("zero", ["stage2", "stage3"])
def test_tokens_per_second_is_wall_time_between_step_ends(zero):
    torch.manual_seed(0)
    seq, batch = 8, 4
    cfg = {"zero": {"plugin": zero}, "optimizer": {"plugin": "cpu_adam", "lr": 1e-3},
           "offload": {"optimizer": {"plugin": "cpu"}},       # stage 3: the CPU step overlaps the next forward
           "batch": {"micro_batch_size": batch, "steps_per_print": 1}, "monitor": {"plugin": "none"}}
    engine = zeroplug.initialize(SlowForward(), cfg, device="cpu")
    g = torch.Generator().manual_seed(1)
    walls, seen = [], []
    start = time.perf_counter()
    for _ in range(4):
        x = torch.randint(0, 37, (batch, seq), generator=g)
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        end = time.perf_counter()
        walls.append(end - start)
        start = end
        seen.append(dict(engine.last_metrics))
    engine.close()
    # Note: the first reported step also formats the memory report after its end is taken
    # (tens of ms on a busy machine), which the next interval holds: hence the absolute slack, well below SLEEP
    for wall, m in zip(walls, seen):
        assert wall > SLEEP
        assert m["step_time"] == pytest.approx(wall, rel=0.05, abs=0.06)
        if m is seen[0]:        # its CPU step ends inside the second: no rate
            assert m["samples_per_sec"] is m["tokens_per_sec"] is m["avg_samples_per_sec"] is None
            continue
        assert m["tokens_per_sec"] == pytest.approx(batch * seq / m["step_time"], rel=1e-9)
        assert m["samples_per_sec"] == pytest.approx(batch / m["step_time"], rel=1e-9)
    assert sum(m["step_time"] for m in seen) == pytest.approx(sum(walls), rel=0.02, abs=0.06)
