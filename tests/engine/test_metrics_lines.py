"""The metrics lines as a user's run prints them: no rate on the first step (its overlapped
CPU work ends in the next, so its wall time holds less than a step), and samples/s without
tokens/s for a model whose inputs have no sequence dimension."""
import re
import subprocess
import sys
import textwrap

from zeroplug.plugins.monitors import NO_RATE

TRAIN = [sys.executable, "-m", "zeroplug.cli", "train", "--no-save", "--max-bytes", "40000", "--seq", "16",
         "--batch.micro_batch_size=2", "--batch.steps_per_print=1"]


def _lines(stdout: str) -> dict[int, str]:
    return {int(m.group(1)): line for line in stdout.splitlines() if (m := re.match(r"\[zeroplug\] step=(\d+) ", line))}


def test_first_step_line_reports_no_rate_under_cpu_offload(tmp_path):
    """The first step's CPU optimizer step runs after engine.step() returns and is waited for
    inside the second step: a rate from the first interval would count a step without it."""
    out = subprocess.run([*TRAIN, "--steps", "3", "--zero.plugin=stage1", "--offload.optimizer.plugin=cpu"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _lines(out.stdout)
    assert sorted(lines) == [1, 2, 3], out.stdout
    assert "zero=stage1 precision=fp32 optimizer=adamw scheduler=warmup_cosine offload.optimizer=cpu " \
           "offload.param=none" in out.stdout.splitlines()[0]         # the summary names the tiers
    assert NO_RATE in lines[1] and "CurrSamplesPerSec" not in lines[1] and "tokens/s" not in lines[1]
    for step in (2, 3):
        rate = float(re.search(r"CurrSamplesPerSec=([\d.]+)", lines[step]).group(1))
        tokens = float(re.search(r"tokens/s=([\d.]+)", lines[step]).group(1))
        assert rate > 0 and abs(tokens - rate * 16) <= 1        # 16 tokens a sample


REGRESSION = textwrap.dedent('''
    import torch
    import zeroplug.deepspeed as deepspeed

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(13, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
    config = {"train_micro_batch_size_per_gpu": 8, "steps_per_print": 1,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(64, 13)
    y = x[:, :1] * 2 - x[:, 1:2]
    for i in range(3):
        xb, yb = x[i * 8:(i + 1) * 8], y[i * 8:(i + 1) * 8]
        loss = torch.nn.functional.mse_loss(engine(xb), yb)
        engine.backward(loss)
        engine.step()
''')


def test_feature_vectors_report_samples_per_second_only(tmp_path):
    """A regression on 13 features through the DeepSpeed shim: dim 1 is features, not tokens."""
    script = tmp_path / "regression.py"
    script.write_text(REGRESSION)
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = _lines(out.stdout)
    assert sorted(lines) == [1, 2, 3], out.stdout
    assert NO_RATE in lines[1]
    for step in (2, 3):
        assert re.search(r"CurrSamplesPerSec=[\d.]+", lines[step]), lines[step]
        assert "tokens/s" not in lines[step], lines[step]
