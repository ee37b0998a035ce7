"""`zeroplug tune`, `zeroplug estimate`'s activation term, the engine's step phases, the
TensorBoard monitor and `zeroplug report`: real runs of the built-in GPT on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

import zeroplug
from zeroplug.cli import main
from zeroplug.plugins.workload.models import GPT, GPTConfig
from zeroplug.tools.probe import load_spec, measure_activations
from zeroplug.tools.report import read_run

TINY = ["--model", "char-tiny", "--micro-batch", "2", "--seq", "32", "--device", "cpu"]


def test_tune_writes_a_commented_config_that_trains(tmp_path, capsys):
    out = tmp_path / "zero.toml"
    rc = main(["tune", *TINY, "--steps", "1", "--warmup", "0", "--nvme-path", str(tmp_path / "swap"),
               "--out", str(out)])
    assert rc == 0
    text = out.read_text()
    header = [line for line in text.splitlines() if line.startswith("#")]
    rows = {c: line for line in header for c in ("stage0 ", "stage1 ", "stage2 ", "stage3 ",
                                                  "stage3 + optimizer and parameters on NVMe")
            if line.startswith(f"# {c}")}
    assert len(rows) == 5, header                    # every candidate has a row
    assert sum("chosen: the fastest" in line for line in header) == 1
    assert all("the device is the CPU" in line for line in header if "on CPU" in line)
    assert "activations" in header[2] and "measured on cpu" in header[2]
    cfg = zeroplug.load_config(str(out))             # the file is a valid config ...
    chosen = next(line for line in header if "chosen: the fastest" in line)
    assert chosen.startswith(f"# {cfg.slot('zero').name}")   # ... of the chosen candidate
    assert cfg.batch.micro_batch_size == 2
    assert main(["train", "--config", str(out), "--steps", "2", "--seq", "32", "--monitor.plugin=none"]) == 0


def test_tune_keeps_the_earlier_candidate_within_the_steps_noise():
    from zeroplug.benchmarking.measure import StepRun
    from zeroplug.tools.tune import Candidate, clearly_faster

    def cand(stage, times):
        return Candidate(0, stage, run=StepRun(f"stage{stage}", step_times=times, tokens_per_step=1000))
    steady = cand(0, [1.00, 1.01, 0.99])
    assert clearly_faster(steady, None)
    assert not clearly_faster(cand(2, [0.98, 0.99, 0.985]), steady)        # 1.5% faster: noise
    assert clearly_faster(cand(2, [0.80, 0.81, 0.79]), steady)             # 25% faster: chosen
    noisy = cand(1, [0.90, 1.20, 0.85])                                    # median 0.90, spread 39%
    assert not clearly_faster(noisy, steady)                               # 11% faster, within its spread
    assert clearly_faster(cand(3, [0.50, 0.52, 0.51]), noisy)


def test_tune_rejects_what_does_not_fit_without_running_it(tmp_path, capsys):
    out = tmp_path / "zero.toml"
    rc = main(["tune", *TINY, "--activations-gib", "1e6", "--out", str(out)])
    assert rc == 1
    text = out.read_text()
    assert "No candidate ran" in text
    assert "rejected: estimated 1000000.0 GiB of host memory >" in text   # the CPU device: host memory
    assert "rejected: no --nvme-path given" in text
    assert "error: no candidate ran" in capsys.readouterr().err


def test_tune_and_estimate_refuse_bad_input(tmp_path, capsys):
    assert main(["tune", "--model", "no-such-model", "--out", str(tmp_path / "z.toml")]) == 2
    assert "error: --model no-such-model: not a preset" in capsys.readouterr().err
    assert main(["estimate", "--params", "1e9", "--micro-batch", "2"]) == 2
    assert "give --model, not --params" in capsys.readouterr().err


def test_tune_fits_the_sequence_to_the_model(tmp_path, capsys):
    """A preset shorter than 1024 positions is probed at its own length; a longer --seq is one line."""
    out = tmp_path / "zero.toml"
    assert main(["tune", "--model", "char-tiny", "--device", "cpu", "--activations-gib", "1e6", "-o", str(out)]) == 1
    assert "sequence 128" in out.read_text()
    capsys.readouterr()
    assert main(["tune", "--model", "char-tiny", "--device", "cpu", "--seq", "4096", "--output", str(out)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --seq 4096: the model char-tiny takes at most 128 positions") and "Traceback" not in err
    assert main(["estimate", "--model", "char-tiny", "--micro-batch", "2", "--seq", "4096", "--device", "cpu"]) == 2


def test_estimate_adds_measured_activations_to_the_device_column(capsys):
    assert main(["estimate", "--model", "char-tiny"]) == 0
    plain = capsys.readouterr().out
    assert main(["estimate", "--model", "char-tiny", "--micro-batch", "16", "--seq", "128", "--device", "cpu"]) == 0
    probed = capsys.readouterr().out
    assert "activations:" in probed and "measured on cpu at 1 and 2 layers" in probed

    def device_col(text):   # stage 3's device GiB with everything offloaded: no model state
        # (a row of whole model states would round to two decimals on either side of the sum)
        return float(next(line for line in text.splitlines() if line.split()[:2] == ["3", "param+optim"]).split()[2])
    act_gib = float(probed.split("activations: ")[1].split()[0])
    assert act_gib > 0.005
    assert device_col(probed) == pytest.approx(device_col(plain) + act_gib, abs=0.006)


def test_activation_probe_scales_with_batch_and_checkpointing():
    dev = torch.device("cpu")
    full = load_spec("char-tiny", checkpointing=False)
    a2 = measure_activations(full, 2, 64, dev, torch.float32)
    a4 = measure_activations(full, 4, 64, dev, torch.float32)
    assert a4.total == pytest.approx(2 * a2.total, rel=0.05)          # linear in the micro batch
    ckpt = measure_activations(load_spec("char-tiny", checkpointing=True), 4, 64, dev, torch.float32)
    assert 0 < ckpt.per_layer < a4.per_layer / 4       # a checkpointed block keeps only its input


def test_engine_reports_step_phases_that_add_up_to_the_step():
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, seq_len=32, n_layer=2, d_model=32, n_head=2)
    engine = zeroplug.initialize(GPT(cfg), {"batch": {"micro_batch_size": 2, "steps_per_print": 2},
                                            "monitor": {"plugin": "none"}}, device="cpu")
    seen = []
    for step in range(4):
        x = torch.randint(0, 64, (2, 32))
        loss = engine(x, x)
        engine.backward(loss)
        engine.step()
        seen.append(dict(engine.last_metrics))
    assert not any(k.startswith("phase_") for k in seen[2])          # only on reported steps
    m = seen[3]
    phases = {k: v for k, v in m.items() if k.startswith("phase_")}
    assert set(phases) == {"phase_other", "phase_forward", "phase_backward", "phase_wait_gradients",
                           "phase_optimizer"}
    assert all(v >= 0 for v in phases.values()) and phases["phase_backward"] > 0
    assert sum(phases.values()) == pytest.approx(m["step_time"], rel=0.05, abs=1e-4)
    engine.close()


def _train(tmp_path, *extra):
    args = ["train", "--steps", "12", "--seq", "32", "--max-bytes", "200000", "--batch.steps_per_print=3", *extra]
    assert main(args) == 0


def test_report_draws_a_csv_run(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    _train(tmp_path, "--monitor.plugin=csv", "--monitor.path=run.csv")
    assert f"csv monitor: appending to {tmp_path / 'run.csv'}" in capsys.readouterr().out   # says where
    series = read_run(tmp_path / "run.csv")
    assert [s for s, _ in series["loss"]] == list(range(1, 13))      # every step, though printed every 3rd
    assert [s for s, _ in series["phase_forward"]] == list(range(1, 13))
    assert [s for s, _ in series["eval_loss"]][0] == 0 and series["eval_loss"][-1][0] == 12
    assert series["eval_loss"][-1][1] < series["eval_loss"][0][1]        # it learned
    assert {"phase_forward", "phase_backward", "phase_optimizer"} <= set(series)
    assert main(["report", "run.csv"]) == 0
    png = tmp_path / "run.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 30_000
    assert "wrote run.png" in capsys.readouterr().out


def test_tensorboard_monitor_and_report_of_its_events(tmp_path, monkeypatch):
    pytest.importorskip("tensorboard")
    monkeypatch.chdir(tmp_path)
    _train(tmp_path, "--monitor.plugin=tensorboard", "--monitor.output_path=tb", "--monitor.job_name=job")
    series = read_run(tmp_path / "tb")
    assert [s for s, _ in series["loss"]] == [1, 3, 6, 9, 12]
    assert {"lr", "loss_scale", "grad_norm", "tokens_per_sec", "host_rss", "eval_loss", "phase_forward",
            "phase_optimizer"} <= set(series)
    assert 0.05 < series["host_rss"][0][1] < 64           # GiB
    assert all(math.isfinite(v) for _, v in series["loss"])
    assert main(["report", "tb/job", "--out", "pic.png"]) == 0
    assert (tmp_path / "pic.png").stat().st_size > 30_000


def test_report_names_what_is_wrong(tmp_path, capsys):
    assert main(["report", str(tmp_path / "missing.csv")]) == 2
    assert "no such file or directory" in capsys.readouterr().err
    bad = tmp_path / "bad.csv"
    bad.write_text("a,b\n1,2\n")
    assert main(["report", str(bad)]) == 2
    assert "not a zeroplug metrics CSV" in capsys.readouterr().err
    assert main(["report", str(tmp_path)]) == 2
    assert "no TensorBoard event files" in capsys.readouterr().err


def test_report_reads_the_last_run_of_an_appended_csv(tmp_path):
    rows = ["step,loss,eval_loss", "0,,5.5", "1,5.6,", "2,5.0,", "0,,5.4", "1,5.3,", "2,4.4,", "2,,4.5"]
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    series = read_run(tmp_path / "m.csv")
    assert series["loss"] == [(1, 5.3), (2, 4.4)]
    assert series["eval_loss"] == [(0, 5.4), (2, 4.5)]


def test_metrics_line_of_a_cpu_run_has_no_gpu_memory_fields():
    from zeroplug.plugins.monitors import format_line
    m = {"step": 1, "loss": 2.0, "lr": 1e-3, "loss_scale": 1.0, "grad_norm": 0.5, "samples_per_sec": 3.0,
         "avg_samples_per_sec": 3.0, "tokens_per_sec": 96.0, "host_rss": 2 ** 30}
    cpu = format_line({**m, "mem_allocated": None, "max_mem_allocated": None})
    assert "MemAllocated" not in cpu and cpu.endswith("RSS=1.00GB")
    gpu = format_line({**m, "mem_allocated": 2 ** 31, "max_mem_allocated": 2 ** 32})
    assert "MemAllocated=2.00GB MaxMemAllocated=4.00GB RSS=1.00GB" in gpu


HOSTILE = {
    # name: (file bytes, whether good rows remain to draw)
    "step-1e400": (b"step,loss,tokens_per_sec\n1e400,5.0,100\n1,5.0,100\n2,4.0,110\n", True),
    "value-inf": (b"step,loss,tokens_per_sec\n1,1e400,100\n2,4.0,110\n3,nan,120\n", True),
    "binary": (bytes(range(256)) * 40, False),
    "binary-rows": (b"step,loss,tokens_per_sec\n1,5.0,100\n\x00\xff\xfe,\x00\x01\n2,4.0,110\n", True),
    "field-200kB": (b"step,loss,tokens_per_sec\n1,5.0,100\n2,\"" + b"9" * 200_000 + b"\",110\n3,4.0,120\n", True),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_report_survives_hostile_csv(tmp_path, capsys, name):
    """A hostile metrics file: an error line, or the bad rows skipped with one warning; never
    a traceback."""
    pytest.importorskip("matplotlib")
    data, drawable = HOSTILE[name]
    (tmp_path / "m.csv").write_bytes(data)
    rc = main(["report", str(tmp_path / "m.csv"), "--out", str(tmp_path / "m.png")])
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    if drawable:
        assert rc == 0 and (tmp_path / "m.png").exists(), err
        assert len(lines) <= 1 and all(ln.startswith("warning: ") for ln in lines), err
    else:
        assert rc == 2 and len(lines) == 1 and lines[0].startswith("error: "), err
