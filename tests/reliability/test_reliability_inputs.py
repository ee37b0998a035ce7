"""Every input checked: a one-line ``error:`` naming the input and the fix, exit 2, no traceback.

Config files that are not text, data too small for one window, non-finite or out-of-range
numbers, non-positive step counts, a ``checkpoint.dir`` that cannot be used, and
checkpoint directories whose ``latest`` or manifest is missing, corrupt or points outside
(``--resume`` says so and offers, or with ``--resume=auto`` takes, the newest checkpoint
that verifies, never an unverified one).
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import zeroplug
from zeroplug import checkpoint
from zeroplug.checkpoint import CheckpointError
from zeroplug.cli import main

from tests.support.toy import ToyNet

COMMON = ["train", "--max-bytes", "40000", "--seq", "16", "--batch.micro_batch_size=2",
          "--batch.steps_per_print=1000", "--monitor.plugin=none"]


def run_cli(capsys, *args) -> tuple[int, str, str]:
    code = main([*COMMON, *args])
    out, err = capsys.readouterr()
    return code, out, err


def one_error(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


# --- malformed inputs --------------------------------------------------------------------------

def _toml(tmp_path, text, name="c.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


BAD = {
    # name: (files to write, arguments, what the error must say)
    "binary-config": ({"c.toml": os.urandom(64) + b"\0" + os.urandom(64)}, ["--config", "{c.toml}"],
                      ["--config", "c.toml' is not a text file", "TOML file or a DeepSpeed JSON"]),
    "latin1-config": ({"c.toml": "lr = 'caf\xe9'".encode("latin-1")}, ["--config", "{c.toml}"],
                      ["not a text file (binary data at byte 9)"]),
    "tiny-data": ({"d.txt": b"abc"}, ["--data", "{d.txt}"],
                  ["--data", "d.txt'", "3 bytes is too small", "window of 17 bytes", "at least 340 bytes"]),
    "lr-inf-toml": ({"c.toml": b"[optimizer]\nlr = inf\n"}, ["--config", "{c.toml}"],
                    ["optimizer.lr = inf is not a finite number"]),
    "lr-inf-override": ({}, ["--optimizer.lr=inf"], ["optimizer.lr = inf is not a finite number"]),
    "lr-nan": ({}, ["--optimizer.lr=nan"], ["optimizer.lr = nan is not a finite number"]),
    "lr-inf-deepspeed-json": ({"ds.json": b'{"optimizer": {"type": "AdamW", "params": {"lr": Infinity}}}'},
                              ["--config", "{ds.json}"], ["optimizer.lr", "not a finite number"]),
    "beta-one": ({}, ["--optimizer.betas=[0.9, 1.0]"], ["optimizer.betas", "out of range", "< 1.0"]),
    "eps-minus-inf": ({}, ["--optimizer.eps=-inf"], ["optimizer.eps = -inf is not a finite number"]),
    "clip-inf": ({}, ["--batch.gradient_clipping=inf"], ["batch.gradient_clipping = inf is not a finite"]),
    "static-loss-scale-inf": ({}, ["--precision.plugin=fp16", "--precision.loss_scale=inf"],
                              ["precision.loss_scale = inf is not a finite number"]),
    "min-loss-scale-zero": ({}, ["--precision.plugin=fp16", "--precision.min_loss_scale=0"],
                            ["precision.min_loss_scale = 0", "out of range", "> 0.0"]),
    "steps-zero": ({}, ["--steps", "0"], ["--steps 0: must be a positive number"]),
    "steps-negative": ({}, ["--steps", "-5"], ["--steps -5: must be a positive number"]),
    "seq-zero": ({}, ["--seq", "0"], ["--seq 0: must be a positive number"]),
    "checkpoint-dir-is-a-file": ({"ck": b"not a directory"}, ["--checkpoint.dir={ck}"],
                                 ["checkpoint.dir", "ck' is a file, not a directory"]),
    "checkpoint-dir-under-a-file": ({"ck": b"x"}, ["--checkpoint.dir={ck}/sub"],
                                    ["ck/sub'", "ENOTDIR", "Fix:"]),
    # bounded at config time, not an overflow deep in torch
    "micro-batch-1e30": ({}, ["--batch.micro_batch_size=1e30"],
                         ["batch.micro_batch_size", "out of range", "<= 16777216"]),
    "micro-batch-int64-max": ({}, [f"--batch.micro_batch_size={2**63 - 1}"],
                              ["batch.micro_batch_size = 9223372036854775807", "out of range"]),
    "monitor-path-uncreatable": ({}, ["--monitor.plugin=csv", "--monitor.path=/nonexistent-dir/sub/m.csv"],
                                 ["monitor.path '/nonexistent-dir/sub/m.csv' cannot be created",
                                  "No such file or directory"]),
    "deepspeed-json-nested-50000": ({"ds.json": b"[" * 50000 + b"]" * 50000}, ["--config", "{ds.json}"],
                                    ["ds.json", "nested more deeply than a config can be"]),
    "toml-nested-50000": ({"c.toml": b"a = " + b"[" * 50000 + b"]" * 50000}, ["--config", "{c.toml}"],
                          ["c.toml", "nested more deeply"]),
    "config-dev-zero": ({}, ["--config", "/dev/zero"], ["config file '/dev/zero' is not a regular file"]),
    "steps-abc": ({}, ["--steps", "abc"], ["zeroplug train: argument --steps: invalid int value: 'abc'"]),
    "seq-1e9": ({}, ["--seq", "1000000000"], ["is too small for one training window of 1000000001 bytes",
                                              "a shorter --seq"]),
}


@pytest.mark.parametrize("name", list(BAD))
def test_malformed_input_is_one_line(tmp_path, capsys, name):
    files, args, want = BAD[name]
    paths = {}
    for fname, data in files.items():
        (tmp_path / fname).write_bytes(data)
        paths[fname] = str(tmp_path / fname)
    for key, path in paths.items():
        args = [a.replace("{" + key + "}", path) for a in args]
    code, out, err = run_cli(capsys, "--steps", "2", *args)
    assert code == 2, (out, err)
    line = one_error(err)
    for w in want:
        assert w in line, (w, line)
    assert "train loss" not in out                         # refused before any training


def test_malformed_input_from_a_real_process(tmp_path):
    """The same in a process of its own: exit status 2, one line, no traceback."""
    cfg = tmp_path / "c.toml"
    cfg.write_bytes(bytes(range(256)))
    r = subprocess.run([sys.executable, "-m", "zeroplug.cli", *COMMON, "--config", str(cfg)], capture_output=True,
                       text=True)
    assert r.returncode == 2 and one_error(r.stderr).startswith(f"error: --config '{cfg}' is not a text file")


def test_config_fifo_is_refused_without_blocking(tmp_path, capsys):
    fifo = tmp_path / "c.toml"
    os.mkfifo(fifo)
    code, out, err = run_cli(capsys, "--steps", "1", "--config", str(fifo))
    assert code == 2 and f"config file '{fifo}' is not a regular file" in one_error(err)


@pytest.mark.parametrize("argv", [["train", "--steps", "abc"], ["train", "--bogus"], ["export"],
                                  ["estimate", "--world-size", "x"], ["tune", "--steps", "x"], ["report"],
                                  ["convert"], ["docs", "--nope"], ["nosuch"], []])
def test_argparse_errors_are_one_line_for_every_subcommand(capsys, argv):
    assert main(argv) == 2
    line = one_error(capsys.readouterr().err)
    assert line.startswith("error: zeroplug") and "--help" in line, line


def test_a_model_that_does_not_fit_host_memory_is_one_line(tmp_path):
    """torch's allocation failure (alloc_cpu.cpp) in a process whose address space is
    limited below the model's size: one line with the numbers, exit 2."""
    resource = pytest.importorskip("resource")

    def limit():
        resource.setrlimit(resource.RLIMIT_AS, (1200 << 20, 1200 << 20))
    r = subprocess.run([sys.executable, "-m", "zeroplug.cli", *COMMON, "--model", "350M", "--steps", "1"],
                       capture_output=True, text=True, preexec_fn=limit, cwd=tmp_path)
    assert r.returncode == 2, r.stderr[-2000:]
    line = one_error(r.stderr)
    assert "--model 350M does not fit this host's memory" in line and "you tried to allocate" in line, line


