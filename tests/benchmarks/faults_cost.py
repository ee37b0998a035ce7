"""What the ranks' comparisons (``[faults] check_paths``, plugins/faults/agree.py) cost in a step.

For each stage, the built-in GPT trains on 2 ranks under real torchrun with the comparisons
on and off; the table gives the median step time of each, the difference, the comparisons
per step (each stage-3 gather and reduction, each backward) and what one comparison costs
alone (a loop of them on the comparisons' gloo group). Stage 3 runs with every module
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
              "monitor": {"plugin": "none"}, "faults": {"check_paths": args.checks}}
    engine = zeroplug.initialize(GPT(cfg), config, device=device)
    g = torch.Generator().manual_seed(rank)
    x = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=g).to(device)
    y = torch.randint(0, cfg.vocab_size, (args.micro, args.seq), generator=g).to(device)
    times = []
    counted = STATE.agreement.count if STATE.agreement is not None else 0
    for i in range(args.warmup + args.steps):
        if i == args.warmup:
            counted = STATE.agreement.count if STATE.agreement is not None else 0
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        loss.item()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    checks = ((STATE.agreement.count if STATE.agreement is not None else 0) - counted) / args.steps
    one = float("nan")
    if STATE.agreement is not None:           # one comparison, alone
        n = 200
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(n):
            STATE.agreement.compare([4, 1, 0, 0, 7, 0])
        one = (time.perf_counter() - t0) / n
    if rank == 0:
        Path(args.out).write_text(json.dumps({"step": statistics.median(times[args.warmup:]), "checks": checks,
                                              "one": one}))
    engine.close()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(args, stage: int, checks: bool) -> dict:
    with tempfile.TemporaryDirectory() as d:
        out = Path(d) / "out.json"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc), "--master-port",
               str(_port()), __file__, "--worker", "--stage", str(stage), "--checks", str(checks).lower(),
               "--out", str(out), "--device", args.device, "--model", args.model, "--seq", str(args.seq),
               "--micro", str(args.micro), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        r = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if r.returncode != 0:
            raise SystemExit(f"stage {stage}, checks {checks}: the job failed\n{r.stdout[-4000:]}")
        return json.loads(out.read_text())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--model", default="char-tiny")
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro", type=int, default=8)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--stages", default="2,3")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--stage", type=int, default=3)
    p.add_argument("--checks", default="true")
    p.add_argument("--out", default="")
    args = p.parse_args()
    if args.worker:
        args.checks = args.checks == "true"
        worker(args)
        return
    rows = []
    for stage in map(int, args.stages.split(",")):
        off = launch(args, stage, False)
        on = launch(args, stage, True)
        rows.append((stage, off["step"], on["step"], on["checks"], on["one"]))
    print(f"{args.nproc} ranks, {args.device}, model {args.model}, seq {args.seq}, micro batch {args.micro}, "
          f"median of {args.steps} steps")
    print("| stage | step, checks off (ms) | step, checks on (ms) | difference | comparisons per step | "
          "one comparison alone (us) |")
    print("| --- | --- | --- | --- | --- | --- |")
    for stage, off, on, n, one in rows:
        print(f"| {stage} | {off * 1e3:.1f} | {on * 1e3:.1f} | {(on - off) / off:+.1%} | {n:.0f} | {one * 1e6:.0f} |")


if __name__ == "__main__":
    main()
