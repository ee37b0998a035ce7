"""Peak GPU memory and tokens/s of zeroplug's stages 2 and 3 beside FSDP2 and plain PyTorch,
in one run; and the largest model of the reference family that trains without offload.

    python3 tests/benchmarks/memory_floor.py table [--model 1.3B] [--steps 3]
    python3 tests/benchmarks/memory_floor.py search [--time-cap 200] [--systems stage3,fsdp2]
    python3 tests/benchmarks/memory_floor.py all --time-cap 280          # both, one call
    torchrun --nproc-per-node 2 tests/benchmarks/memory_floor.py table    # per GPU, 2 ranks
    torchrun --nproc-per-node 4 tests/benchmarks/memory_floor.py table --rows @hier --host-size 2

The workload is shared/WORKLOAD.md's (micro batch 8 per GPU, sequence 1,024, bf16, AdamW
lr 1e-4, clipping 1.0, activation checkpointing on every block, random tokens). ``table``
measures, in this process and one after another: plain PyTorch (one rank only), FSDP2
(``fully_shard`` per block; no reshard after forward: the peer of stage 2; reshard: of
stage 3), zeroplug stage 2 and 3, and the variants whose extra memory an option turns on
(``stage3_low_precision_shards``, a fixed 5e8-element ``reduce_bucket_size``) or off
(``stage3_max_reuse_distance = 0``, several ranks: nothing kept gathered from forward to backward),
and DeepSpeed's stages 2 and 3 from its own JSON (deepspeed_configs/zero2.json, zero3.json;
with torch's fused AdamW as DeepSpeed's ``torch_adam``) when DeepSpeed is installed. tokens/s from
the median step after ``--warmup`` steps; peak = ``torch.cuda.max_memory_allocated()`` since
the model was built (the maximum over the ranks); for zeroplug rows, the memory report
between steps (``engine.memory_report()``).

Hierarchical sharding (``--rows @hier``, 4 or more ranks): FSDP2 and zeroplug's stages 2 and 3
flat against sharded within groups of 2 and replicated across them (FSDP2's HSDP: a 2-D mesh;
zeroplug's ``zero.shard_group_size = 2``), and zeroplug's stage 3 with ZeRO++ hpZ
(``zero.zero_hpz_partition_size = 2``: a secondary parameter shard per group). With ``--host-size N`` each row also records one
step's collectives and prints the bytes each rank sends per step (ring model), in all and in
the groups that span "hosts" of N consecutive ranks: what would cross the network between
hosts. Two torchrun agents (``--nnodes 2 --node-rank 0/1``, each with its own
``CUDA_VISIBLE_DEVICES``) stand in for two hosts; ``--host-size -1`` reads the ranks per agent.

``search`` bisects the family (``zeroplug.plugins.workload.models.PRESETS`` by size, 2.7B .. 13B,
with intermediate widths) for each system: every candidate trains ``--probe-steps`` steps in
a subprocess of its own (``torchrun`` with ``--nproc`` ranks when > 1); out of memory (or a
timeout) -> smaller. ``--time-cap`` bounds the whole search: what is known then is printed.
``--offload`` searches zeroplug stage 3 with parameters and optimizer on the CPU instead
(host memory decides; slow: minutes per candidate).

Writes the raw results to ``$OUT/memory_floor.json`` when ``OUT`` is set.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

GiB = 1024 ** 3
DS_CONFIGS = Path(__file__).parent / "deepspeed_configs"
# DeepSpeed (when installed) from its own JSON, with torch's fused AdamW for its FusedAdam:
# the same states, no just-in-time build
DS_STAGE2 = f"deepspeed-torch-adam:{DS_CONFIGS / 'zero2.json'}"
DS_STAGE3 = f"deepspeed-torch-adam:{DS_CONFIGS / 'zero3.json'}"
FAMILY = ["2.7B", "3.3B", "3.9B", "4.3B", "4.6B", "4.9B", "5.3B", "6.7B", "7.7B", "8.6B", "13B"]
MICRO_BATCH, SEQ = 8, int(os.environ.get("MEMORY_FLOOR_SEQ", 1024))   # (a shorter SEQ: CPU smoke runs)
OOM_EXIT = 3

TABLE = {   # label -> "torch" / FSDP2 variant, or the [zero] table of a zeroplug config
    "torch": "torch",
    "fsdp2-no-reshard": "fsdp2-no-reshard",
    "fsdp2": "fsdp2",
    "zeroplug stage2": {"plugin": "stage2"},
    "zeroplug stage2, reduce_bucket_size 5e8": {"plugin": "stage2", "reduce_bucket_size": int(5e8)},
    "zeroplug stage3": {"plugin": "stage3"},
    "zeroplug stage3, stage3_low_precision_shards": {"plugin": "stage3", "stage3_low_precision_shards": True},
    # the forward's tail kept gathered for the backward (DeepSpeed's default 1e9) or not at all
    # (several ranks only)
    "zeroplug stage3, stage3_max_reuse_distance 0": {"plugin": "stage3", "stage3_max_reuse_distance": 0},
    "zeroplug stage3, stage3_max_reuse_distance 1e8": {"plugin": "stage3", "stage3_max_reuse_distance": int(1e8)},
    "zeroplug stage3, stage3_max_reuse_distance 2e8": {"plugin": "stage3", "stage3_max_reuse_distance": int(2e8)},
    "deepspeed stage2": DS_STAGE2,
    "deepspeed stage3": DS_STAGE3,
    # hierarchical sharding in groups of 2 (several ranks in groups of 2 only): HSDP's peers
    "fsdp2-hsdp 2": "fsdp2-hsdp:2",
    "zeroplug stage3, shard_group_size 2": {"plugin": "stage3", "shard_group_size": 2},
    "zeroplug stage2, shard_group_size 2": {"plugin": "stage2", "shard_group_size": 2},
    "zeroplug stage3, zero_hpz_partition_size 2": {"plugin": "stage3", "zero_hpz_partition_size": 2},
    # stage 3 gathering each module on its own (DeepSpeed's granularity), not each block
    "zeroplug stage3, per module": {"plugin": "stage3", "stage3_block_units": False},
}
# --rows @NAME: these rows exactly
ROW_SETS = {
    # stage 3 beside FSDP2 and DeepSpeed, and beside zeroplug's own stage 2 (issue Q's table)
    "q": ["fsdp2", "zeroplug stage3", "zeroplug stage2", "zeroplug stage3, per module", "deepspeed stage3"],
    "q-again": ["fsdp2", "zeroplug stage3"],
    "hier": ["fsdp2", "fsdp2-hsdp 2", "zeroplug stage3", "zeroplug stage3, shard_group_size 2",
             "zeroplug stage3, zero_hpz_partition_size 2", "zeroplug stage2", "zeroplug stage2, shard_group_size 2"],
}
SEARCH = {
    "stage3": {"zero": {"plugin": "stage3"}},
    "stage2": {"zero": {"plugin": "stage2"}},
    "fsdp2": "fsdp2",
    "fsdp2-no-reshard": "fsdp2-no-reshard",
    "deepspeed-stage2": DS_STAGE2,
    "deepspeed-stage3": DS_STAGE3,
    "stage3-offload": {"zero": {"plugin": "stage3"}, "optimizer": {"plugin": "auto", "lr": 1e-4},
                       "offload": {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}}},
}


def deepspeed_installed() -> bool:
    import importlib.util
    return importlib.util.find_spec("deepspeed") is not None


def world() -> tuple[int, int]:
    return int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))


def setup_distributed() -> torch.device:
    rank, size = world()
    local = int(os.environ.get("LOCAL_RANK", 0))
    if not torch.cuda.is_available():     # a smoke run of the code paths: no peak to read
        if size > 1:
            import torch.distributed as dist
            if not dist.is_initialized():
                dist.init_process_group("gloo")
        return torch.device("cpu")
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    if size > 1:
        import torch.distributed as dist
        if not dist.is_initialized():
            dist.init_process_group("nccl", device_id=device)
    return device


def zeroplug_config(extra: dict) -> dict:
    cfg = {"batch": {"micro_batch_size": MICRO_BATCH, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9},
           "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "adamw", "lr": 1e-4},
           "scheduler": {"plugin": "none"}, "monitor": {"plugin": "none"}}
    for k, v in extra.items():
        cfg[k] = dict(v)
    return cfg


def measure(model_name: str, config, device, steps: int, warmup: int, host_size: int = 0,
            timeline: int = 0, label: str = "") -> dict:
    """Build, ``warmup`` + ``steps`` steps; tokens/s per GPU, peak GPU bytes (max over ranks).
    ``host_size`` > 0 (several ranks): one more step, untimed, with its collectives recorded
    (zeroplug.benchmarking.wire): the bytes each rank sends per step (ring model), in all and
    in the groups that span "hosts" of ``host_size`` consecutive ranks. ``timeline`` > 0 (CUDA):
    that many more steps under torch.profiler, rank 0's device time split into compute,
    collectives (exposed or hidden) and idle (zeroplug.benchmarking.timeline); the kernels'
    trace saved to $OUT/timeline_LABEL.json when OUT is set."""
    import statistics

    from zeroplug.benchmarking.measure import make_runner, release, sync
    from zeroplug.plugins.workload.models import GPT, get_preset
    cfg = get_preset(model_name, activation_checkpointing=True)

    def build():
        torch.manual_seed(0)
        return GPT(cfg)

    def batch(dev):
        x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, SEQ + 1), device=dev)
        return x[:, :-1], x[:, 1:]

    release(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    out: dict = {"model": model_name}
    runner = None
    try:
        runner = make_runner(build, batch, config, device)
        times = []
        for i in range(warmup + steps):
            b = runner.batches()
            t0 = time.perf_counter()
            loss = runner.step(b)
            sync(device)
            if i >= warmup:
                times.append(time.perf_counter() - t0)
        out.update(step_s=statistics.median(times), tokens_per_s=MICRO_BATCH * SEQ / statistics.median(times),
                   loss=loss)
        if host_size > 0 and world()[1] > 1:
            from zeroplug.benchmarking.wire import Collectives, spans_hosts
            b = runner.batches()
            with Collectives() as rec:
                runner.step(b)
            sync(device)
            out["sent_bytes"] = rec.sent_bytes()
            out["cross_host_bytes"] = rec.sent_bytes(lambda ranks: spans_hosts(ranks, host_size))
        if timeline > 0 and cuda:
            from zeroplug.benchmarking.timeline import Timeline
            with Timeline(device) as tl:
                for _ in range(timeline):
                    runner.step(runner.batches())
            if world()[0] == 0:
                out["timeline"] = tl.summary(timeline)
                if os.environ.get("OUT"):
                    slug = "".join(c if c.isalnum() else "_" for c in label)[:40]
                    tl.save(os.path.join(os.environ["OUT"], f"timeline_{slug}.json"))
        engine = getattr(runner, "engine", None)
        if hasattr(engine, "memory_report"):        # (a zeroplug engine)
            from zeroplug.plugins.observe.memory import format_memory_report
            from zeroplug.plugins.workload.models import param_count
            n = param_count(cfg)        # (stage 3's parameters are sharded: counted from the config)
            out["report"] = engine.memory_report()["device"]
            out["report_line"] = format_memory_report(engine.memory_report(), n)
    except torch.OutOfMemoryError as exc:
        out["error"] = "OOM: " + str(exc).splitlines()[0][:120]
    finally:
        if runner is not None:
            try:
                runner.close()
            except Exception:   # noqa: BLE001 - a half-built runner
                pass
        del runner
        peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], device=device)
        if world()[1] > 1:
            import torch.distributed as dist
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        out["peak_gib"] = peak.item() / GiB
        from zeroplug.benchmarking.measure import peak_host_bytes
        out["peak_host_rss_gib"] = peak_host_bytes() / GiB      # since the process started
        release(device)
    return out


def run_table(args, device) -> list[dict]:
    rank, size = world()
    rows = []
    for label, spec in TABLE.items():
        if label == "torch" and size > 1:
            continue        # plain PyTorch is one rank's baseline (no data parallelism)
        if "max_reuse_distance" in label and size == 1:
            continue        # one rank keeps nothing for reuse anyway (a gather is a cast)
        if ("hsdp 2" in label or "size 2" in label) and (size <= 2 or size % 2):
            continue        # groups of 2 need more than one group
        if args.rows and args.rows.startswith("@"):
            if label not in ROW_SETS[args.rows[1:]]:
                continue
        elif args.rows and not any(w.strip() in label for w in args.rows.split(",")):
            continue
        if label.startswith("deepspeed") and not deepspeed_installed():
            if rank == 0:
                print(f"{label:<48} skipped: DeepSpeed is not installed", flush=True)
            continue
        config = spec if isinstance(spec, str) else zeroplug_config({"zero": spec})
        r = measure(args.model, config, device, args.steps, args.warmup, args.host_size,
                    timeline=args.timeline, label=label)
        r["label"] = label
        rows.append(r)
        if rank == 0:
            tps = f"{r['tokens_per_s'] / 1e3:8.1f}k" if "tokens_per_s" in r else f"{'-':>9}"
            wire = (f"  sent {r['sent_bytes'] / 2**20:8.1f} MiB/step, across hosts {r['cross_host_bytes'] / 2**20:8.1f}"
                    if "sent_bytes" in r else "")
            print(f"{label:<48} {tps} tok/s/GPU  peak {r['peak_gib']:6.2f} GiB{wire}  {r.get('error', '')}", flush=True)
            if "report_line" in r:
                print(f"    {r['report_line']}", flush=True)
            if "timeline" in r:
                from zeroplug.benchmarking.timeline import format_summary
                print(format_summary(r.pop("timeline"), "    "), flush=True)
    return rows


def probe(args, device) -> int:
    """One candidate: exit 0 when it trains, OOM_EXIT when it does not fit."""
    spec = SEARCH[args.system]
    config = spec if isinstance(spec, str) else zeroplug_config(spec)
    r = measure(args.model, config, device, args.probe_steps, 1)
    if world()[0] == 0:
        print("PROBE " + json.dumps(r), flush=True)
    return OOM_EXIT if "error" in r else 0


def run_probe_process(model: str, system: str, args, timeout: float) -> dict:
    script = os.path.abspath(__file__)
    cmd = [sys.executable, script, "probe", "--model", model, "--system", system,
           "--probe-steps", str(args.probe_steps)]
    if args.nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc)] + cmd[1:]
    t0 = time.time()
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=max(1.0, timeout))
    except subprocess.TimeoutExpired:
        return {"model": model, "fits": False, "why": f"timeout after {timeout:.0f} s", "s": time.time() - t0}
    res = {"model": model, "fits": p.returncode == 0, "s": round(time.time() - t0, 1)}
    for line in p.stdout.splitlines():
        if line.startswith("PROBE "):
            res.update(json.loads(line[6:]))
    if p.returncode not in (0, OOM_EXIT):
        res["why"] = (p.stderr.strip().splitlines() or ["exit %d" % p.returncode])[-1][:200]
    return res


def run_search(args) -> dict:
    deadline = time.time() + args.time_cap
    found = {}
    systems = args.systems.split(",") if not args.offload else ["stage3-offload"]
    for k, system in enumerate(systems):
        lo, hi = 0, len(FAMILY) - 1      # bisect over the family's indices
        best, tried = None, []
        if args.start and args.start in FAMILY:
            mid0 = FAMILY.index(args.start)
        else:
            mid0 = None
        while lo <= hi:
            left = deadline - time.time()
            share = left / (len(systems) - k)        # what this system may still spend
            if share < 20:
                tried.append({"note": "time cap reached"})
                break
            mid = mid0 if mid0 is not None else (lo + hi) // 2
            mid0 = None
            r = run_probe_process(FAMILY[mid], system, args, timeout=min(share, args.probe_timeout))
            tried.append(r)
            print(f"  {system:<18} {FAMILY[mid]:>5}: {'fits' if r['fits'] else 'does not fit'}"
                  f" (peak {r.get('peak_gib', float('nan')):.1f} GiB, {r.get('tokens_per_s', 0) / 1e3:.1f}k tok/s, "
                  f"{r['s']} s){'  ' + r.get('why', r.get('error', '')) if not r['fits'] else ''}", flush=True)
            if r["fits"]:
                best, lo = FAMILY[mid], mid + 1
            else:
                hi = mid - 1
        found[system] = {"largest": best, "bounded_by": FAMILY[lo] if lo < len(FAMILY) else None, "tried": tried}
        print(f"{system}: largest that trains: {best or 'none of the family'}"
              f"{'' if lo >= len(FAMILY) else f' ({FAMILY[lo]} does not or was not tried)'}", flush=True)
    return found


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("what", choices=["table", "search", "all", "probe"])
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--steps", type=int, default=3, help="timed steps per table row")
    ap.add_argument("--rows", default=None, help="table: labels to run, comma-separated substrings (default all); "
                    "@hier: flat against hierarchical sharding in groups of 2 (" + "; ".join(ROW_SETS["hier"]) + ")")
    ap.add_argument("--host-size", type=int, default=0,
                    help="table, several ranks: record one step's collectives and count the bytes sent in groups "
                         "that span hosts of this many consecutive ranks (-1: LOCAL_WORLD_SIZE, torchrun's "
                         "ranks per agent); 0: off")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--timeline", type=int, default=0,
                    help="table, CUDA: profile this many more steps per row and print where rank 0's GPU time "
                         "goes (compute, collectives exposed or hidden, idle, the longest compute gaps)")
    ap.add_argument("--systems", default="stage3,fsdp2", help="search: " + ", ".join(SEARCH))
    ap.add_argument("--system", default="stage3", help="probe: one of the search systems")
    ap.add_argument("--offload", action="store_true", help="search zeroplug stage 3 with CPU offload")
    ap.add_argument("--probe-steps", type=int, default=1, help="steps after one warm-up per candidate")
    ap.add_argument("--probe-timeout", type=float, default=150.0)
    ap.add_argument("--start", default="4.3B", help="the search's first candidate")
    ap.add_argument("--nproc", type=int, default=1, help="search: ranks per candidate (torchrun)")
    ap.add_argument("--time-cap", type=float, default=240.0, help="seconds for the search")
    ap.add_argument("--family", default=",".join(FAMILY), help="search: the presets, smallest first")
    args = ap.parse_args()
    if args.rows and args.rows.startswith("@") and args.rows[1:] not in ROW_SETS:
        ap.error(f"--rows {args.rows}: the sets are " + ", ".join("@" + k for k in ROW_SETS))
    if args.host_size < 0:
        args.host_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    FAMILY[:] = args.family.split(",")
    if args.what == "probe":
        return probe(args, setup_distributed())
    results: dict = {"argv": sys.argv[1:], "world": world()[1]}
    if args.what in ("table", "all"):
        device = setup_distributed()
        if world()[0] == 0:
            print(f"{args.model}, micro batch {MICRO_BATCH} x {SEQ} per GPU, {world()[1]} GPU(s) "
                  f"({torch.cuda.get_device_name(device) if device.type == 'cuda' else 'cpu'}), torch {torch.__version__}", flush=True)
        results["table"] = run_table(args, device)
    if args.what in ("search", "all") and world()[0] == 0:
        if args.what == "all":
            args.time_cap = max(0.0, args.time_cap - (time.time() - START))
        print(f"largest model (search over {', '.join(FAMILY)}; {args.nproc} GPU(s) per candidate, "
              f"time cap {args.time_cap:.0f} s)", flush=True)
        results["search"] = run_search(args)
    out = os.environ.get("OUT")
    if out and world()[0] == 0:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / f"memory_floor_{args.what}_w{world()[1]}.json").write_text(json.dumps(results, indent=1, default=str))
    return 0


START = time.time()

if __name__ == "__main__":
    sys.exit(main())
