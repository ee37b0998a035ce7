"""Where the peak of a training step goes, from the CUDA allocator's own history.

    python3 tests/benchmarks/memory_peak.py --model 1.3B --zero stage3 [--steps 3]

Records the allocator's history (torch.cuda.memory._record_memory_history), replays its
alloc / free events to find the peak of the last step, and prints the bytes live at that
moment grouped by the allocating frame (the first frame in zeroplug, else in torch.nn /
torch.optim / the model), largest first; and the zeroplug memory report after the step.
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
    return frames[0].get("name", "?") if frames else "?"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--zero", default="stage3")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--top", type=int, default=14)
    args = ap.parse_args()
    import zeroplug
    from zeroplug.workload.models import GPT, get_preset
    cfg = get_preset(args.model, activation_checkpointing=True)
    torch.manual_seed(0)
    model = GPT(cfg)
    engine = zeroplug.initialize(model, {"zero": {"plugin": args.zero}, "precision": {"plugin": "bf16"},
                                         "optimizer": {"plugin": "adamw", "lr": 1e-4}, "scheduler": {"plugin": "none"},
                                         "batch": {"micro_batch_size": 8, "gradient_clipping": 1.0,
                                                   "steps_per_print": 1}}, device="cuda")
    x = torch.randint(0, cfg.vocab_size, (8, 1025), device="cuda")
    for _ in range(args.steps - 1):
        engine.backward(engine(x[:, :-1], x[:, 1:]))
        engine.step()
    torch.cuda.synchronize()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    engine.backward(engine(x[:, :-1], x[:, 1:]))
    engine.step()
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
    from zeroplug.observe.memory import format_memory_report
    print(format_memory_report(engine.memory_report(), sum(p.numel() for p in model.parameters())))


if __name__ == "__main__":
    main()
