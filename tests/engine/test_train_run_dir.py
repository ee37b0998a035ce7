"""What `zeroplug train` leaves: a run directory (resolved config, per-step CSV, final
checkpoint, picture) named on its first line, three closing lines (where, how to continue,
how to look), and a `--resume RUN` that continues it; `--steps` sets the schedule's length."""
import csv
import re
import shlex
from pathlib import Path

import pytest

from zeroplug.cli import main
from zeroplug.config import tomllib

SMALL = ["--max-bytes", "40000", "--seq", "16", "--batch.micro_batch_size=2"]


def _train(capsys, *args) -> list[str]:
    """``zeroplug train`` (in this process: the same command line, without a second torch
    import); its stdout lines."""
    assert main(["train", *SMALL, *args]) == 0
    return capsys.readouterr().out.strip().splitlines()


def _steps(path: Path) -> list[int]:
    return [int(r["step"]) for r in csv.DictReader(open(path)) if r["loss"]]


def test_first_run_leaves_a_run_directory_and_says_how_to_continue_it(tmp_path, monkeypatch, capsys):
    pytest.importorskip("matplotlib")
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ZEROPLUG_NO_SAVE", raising=False)        # as a user's shell has it
    lines = _train(capsys, "--steps", "3")
    first = re.match(r"zeroplug train: run (runs/\d{8}-\d{6}-char-tiny) \| ", lines[0])
    assert first, lines[0]
    run = tmp_path / first.group(1)
    assert sorted(p.name for p in run.iterdir()) == ["checkpoints", "config.toml", "metrics.csv", "report.png",
                                                     "run.json"]
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step3"
    assert (run / "report.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert _steps(run / "metrics.csv") == [1, 2, 3]
    config = tomllib.loads((run / "config.toml").read_text())     # the packaged zero.toml's keys, as set
    assert config["scheduler"]["total_num_steps"] == "auto" and config["zero"]["plugin"] == "stage0"
    assert "total_num_steps = \"auto\"   # 3 in this run" in (run / "config.toml").read_text()
    # the three closing lines: where the run is, how to continue it, how to look at it
    where, cont, look = lines[-3:]
    assert where.startswith(f"run saved:   {first.group(1)}/ (config.toml, metrics.csv, checkpoints/, report.png)")
    assert cont == f"continue it: zeroplug train --resume {first.group(1)} --steps 6"
    assert look.startswith(f"look at it:  {first.group(1)}/report.png (zeroplug report {first.group(1)}")

    # the printed command, as a user pastes it, continues the run
    argv = shlex.split(cont.split(": ", 1)[1])
    assert argv[:2] == ["zeroplug", "train"]
    more = _train(capsys, *argv[2:])
    assert f"resumed from {first.group(1)}/checkpoints/global_step3 at step 3" in more
    assert more[-2] == f"continue it: zeroplug train --resume {first.group(1)} --steps 12"
    assert _steps(run / "metrics.csv") == [1, 2, 3, 4, 5, 6]          # one run, continued
    assert (run / "checkpoints" / "latest").read_text().strip() == "global_step6"
    assert len(list((tmp_path / "runs").iterdir())) == 1             # no second directory


def test_run_directory_is_off_with_no_save_and_errors_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("ZEROPLUG_NO_SAVE", raising=False)
    (tmp_path / "notarun").mkdir()
    (tmp_path / "old").mkdir()
    (tmp_path / "old" / "run.json").write_text('{"args": {}}')
    for argv, words in ((["--no-save", "--run-dir", "x"], "--no-save and --run-dir"),
                        (["--resume", "notarun"], "not a run's"),
                        (["--resume", "old", "--config", "zero.toml"], "drop --config"),
                        (["--run-dir", "old", "--steps", "1"], "holds a run already: continue it with --resume old"),
                        (["--resume"], "--resume needs a run directory")):
        assert main(["train", *SMALL, *argv]) == 2, argv
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith("error: ") and words in err[0], (argv, err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notarun", "old"]     # nothing written
    assert main(["train", *SMALL, "--steps", "1", "--no-save", "--monitor.plugin=none"]) == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notarun", "old"]
    assert "run saved" not in capsys.readouterr().out


def _lr(stdout: str, step: int) -> float:
    return float(re.search(rf"^\[zeroplug\] step={step} .*? lr=([\d.e+-]+)", stdout, re.M).group(1))


def test_steps_set_the_schedule_length_and_warm_up_is_shortened(tmp_path, monkeypatch, capsys):
    """The packaged zero.toml (warmup_cosine, 30 warm-up steps, total "auto") over --steps 5:
    the warm-up is shortened with a note, and the cosine ends at the run's last step. Stage 0
    with the optimizer offloaded runs, and the summary line names every plugin."""
    monkeypatch.chdir(tmp_path)
    args = ["train", *SMALL, "--no-save", "--batch.steps_per_print=1"]
    assert main([*args, "--steps", "5", "--offload.optimizer.plugin=cpu"]) == 0
    out = capsys.readouterr().out
    assert ("zero=stage0 precision=fp32 optimizer=adamw scheduler=warmup_cosine offload.optimizer=cpu "
            "offload.param=none monitor=stdout activation_checkpointing=none") in out.splitlines()[0]
    assert "note: scheduler.warmup_num_steps = 30 does not fit --steps 5: the warm-up is shortened to 1 step" in out
    assert _lr(out, 5) == pytest.approx(2e-3 * 1e-4)          # the cosine's end: cos_min_ratio x lr
    assert _lr(out, 3) > 1e-3

    # a file of the user's that sets its own length: it wins, and one line says so
    (tmp_path / "mine.toml").write_text('[optimizer]\nlr = 2e-3\n[scheduler]\nplugin = "warmup_cosine"\n'
                                        'warmup_num_steps = 2\ntotal_num_steps = 300\n'
                                        '[batch]\nmicro_batch_size = 2\n')
    assert main([*args, "--config", "mine.toml", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    note = [line for line in out.splitlines() if line.startswith("note: scheduler.total_num_steps")]
    assert note == ["note: scheduler.total_num_steps = 300 (mine.toml) sets the schedule's length, not --steps 5: "
                    "the run stops 295 steps before the lr's decay ends; set it to \"auto\" to follow --steps"]
    assert _lr(out, 5) > 1.9e-3                               # early in a 300-step cosine

    # a DeepSpeed config's "auto" length is the launcher's: --steps
    (tmp_path / "ds.json").write_text('{"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", '
                                      '"params": {"lr": 2e-3}}, "scheduler": {"type": "WarmupCosineLR", "params": '
                                      '{"total_num_steps": "auto", "warmup_num_steps": 2}}}')
    assert main([*args, "--config", "ds.json", "--steps", "5"]) == 0
    out = capsys.readouterr().out
    assert "note: scheduler.total_num_steps" not in out
    assert _lr(out, 5) == pytest.approx(2e-3 * 1e-4)


def test_estimate_has_the_stage0_offload_row(capsys):
    """Stage 0 offloads (as usage.md says): every rank's host holds all the states."""
    assert main(["estimate", "--params", "1e9", "--world-size", "4", "--state-dtype", "fp32"]) == 0
    rows = {tuple(line.split()[:2]): line.split() for line in capsys.readouterr().out.splitlines()}
    gib = 1e9 / 2 ** 30
    assert float(rows[("0", "optim")][3]) == pytest.approx(16 * gib, abs=0.01)      # master, gradient, Adam
    assert float(rows[("1", "optim")][3]) == pytest.approx(16 * gib / 4, abs=0.01)


def test_auto_length_outside_zeroplug_train_is_refused_with_the_fix():
    import zeroplug
    with pytest.raises(zeroplug.ConfigError, match=r"total_num_steps = \"auto\" is the run's length"):
        zeroplug.load_config({"scheduler": {"plugin": "warmup_cosine", "total_num_steps": "auto"}})


def test_report_draws_each_run_of_an_appended_csv(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    rows = ["step,loss,samples_per_sec,eval_loss", "0,,,5.5", "1,5.6,,", "2,5.0,10,", "3,4.8,11,",
            "0,,,5.4", "1,5.3,,", "2,4.4,9,", "2,,,4.5"]
    (tmp_path / "m.csv").write_text("\n".join(rows) + "\n")
    assert main(["report", str(tmp_path / "m.csv")]) == 0
    out = capsys.readouterr().out
    assert f"found 2 runs in {tmp_path / 'm.csv'}: drew each (--run N draws one)" in out
    both = (tmp_path / "m.png").read_bytes()
    assert main(["report", str(tmp_path / "m.csv"), "--run", "1", "--out", str(tmp_path / "one.png")]) == 0
    assert "found 2 runs" in capsys.readouterr().out and (tmp_path / "one.png").read_bytes() != both
    assert main(["report", str(tmp_path / "m.csv"), "--run", "3"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --run 3: ") and "holds 2 runs; give 1 to 2" in err


@pytest.mark.slow
def test_ranks_under_torchrun_share_one_run_directory(tmp_path):
    """Rank 0 names the directory and the other ranks write their checkpoint shards into it."""
    import os
    import socket
    import subprocess
    import sys
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k != "ZEROPLUG_NO_SAVE"}
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--master-port", str(port),
                          "--nproc-per-node", "2", "-m", "zeroplug.cli", "train", *SMALL, "--steps", "2",
                          "--zero.plugin=stage2", "--collective-timeout", "120"],
                         cwd=tmp_path, env=dict(env, OMP_NUM_THREADS="1"), capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    assert out.stdout.count("zeroplug train: run ") == 1 and out.stdout.count("run saved:") == 1
    assert f"zeroplug train: run runs/{run.name} |" in out.stdout
    shards = sorted(p.name for p in (run / "checkpoints" / "global_step2").glob("rank_*"))
    assert len(shards) == 2, shards
    assert _steps(run / "metrics.csv") == [1, 2]
