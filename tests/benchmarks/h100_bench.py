"""GPU benchmarks on the reference workload (shared/WORKLOAD.md).

  python -m tests.benchmarks.h100_bench workload --model 1.3B --zero stage2 [--steps 8]
  python -m tests.benchmarks.h100_bench workload --model 1.3B --baseline torch
  python -m tests.benchmarks.h100_bench offload-states --model 1.3B

Timing: median step time (forward + backward + optimizer, synchronised) after two
warm-up steps; tokens/s = micro batch x seq / step time; peak GPU memory =
torch.cuda.max_memory_allocated(); host memory = process RSS (and its peak).
Under torchrun every rank runs; rank 0 prints per-GPU numbers.

The same step as a pytest-benchmark suite (comparable across commits, with the in-run
torch baseline): tests/benchmarks/test_bench_train_step.py. This script is the instrument
behind docs/benchmarks.md's detailed figures: a synchronised phase breakdown, the NVMe
I/O floor, the offload_states timings.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

import zeroplug
from zeroplug.observe.memory import GB, host_rss_bytes
from zeroplug.plugins.workload.models import GPT, flops_per_token, get_preset, param_count


def peak_rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def build(args, cfg):
    mcfg = get_preset(args.model, activation_checkpointing=True)
    torch.manual_seed(0)
    if args.zero == "stage3" and args.baseline is None:
        with zeroplug.init(cfg):
            model = GPT(mcfg)
    else:
        model = GPT(mcfg)
    return mcfg, model


def timed(fn, t: dict, key: str):
    """``fn`` with synchronised wall time added to ``t[key]``."""
    def g(*a, **k):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        r = fn(*a, **k)
        torch.cuda.synchronize()
        t[key] = t.get(key, 0.0) + time.perf_counter() - t0
        return r
    return g


def host_timed(fn, t: dict, key: str):
    def g(*a, **k):
        t0 = time.perf_counter()
        r = fn(*a, **k)
        t[key] = t.get(key, 0.0) + time.perf_counter() - t0
        return r
    return g


def phases(engine, x, y) -> dict:
    """One more step with a sync at each phase boundary (slightly slower than the timed ones)."""
    if engine is None:
        return {}
    t: dict = {}
    part = engine.partitioner
    lane = getattr(engine.offload_optimizer, "lane", None)      # the cpu tier's GPU lane
    # Note: with the GPU lane, a sync after engine.step() would wait for the lane, which
    # training never does: the step is timed on the host and the lane by its CUDA events.
    step_timer = timed if lane is None else host_timed
    part.finish_gradients = timed(part.finish_gradients, t, "wait_d2h_and_reductions")
    part.step_optimizer = step_timer(part.step_optimizer, t, "optimizer_step_and_h2d")
    opt = engine.optimizer
    if hasattr(opt, "step_param"):       # the CPU kernels alone (no sync: they run on the host)
        opt.step_param = host_timed(opt.step_param, t, "cpu_adam_kernels")
    swap = getattr(engine.offload_optimizer, "swap", None)      # the nvme tier's sub-group swap
    if swap is not None:                 # time blocked on NVMe reads / writes
        swap.finish_in = host_timed(swap.finish_in, t, "nvme_wait_read")
        swap.finish_out = host_timed(swap.finish_out, t, "nvme_wait_write")
    if lane is not None:
        lane.timing = True
    loss = timed(engine, t, "forward")(x, y)
    timed(engine.backward, t, "backward_incl_overlapped_d2h")(loss)
    step_timer(engine.step, t, "step_total")()
    t["gpu_idle_estimate"] = t["step_total"] - 0.0   # no GPU compute runs inside engine.step
    out = {k: round(v, 4) for k, v in t.items()}     # kernels: the previous step's, as without the lane
    if lane is not None:
        out["gpu_lane_span"] = round(lane.span_seconds() or 0.0, 4)
        lane.timing = False
        engine.partitioner.wait_optimizer()
        torch.cuda.synchronize()
    return out


def swap_bytes(engine) -> tuple[int, int]:
    """(read, written) bytes issued so far by the engine's NVMe swappers."""
    r = w = 0
    for tier in {id(t): t for t in (getattr(engine, "offload_optimizer", None),
                                    getattr(engine, "offload_param", None)) if t is not None}.values():
        sw = getattr(tier, "_swapper", None)
        if sw is not None:
            r, w = r + sw.bytes_read, w + sw.bytes_written
    return r, w


