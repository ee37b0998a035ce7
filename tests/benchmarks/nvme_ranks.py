"""N ranks swapping the optimizer to NVMe on one disk, against dd with N writers and readers
on the same path, in one call.

  python3 -m tests.benchmarks.nvme_ranks --path /root/zeroplug_nvme               # every GPU, 1.3B
  python3 -m tests.benchmarks.nvme_ranks --path /tmp/x --ranks 2 --model char-tiny --seq 128 --steps 4   # CPU smoke

1. dd: N ``dd if=/dev/zero of=F_i bs=64M oflag=direct`` at once, then N ``dd if=F_i
   of=/dev/null bs=64M iflag=direct`` at once (page cache dropped first where allowed):
   the disk's aggregate direct-I/O write and read bytes/s with N streams.
2. One ``torchrun --nproc-per-node N`` of this script's worker: the reference workload
   (micro batch 8 per rank, bf16, AdamW, clipping 1.0) with ``offload.optimizer.plugin =
   "nvme"`` at ``--path``; every rank counts the bytes its swappers read and wrote in each
   step; the ranks' bytes are summed.
3. dd again (the disk's speed can drift; the mean of both is the reference).

Prints per run: the median step after two warm-up steps, the swap bytes per step (all ranks),
the swap traffic in GB/s (those bytes / the median step), what dd moves for the same mix of
reads and writes (bytes / (read bytes / dd read + written bytes / dd write)) and the ratio
(swap / dd; 1.0 = the step is as fast as the disk). JSON to $OUT/nvme_ranks.json when OUT is
set. Without CUDA the worker runs on the CPU (gloo): a smoke test of the script.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

from tests.benchmarks.swapper_vs_dd import drop_caches

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))

MiB = 1 << 20
WARMUP = 2


def parallel_dd(path: str, streams: int, count: int) -> tuple[float, float]:
    """(write, read) bytes/s of ``streams`` dd processes at once, each ``count`` x 64 MiB, O_DIRECT."""
    files = [os.path.join(path, f"dd_{i}.bin") for i in range(streams)]
    nbytes = streams * count * 64 * MiB
    try:
        drop_caches()
        t = time.perf_counter()
        procs = [subprocess.Popen(["dd", "if=/dev/zero", f"of={f}", "bs=64M", f"count={count}", "oflag=direct"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for f in files]
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"dd write failed: {err.decode()[-500:]}")
        w = nbytes / (time.perf_counter() - t)
        drop_caches()
        t = time.perf_counter()
        procs = [subprocess.Popen(["dd", f"if={f}", "of=/dev/null", "bs=64M", "iflag=direct"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for f in files]
        for p in procs:
            _, err = p.communicate()
            if p.returncode:
                raise RuntimeError(f"dd read failed: {err.decode()[-500:]}")
        r = nbytes / (time.perf_counter() - t)
    finally:
        for f in files:
            if os.path.exists(f):
                os.unlink(f)
    return w, r


# -- the worker (one rank under torchrun) ---------------------------------------------------
def swap_bytes(engine) -> tuple[int, int]:
    """(read, written) bytes issued so far by this rank's NVMe swappers."""
    r = w = 0
    for tier in {id(t): t for t in (engine.offload_optimizer, engine.offload_param)}.values():
        sw = getattr(tier, "_swapper", None)      # a benchmark may look inside (tests/benchmarks)
        if sw is not None:
            r, w = r + sw.bytes_read, w + sw.bytes_written
    return r, w


def worker(args) -> None:
    import torch
    import torch.distributed as dist

    import zeroplug
    from zeroplug.plugins.workload.models import GPT, get_preset
    cuda = torch.cuda.is_available()
    if "LOCAL_RANK" in os.environ:
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    os.makedirs(args.path, exist_ok=True)
    cfg = {"batch": {"micro_batch_size": args.micro_batch, "gradient_clipping": 1.0, "steps_per_print": 1000},
           "zero": {"plugin": args.zero}, "precision": {"plugin": "bf16"},
           "optimizer": {"plugin": "auto", "lr": 1e-4}, "monitor": {"plugin": "none"},
           "offload": {"optimizer": {"plugin": "nvme", "nvme_path": args.path}}}
    if args.zero == "stage3":
        cfg["offload"]["param"] = {"plugin": "cpu"}
    if args.no_reuse:
        cfg["offload"]["optimizer"]["reuse_resident"] = False
    mcfg = get_preset(args.model, activation_checkpointing=True)
    torch.manual_seed(0)
    if args.zero == "stage3":
        with zeroplug.init(cfg):
            model = GPT(mcfg)
    else:
        model = GPT(mcfg)
    engine = zeroplug.initialize(model, cfg)
    g = torch.Generator(device=dev).manual_seed(rank)
    times, moved = [], []
    for _ in range(args.steps):
        x = torch.randint(0, mcfg.vocab_size, (args.micro_batch, args.seq), device=dev, generator=g)
        y = torch.randint(0, mcfg.vocab_size, (args.micro_batch, args.seq), device=dev, generator=g)
        if cuda:
            torch.cuda.synchronize()
        b0 = swap_bytes(engine)
        t0 = time.perf_counter()
        loss = engine(x, y)
        engine.backward(loss)
        engine.step()
        engine.partitioner.wait_optimizer()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        b1 = swap_bytes(engine)
        moved.append((b1[0] - b0[0], b1[1] - b0[1]))
    engine.close()
    timed = moved[WARMUP:] or moved[-1:]
    rd = sum(m[0] for m in timed) / len(timed)
    wr = sum(m[1] for m in timed) / len(timed)
    if dist.is_initialized():
        t = torch.tensor([rd, wr], dtype=torch.float64, device=dev if cuda else "cpu")
        dist.all_reduce(t)
        rd, wr = t.tolist()
        tt = torch.tensor(times, dtype=torch.float64, device=dev if cuda else "cpu")
        dist.all_reduce(tt, op=dist.ReduceOp.MAX)      # a step ends when its slowest rank ends
        times = tt.tolist()
    if rank == 0:
        with open(args.result, "w") as f:
            json.dump({"world": world, "times": times, "read_bytes_per_step": rd, "write_bytes_per_step": wr,
                       "device": torch.cuda.get_device_name() if cuda else "CPU"}, f)