def test_resume_of_a_named_tag_in_an_empty_dir_fails(tmp_path, capsys):
    code, out, err = run_cli(capsys, "--steps", "1", f"--checkpoint.dir={tmp_path / 'nockpt'}",
                             "--resume=global_step5")
    assert code == 2
    line = one_error(err)
    assert "'global_step5' not found in" in line and "train loss" not in out, line
    for choice in ("--resume", "--resume=auto"):
        code, out, err = run_cli(capsys, "--steps", "1", f"--checkpoint.dir={tmp_path / 'empty'}", choice)
        assert code == 0 and "starting at step 0" in out, err
        shutil.rmtree(tmp_path / "empty")


# --- resume: latest missing, corrupt or outside -------------------------------------------------------

@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A CLI run's checkpoint directory with global_step1 and global_step2."""
    ck = tmp_path_factory.mktemp("saved") / "ck"
    assert main([*COMMON, "--steps", "2", f"--checkpoint.dir={ck}", "--checkpoint.every_n_steps=1"]) == 0
    return ck


@pytest.fixture
def ck(saved, tmp_path):
    d = tmp_path / "ck"
    shutil.copytree(saved, d)
    return d


def _corrupt(path: Path) -> None:
    f = path / "rank_00000.pt"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0x01
    f.write_bytes(bytes(data))


