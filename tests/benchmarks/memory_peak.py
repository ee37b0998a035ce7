"""Where the peak of a training step goes, from the CUDA allocator's own history.

    python3 tests/benchmarks/memory_peak.py --model 1.3B --zero stage3 [--steps 3]
    python3 tests/benchmarks/memory_peak.py --model 1.3B --zero fsdp2-no-reshard --live

Records the allocator's history (torch.cuda.memory._record_memory_history), replays its
alloc / free events to find the peak of the last step, and prints the bytes live at that
moment grouped by the allocating frame (the first frame in zeroplug, else in torch.nn /
torch.optim / the model), largest first; and the zeroplug memory report after the step.
``--live`` records from before the model is built and also lists what stays allocated
between steps, by allocating frame (what the memory report's ``rest`` is made of).
``--zero`` is a zeroplug stage or a peer: ``torch``, ``fsdp2``, ``fsdp2-no-reshard``.
"""
from __future__ import annotations

import argparse
import collections

import torch


def frame_label(frames) -> str:
    for f in frames:
        name = f.get("filename", "")
        if "zeroplug" in name or "/core/" in name or "/plugins/" in name:
            return f"{name.split('/')[-2]}/{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    for f in frames:
        name = f.get("filename", "")
        if "torch/nn" in name or "torch/optim" in name or "models.py" in name or "autograd" in name:
            return f"{name.split('/')[-1]}:{f.get('line')} {f.get('name')}"
    # no Python frame of ours: the first C++ frame outside the allocator and the unwinder
    skip = ("unwind", "c10::cuda::CUDACachingAllocator", "CachingAllocator", "c10::", "gather_with_cpp",
            "CapturedTraceback", "torch::CapturedTraceback")
    names = [f.get("name", "") for f in frames]
    for n in names:
        if n and not any(k in n for k in skip):
            py = next((f"{f.get('filename', '').split('/')[-1]}:{f.get('line')} {f.get('name')}" for f in frames
                       if f.get("filename", "").endswith(".py")), "")
            return f"{n[:90]} | {py}"
    return names[0] if names else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--zero", default="stage3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    ap.add_argument("--live", action="store_true", help="also list what stays allocated between steps")
    args = ap.parse_args()
    from zeroplug.benchmarking.measure import make_runner
    from zeroplug.plugins.workload.models import GPT, get_preset
    cfg = get_preset(args.model, activation_checkpointing=True)
    if args.live:
        torch.cuda.memory._record_memory_history(max_entries=1_000_000)

    def build():
        torch.manual_seed(0)
        return GPT(cfg)

    x = torch.randint(0, cfg.vocab_size, (8, 1025), device="cuda")
    peer = args.zero in ("torch", "fsdp2", "fsdp2-no-reshard")
    config = args.zero if peer else {
        "zero": {"plugin": args.zero}, "precision": {"plugin": "bf16"}, "optimizer": {"plugin": "adamw", "lr": 1e-4},
        "scheduler": {"plugin": "none"}, "batch": {"micro_batch_size": 8, "gradient_clipping": 1.0, "steps_per_print": 1}}
    runner = make_runner(build, lambda dev: (x[:, :-1], x[:, 1:]), config, "cuda")
    for _ in range(args.steps - 1):
        runner.step(runner.batches())
    torch.cuda.synchronize()
    if args.live:
        print_live(torch.cuda.memory._snapshot(), args.top)
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    runner.step(runner.batches())
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    live, cur, peak, at_peak = {}, 0, 0, {}
    for ev in snap["device_traces"][0]:
        a = ev["action"]
        if a == "alloc":
            live[ev["addr"]] = (ev["size"], frame_label(ev.get("frames", [])))
            cur += ev["size"]
            if cur > peak:
                peak, at_peak = cur, dict(live)
        elif a in ("free_requested", "free_completed") and ev["addr"] in live and a == "free_completed":
            cur -= live.pop(ev["addr"])[0]
    groups = collections.Counter()
    for size, label in at_peak.values():
        groups[label] += size
    G = 2**30
    print(f"{args.zero} {args.model}: allocated between steps {base / G:.2f} GiB; max_memory_allocated "
          f"{torch.cuda.max_memory_allocated() / G:.2f} GiB; the step's own peak above that {peak / G:.2f} GiB")
    for label, size in groups.most_common(args.top):
        print(f"  {size / G:7.3f} GiB  {label}")
    engine = getattr(runner, "engine", None)
    if engine is not None:
        from zeroplug.plugins.observe.memory import format_memory_report
        from zeroplug.plugins.workload.models import param_count
        print(format_memory_report(engine.memory_report(), param_count(cfg)))


def print_live(snap, top: int) -> None:
    """Blocks allocated now, by allocating frame (frames known for those allocated while the
    history was recorded), smallest groups included: the ``rest`` of the memory report."""
    groups, count = collections.Counter(), collections.Counter()
    for seg in snap["segments"]:
        for blk in seg["blocks"]:
            if blk["state"] != "active_allocated":
                continue
            label = frame_label(blk.get("frames", []))
            groups[label] += blk["size"]
            count[label] += 1
    total = sum(groups.values())
    print(f"live between steps: {total / 2**30:.3f} GiB in {sum(count.values())} blocks")
    for label, size in groups.most_common(top * 2):
        print(f"  {size / 2**20:10.1f} MiB  {count[label]:5d} blocks  {label}")


if __name__ == "__main__":
    main()
