"""What the ranks' comparisons (``[faults] check_paths``, plugins/faults/agree.py) cost in a step.

For each stage, the built-in GPT trains on 2 ranks under real torchrun with the comparisons
on and off, alternating in blocks of steps within one job; the table gives the median step
time of each, the difference, the comparisons per step (each stage-3 gather and reduction,
each backward) and what one comparison costs alone (a loop of them on the comparisons' gloo
group). Stage 3 runs with every module
sharded (stage3_param_persistence_threshold = 0): the most gathers, so the most comparisons.
Run from the repo root:

    python3 tests/benchmarks/faults_cost.py                               # CPU: gloo, char-tiny
    python3 tests/benchmarks/faults_cost.py --device cuda --model 1.3B --seq 1024 --micro 4   # 2 GPUs: NCCL

On GPUs the comparisons stay on gloo in host memory: a comparison is a round trip between the
ranks' host threads, which run ahead of the GPU; it shows in the step only where the host
is what the step waits for.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zeroplug
    from zeroplug.plugins.faults import STATE
    from zeroplug.plugins.workload.models import GPT, get_preset

    rank = int(os.environ["RANK"])
    device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if args.device == "cuda" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    cfg = get_preset(args.model, seq_len=args.seq)
    zero = {"plugin": f"stage{args.stage}"}
    if args.stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    config = {"zero": zero, "batch": {"micro_batch_size": args.micro, "steps_per_print": 10_000},
              "precision": {"plugin": "bf16" if device.type == "cuda" else "fp32"},
              "monitor": {"plugin": "none"}}
    engine = zeroplug.initialize(GPT(cfg), config, device=device)
    faults = engine.run.faults
    agreement = faults.agreement
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=g).to(device)

    def step() -> float:
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t0

    for _ in range(args.warmup):
        step()
    # Note: the two modes alternate in blocks within one job, so that a machine whose load
    # drifts (other jobs) weighs on both alike
    times = {False: [], True: []}
    counted = 0
    for _ in range(args.rounds):
        for on in (False, True):
            faults.agreement = agreement if on else None
            before = agreement.count
            times[on] += [step() for _ in range(args.steps)]
            counted += agreement.count - before
    faults.agreement = agreement
    n = 200
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(n):          # one comparison, alone
        agreement.compare([4, 1, 0, 0, 7, 0])
    one = (time.perf_counter() - t0) / n
    if rank == 0:
        Path(args.out).write_text(json.dumps({"off": statistics.median(times[False]),
                                              "on": statistics.median(times[True]),
                                              "checks": counted / (args.rounds * args.steps), "one": one}))
    engine.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, stage: int) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-port",
               str(_port()), __file__, "--worker", "--stage", str(stage), "--out", str(out), "--device", args.device, "--model", args.model, "--seq", str(args.seq),
               "--micro", str(args.micro), "--steps", str(args.steps), "--warmup", str(args.warmup),
               "--rounds", str(args.rounds)]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise SystemExit(f"stage {stage}: the job failed\n{r.stdout[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="char-tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=5, help="steps per block of each mode")
    p.add_argument("--rounds", type=int, default=6, help="blocks of each mode, alternating")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.worker:
        worker(args)
        return
    rows = []
    for stage in map(int, args.stages.split(",")):
        r = launch(args, stage)
        rows.append((stage, r["off"], r["on"], r["checks"], r["one"]))
    print(f"{args.nproc} ranks, {args.device}, model {args.model}, seq {args.seq}, micro batch {args.micro}; median "
          f"step of {args.rounds} blocks of {args.steps} steps per mode, the modes alternating in one job")
    print("| stage | step, checks off (ms) | step, checks on (ms) | difference | comparisons per step | "
          "one comparison alone (us) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for stage, off, on, n, one in rows:
        print(f"| {stage} | {off * 1e3:.1f} | {on * 1e3:.1f} | {(on - off) / off:+.1%} | {n:.0f} | {one * 1e6:.0f} |")


if __name__ == "__main__":
    main()