LATEST_PROBLEMS = {
    "missing": (lambda ck: (ck / "latest").unlink(), "there is no 'latest' file", 2),
    "binary": (lambda ck: (ck / "latest").write_bytes(b"\xff\xfe\0\x81garbage"),
               "latest' is corrupt: 11 bytes of binary data", 2),
    "names-missing-tag": (lambda ck: (ck / "latest").write_text("global_step9"), "'global_step9' not found", 2),
    "names-corrupt-tag": (lambda ck: _corrupt(ck / "global_step2"), "rank_00000.pt is corrupt (sha256", 1),
    "points-outside": (lambda ck: (ck / "latest").write_text("../elsewhere"), "names '../elsewhere', which is not "
                       "a checkpoint tag", 2),
    "absolute-path": (lambda ck: (ck / "latest").write_text("/etc"), "names '/etc', which is not a checkpoint tag", 2),
}


@pytest.mark.parametrize("problem", list(LATEST_PROBLEMS))
def test_resume_says_what_is_wrong_and_offers_the_newest_verified(ck, capsys, problem):
    break_it, says, good = LATEST_PROBLEMS[problem]
    break_it(ck)
    code, out, err = run_cli(capsys, "--steps", "3", f"--checkpoint.dir={ck}", "--resume")
    assert code == 2
    line = one_error(err)
    assert line.startswith("error: --resume: ") and says in line, line
    assert line.endswith(f"the newest checkpoint that verifies is 'global_step{good}': continue from it with "
                         f"--resume=auto (or --resume=global_step{good})"), line
    code, out, err = run_cli(capsys, "--steps", "3", f"--checkpoint.dir={ck}", "--resume=auto")
    assert code == 0, err
    assert f"resumed from {ck / f'global_step{good}'} at step {good}" in out


def test_resume_never_takes_an_unverified_checkpoint(ck, capsys):
    _corrupt(ck / "global_step1")
    _corrupt(ck / "global_step2")
    code, out, err = run_cli(capsys, "--steps", "3", f"--checkpoint.dir={ck}", "--resume=auto")
    assert code == 2
    line = one_error(err)
    assert "rank_00000.pt is corrupt" in line and f"no other checkpoint in {ck} verifies" in line, line