# -- the driver ------------------------------------------------------------------------------
def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", default="/root/zeroplug_nvme", help="a directory on the disk to test")
    p.add_argument("--ranks", type=int, default=0, help="ranks (and dd streams); default: every GPU (2 on a CPU)")
    p.add_argument("--model", default="1.3B")
    p.add_argument("--zero", choices=["stage2", "stage3"], default="stage2")
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--dd-gib", type=float, default=2.0, help="GiB each dd stream writes and reads")
    p.add_argument("--no-reuse", action="store_true",
                   help="reuse_resident = false: every sub-group written and read every step")
    p.add_argument("--timeout-s", type=float, default=480.0, help="the training run's limit")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result", default="", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args)
        return 0
    import torch
    ranks = args.ranks or torch.cuda.device_count() or 2
    os.makedirs(args.path, exist_ok=True)
    work = tempfile.mkdtemp(prefix="nvme_ranks-", dir=args.path)
    try:
        count = max(1, int(args.dd_gib * 16))
        before = parallel_dd(work, ranks, count)
        print(f"dd, {ranks} streams x {count * 64} MiB, O_DIRECT: write {before[0] / 1e9:.2f} GB/s, "
              f"read {before[1] / 1e9:.2f} GB/s (drop_caches {'ok' if drop_caches() else 'not allowed'})", flush=True)
        result = os.path.join(work, "result.json")
        swap_dir = os.path.join(work, "swap")
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
               os.path.abspath(__file__), "--worker", "--result", result, "--path", swap_dir, "--model", args.model,
               "--zero", args.zero, "--seq", str(args.seq), "--micro-batch", str(args.micro_batch),
               "--steps", str(args.steps)] + (["--no-reuse"] if args.no_reuse else [])
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        env["PYTHONPATH"] = os.pathsep.join(x for x in (ROOT, env.get("PYTHONPATH", "")) if x)
        t0 = time.time()
        run = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True, timeout=args.timeout_s)
        for line in (run.stdout + run.stderr).splitlines():
            if "cpu plan:" in line or "error" in line.lower():
                print("   " + line.strip(), flush=True)
        if run.returncode or not os.path.exists(result):
            print((run.stdout + run.stderr)[-4000:])
            print(f"training run failed (exit {run.returncode})")
            return 1
        with open(result) as f:
            res = json.load(f)
        after = parallel_dd(work, ranks, count)
        print(f"dd again: write {after[0] / 1e9:.2f} GB/s, read {after[1] / 1e9:.2f} GB/s", flush=True)
        dw, dr = (before[0] + after[0]) / 2, (before[1] + after[1]) / 2
        t = res["times"][WARMUP:] or res["times"][-1:]
        med = statistics.median(t)
        rd, wr = res["read_bytes_per_step"], res["write_bytes_per_step"]
        floor = rd / dr + wr / dw
        swap_gbs = (rd + wr) / med / 1e9
        dd_gbs = (rd + wr) / floor / 1e9 if floor else float("nan")
        summary = {"ranks": ranks, "model": args.model, "zero": args.zero, "device": res["device"],
                   "median_step_s": med, "min_step_s": min(t), "max_step_s": max(t), "read_GB_per_step": rd / 1e9,
                   "write_GB_per_step": wr / 1e9, "swap_GBps": swap_gbs, "dd_write_GBps": dw / 1e9,
                   "dd_read_GBps": dr / 1e9, "dd_same_mix_GBps": dd_gbs, "io_floor_s": floor,
                   "swap_over_dd": swap_gbs / dd_gbs if floor else None, "wall_s": time.time() - t0,
                   "times": res["times"]}
        print(f"\n{args.model} {args.zero}, optimizer on NVMe, {ranks} ranks, {res['device']}, path {args.path}")
        print("| ranks | median step s | min / max s | read + written per step GB | swap GB/s | "
              "dd GB/s, same mix (write / read) | swap / dd |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        print(f"| {ranks} | {med:.2f} | {min(t):.2f} / {max(t):.2f} | {rd / 1e9:.2f} + {wr / 1e9:.2f} | "
              f"{swap_gbs:.2f} | {dd_gbs:.2f} ({dw / 1e9:.2f} / {dr / 1e9:.2f}) | "
              f"{summary['swap_over_dd']:.2f} |" if floor else "| no swap traffic measured |")
        out = os.environ.get("OUT")
        if out:
            os.makedirs(out, exist_ok=True)
            with open(os.path.join(out, "nvme_ranks.json"), "w") as f:
                json.dump(summary, f, indent=1)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