def disk_bandwidth(path: str, gib: float = 2.0) -> tuple[float, float]:
    """dd's O_DIRECT write and read bytes/s at ``path``, in this run (the I/O floor's denominator)."""
    from tests.benchmarks.swapper_vs_dd import run_dd
    os.makedirs(path, exist_ok=True)
    return run_dd(path, max(1, int(gib * 16)))


def workload(args) -> dict:
    dev = torch.device("cuda", torch.cuda.current_device())
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    cfg = {"batch": {"micro_batch_size": args.micro_batch, "gradient_clipping": 1.0, "steps_per_print": 1000},
           "zero": {"plugin": args.zero}, "precision": {"plugin": "bf16"},
           "optimizer": {"plugin": "adamw", "lr": 1e-4}, "monitor": {"plugin": "none"}}
    if args.offload_optimizer:
        cfg["offload"] = {"optimizer": {"plugin": args.offload_optimizer}}
        if args.offload_optimizer == "nvme":
            os.makedirs(args.nvme_path, exist_ok=True)
            cfg["offload"]["optimizer"]["nvme_path"] = args.nvme_path
            if args.no_reuse:
                cfg["offload"]["optimizer"]["reuse_resident"] = False
        if args.aio:
            cfg["aio"] = {k: int(v) for k, v in (kv.split("=") for kv in args.aio)}
        cfg["optimizer"]["plugin"] = args.optimizer
        if args.overlap_step:
            cfg["offload"]["optimizer"]["overlap_step"] = True
            cfg["offload"]["optimizer"]["overlap_step_threads"] = args.overlap_threads
        if args.gpu_step_ratio is not None and args.offload_optimizer == "cpu":
            r = args.gpu_step_ratio
            cfg["offload"]["optimizer"]["gpu_step_ratio"] = r if r == "auto" else float(r)
        if args.gpu_resident_ratio is not None and args.offload_optimizer == "cpu":
            cfg["offload"]["optimizer"]["gpu_resident_ratio"] = args.gpu_resident_ratio
        if args.gpu_step_chunk and args.offload_optimizer == "cpu":
            cfg["offload"]["optimizer"]["gpu_step_chunk"] = int(args.gpu_step_chunk)
        if args.grad_dtype and args.offload_optimizer == "cpu":
            cfg["offload"]["optimizer"]["grad_dtype"] = args.grad_dtype
        cfg["zero"].update(reduce_bucket_size=args.bucket, sub_group_size=args.sub_group)
    if args.reuse_distance is not None:
        cfg["zero"]["stage3_max_reuse_distance"] = int(args.reuse_distance)
    if args.offload_param:
        cfg["offload"]["param"] = {"plugin": args.offload_param}
        if args.offload_param == "nvme":
            os.makedirs(args.nvme_path, exist_ok=True)
            cfg["offload"]["param"]["nvme_path"] = args.nvme_path
    nvme = "nvme" in (args.offload_optimizer, args.offload_param)
    bw = disk_bandwidth(args.nvme_path) if nvme and rank == 0 else None
    mcfg, model = build(args, cfg)
    nparams = param_count(mcfg)
    if args.baseline == "torch":
        model = model.to(dev)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True)

        def step(x, y):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = model(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    else:
        engine = zeroplug.initialize(model, cfg)

        def step(x, y):
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
    g = torch.Generator(device=dev).manual_seed(rank)
    times, moved = [], []
    for i in range(args.steps):
        x = torch.randint(0, mcfg.vocab_size, (args.micro_batch, args.seq), device=dev, generator=g)
        y = torch.randint(0, mcfg.vocab_size, (args.micro_batch, args.seq), device=dev, generator=g)
        torch.cuda.synchronize()
        b0 = swap_bytes(engine) if args.baseline is None else (0, 0)
        t0 = time.perf_counter()
        step(x, y)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        b1 = swap_bytes(engine) if args.baseline is None else (0, 0)
        moved.append((b1[0] - b0[0], b1[1] - b0[1]))
    med = statistics.median(times[2:])
    tps = args.micro_batch * args.seq / med
    res = {"model": args.model, "params": nparams, "zero": args.baseline or args.zero, "world": world,
           "offload_optimizer": args.offload_optimizer, "offload_param": args.offload_param, "step_s": med, "phases": phases(engine if args.baseline is None else None, x, y), "tokens_per_s_per_gpu": tps,
           "tflops_per_gpu": tps * flops_per_token(mcfg, args.seq) / 1e12,   # includes the 4/3 recompute
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / GB, "rss_gib": host_rss_bytes() / GB,
           "peak_rss_gib": peak_rss() / GB, "times": times}
    if args.baseline is None:
        masters = engine.partitioner.master_params()
        offloaded = engine.offload_optimizer.capabilities.offloaded
        res["host_grad_dtype"] = str(masters[0].grad.dtype) if offloaded and masters else None
        lane = getattr(engine.offload_optimizer, "lane_groups", ())
        res["gpu_lane_share"] = (sum(masters[k].numel() for k in lane) / max(1, sum(t.numel() for t in masters)))
        resident = getattr(engine.offload_optimizer, "resident_groups", ())
        res["gpu_resident_share"] = (sum(masters[k].numel() for k in resident)
                                     / max(1, sum(t.numel() for t in masters)))
    if bw is not None:
        rd, wr = moved[-1]
        floor = rd / bw[1] + wr / bw[0]
        res["io"] = {"read_bytes_per_step": rd, "write_bytes_per_step": wr, "dd_write_Bps": bw[0],
                     "dd_read_Bps": bw[1], "io_floor_s": floor, "step_over_floor": med / floor if floor else None}
        print(f"IO per step: read {rd / 1e9:.2f} GB, written {wr / 1e9:.2f} GB; dd in this run: write "
              f"{bw[0] / 1e9:.2f} GB/s, read {bw[1] / 1e9:.2f} GB/s; I/O floor (read/dd_read + write/dd_write) "
              f"{floor:.2f} s; step {med:.2f} s = {med / floor if floor else float('nan'):.2f} x floor", flush=True)
    if rank == 0 and res["phases"]:
        print("PHASES", json.dumps(res["phases"]), flush=True)
    if rank == 0:
        print(f"RESULT {res['zero']:>7} {args.model} world={world} step={med:.3f}s "
              f"tokens/s/gpu={tps:,.0f} TFLOPS={res['tflops_per_gpu']:.0f} "
              f"peakGPU={res['peak_gpu_gib']:.1f}GiB RSS={res['rss_gib']:.1f}GiB "
              f"grads={res.get('host_grad_dtype')} lane={res.get('gpu_lane_share', 0):.2f} "
              f"resident={res.get('gpu_resident_share', 0):.2f}", flush=True)
    return res


def offload_states_bench(args) -> list[dict]:
    """Offload/reload of a 1.3B bf16 engine after a step, over pin_memory x non_blocking."""
    dev = torch.device("cuda")
    cfg = {"batch": {"micro_batch_size": 1, "gradient_clipping": 1.0}, "zero": {"plugin": args.zero},
           "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "adamw", "lr": 1e-4},
           "monitor": {"plugin": "none"}}
    mcfg, model = build(args, cfg)
    engine = zeroplug.initialize(model, cfg)
    x = torch.randint(0, mcfg.vocab_size, (1, 256), device=dev)
    loss = engine(x, x)
    engine.backward(loss)
    engine.step()
    torch.cuda.synchronize()
    # the pinned copy bandwidth, same run
    n = 4 * GB
    a = torch.empty(n, dtype=torch.uint8, device=dev)
    h = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    for _ in range(2):
        torch.cuda.synchronize(); t = time.perf_counter(); h.copy_(a); torch.cuda.synchronize()
        d2h = n / (time.perf_counter() - t)
        t = time.perf_counter(); a.copy_(h); torch.cuda.synchronize()
        h2d = n / (time.perf_counter() - t)
    del a, h
    torch.cuda.empty_cache()
    rows = []
    before = torch.cuda.memory_allocated()
    for pin in (False, True):
        for nb in (False, True):
            for rep in range(3):
                torch.cuda.synchronize(); t = time.perf_counter()
                engine.offload_states(pin_memory=pin, non_blocking=nb)
                torch.cuda.synchronize(); t_off = time.perf_counter() - t
                after = torch.cuda.memory_allocated()
                t = time.perf_counter()
                engine.reload_states(non_blocking=nb)
                torch.cuda.synchronize(); t_on = time.perf_counter() - t
            rows.append({"pin_memory": pin, "non_blocking": nb, "offload_s": t_off, "reload_s": t_on,
                         "bytes": before - after, "mem_before": before, "mem_after": after})
    moved = rows[-1]["bytes"]
    print(f"pinned copy bandwidth (same run): D2H {d2h / 1e9:.1f} GB/s, H2D {h2d / 1e9:.1f} GB/s; "
          f"states moved {moved / 1e9:.2f} GB; GPU memory {before / GB:.2f} GiB -> "
          f"{rows[-1]['mem_after'] / 2**20:.1f} MiB after offload")
    print("| pin_memory | non_blocking | offload s (GB/s) | reload s (GB/s) |")
    print("| --- | --- | --- | --- |")
    for r in rows:
        print(f"| {int(r['pin_memory'])} | {int(r['non_blocking'])} | {r['offload_s']:.3f} "
              f"({r['bytes'] / r['offload_s'] / 1e9:.1f}) | {r['reload_s']:.3f} ({r['bytes'] / r['reload_s'] / 1e9:.1f}) |")
    # losses continue exactly: a step after a round trip equals a step without it is tested in tests/
    return [{**r, "d2h_gbps": d2h / 1e9, "h2d_gbps": h2d / 1e9} for r in rows]


def main():
    p = argparse.ArgumentParser()
    p.add_argument("what", choices=["workload", "offload-states"])
    p.add_argument("--model", default="1.3B")
    p.add_argument("--zero", default="stage2")
    p.add_argument("--baseline", choices=["torch"], default=None)
    p.add_argument("--offload-optimizer", choices=["cpu", "nvme"], default=None)
    p.add_argument("--offload-param", choices=["cpu", "nvme"], default=None, help="stage 3, with --offload-optimizer")
    p.add_argument("--nvme-path", default="/root/zeroplug_swap", help="swap directory for the nvme tier")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--optimizer", default="auto", help="optimizer plugin with --offload-optimizer (auto: cpu_adam)")
    p.add_argument("--bucket", type=float, default=1e8, help="reduce_bucket_size with offload")
    p.add_argument("--sub-group", type=float, default=1e8, help="sub_group_size with offload")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--aio", nargs="*", default=[], help="[aio] settings for the nvme tier, e.g. queue_depth=32")
    p.add_argument("--overlap-step", action="store_true", help="[offload.optimizer] overlap_step = true (cpu tier)")
    p.add_argument("--overlap-threads", type=int, default=0, help="overlap_step_threads (0: all cores but one)")
    p.add_argument("--no-reuse", action="store_true", help="[offload.optimizer] reuse_resident = false (nvme)")
    p.add_argument("--reuse-distance", type=float, default=None, help="zero.stage3_max_reuse_distance")
    p.add_argument("--gpu-step-ratio", default=None, help="[offload.optimizer] gpu_step_ratio (cpu tier): a "
                   "number or auto; default: the option's default")
    p.add_argument("--gpu-resident-ratio", type=float, default=None,
                   help="[offload.optimizer] gpu_resident_ratio (cpu tier): the share of the sub-groups whose states "
                        "stay in GPU memory")
    p.add_argument("--gpu-step-chunk", type=float, default=None, help="[offload.optimizer] gpu_step_chunk")
    p.add_argument("--grad-dtype", choices=["auto", "fp32"], default=None, help="[offload.optimizer] grad_dtype")
    p.add_argument("--json")
    args = p.parse_args()
    if "LOCAL_RANK" in os.environ:
        torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        torch.distributed.init_process_group("nccl")
    res = workload(args) if args.what == "workload" else offload_states_bench(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