def test_resume_a_named_tag(ck, capsys):
    code, out, err = run_cli(capsys, "--steps", "3", f"--checkpoint.dir={ck}", "--resume=global_step1")
    assert code == 0 and f"resumed from {ck / 'global_step1'} at step 1" in out, err
    code, out, err = run_cli(capsys, "--steps", "3", f"--checkpoint.dir={ck}", "--resume=../../etc")
    assert code == 2 and "use a plain name" in one_error(err)


def test_resume_on_an_empty_dir_starts_at_zero(tmp_path, capsys):
    code, out, err = run_cli(capsys, "--steps", "1", f"--checkpoint.dir={tmp_path / 'new'}", "--resume=auto")
    assert code == 0 and "no checkpoint in" in out and "starting at step 0" in out


# --- paths that lead outside the checkpoint directory -----------------------------------------------

def _engine():
    torch.manual_seed(0)
    return zeroplug.initialize(ToyNet(), {"monitor": {"plugin": "none"}})


def _rewrite_manifest(path: Path, change) -> None:
    m = json.loads((path / "manifest.json").read_text())
    change(m)
    body = {k: v for k, v in m.items() if k != "checksum"}
    m["checksum"] = hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
    (path / "manifest.json").write_text(json.dumps(m))


def test_manifest_and_tag_paths_outside_are_refused(tmp_path):
    e = _engine()
    good = Path(e.save_checkpoint(tmp_path / "ck"))
    e.close()
    outside = tmp_path / "outside.pt"
    shutil.copy(good / "rank_00000.pt", outside)
    # a manifest (with a valid checksum) that names a file outside its directory
    bad = tmp_path / "ck" / "bad"
    shutil.copytree(good, bad)

    def escape(m):
        m["files"]["../../outside.pt"] = m["files"].pop("rank_00000.pt")
    _rewrite_manifest(bad, escape)
    with pytest.raises(CheckpointError, match=r"names the file '\.\./\.\./outside\.pt', which is outside"):
        _engine().load_checkpoint(tmp_path / "ck", tag="bad")
    with pytest.raises(CheckpointError, match="outside the checkpoint"):
        checkpoint.consolidate(tmp_path / "ck", tag="bad")
    # a tag that is a symbolic link to a checkpoint elsewhere
    (tmp_path / "elsewhere").mkdir()
    shutil.copytree(good, tmp_path / "elsewhere" / "t")
    os.symlink(tmp_path / "elsewhere" / "t", tmp_path / "ck" / "linked")
    (tmp_path / "ck" / "latest").write_text("linked")
    with pytest.raises(CheckpointError, match="is a link to .*outside the checkpoint directory; refused"):
        _engine().load_checkpoint(tmp_path / "ck")
    # a file inside that is a symbolic link
    os.unlink(tmp_path / "ck" / "linked")
    (good / "rank_00000.pt").rename(tmp_path / "moved.pt")
    os.symlink(tmp_path / "moved.pt", good / "rank_00000.pt")
    with pytest.raises(CheckpointError, match="rank_00000.pt is a symbolic link; refused"):
        _engine().load_checkpoint(tmp_path / "ck", tag=good.name)


def test_api_resume_fallback(tmp_path):
    e = _engine()
    for tag in ("a", "b"):
        e.save_checkpoint(tmp_path, tag=tag)
    e.close()
    (tmp_path / "latest").write_bytes(b"\0\0\0")
    e = _engine()
    with pytest.raises(CheckpointError, match="binary data") as ei:
        checkpoint.resume(e, tmp_path)
    assert ei.value.newest == "b"
    path, _ = checkpoint.resume(e, tmp_path, fallback=True)
    assert Path(path).name == "b"
    assert checkpoint.resume(e, tmp_path / "nothing") is None
