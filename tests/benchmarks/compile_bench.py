"""torch.compile under zeroplug stage 3 beside FSDP2 compiled the same way, and the
mixture-of-experts check (experts idle on some ranks), on several GPUs.

    torchrun --nproc-per-node 4 -m tests.benchmarks.compile_bench table [--model 1.3B] [--steps 10] [--rows fsdp2,stage3]
    torchrun --nproc-per-node 4 -m tests.benchmarks.compile_bench moe

``table``: the reference workload (shared/WORKLOAD.md: micro batch 8 per GPU, sequence
1,024, bf16, AdamW lr 1e-4, clipping 1.0, activation checkpointing on every block), one
row after another in this process: FSDP2 (``fully_shard`` per block and on the root,
reshard after forward) eager and with ``block.compile()`` on every block, zeroplug stage 3
eager, with ``block.compile()`` on every block, with ``torch.compile`` of the whole model,
and with each block one unit (``zero.stage3_leaf_modules = ["Block"]``) eager and compiled
per block. tokens/s per GPU from the median step after ``--warmup`` steps (the first steps
compile), peak = ``torch.cuda.max_memory_allocated()`` (max over ranks), min / max step.

``moe``: a mixture of experts (top-1 routing by token id, experts skipped when no token
routes to them) where rank r's tokens route only to its own two experts, trained at stage
3 (and stage 2) in fp32 with NCCL, against torch AdamW on the concatenated batch computed
on every rank; prints the worst loss and parameter differences and PASS / FAIL.

Without CUDA both run on the CPU (gloo) as a smoke test of the code paths, e.g.
``MEMORY_FLOOR_SEQ=64 torchrun --nproc-per-node 2 -m tests.benchmarks.compile_bench table
--model char-tiny --steps 1 --warmup 1``.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

from tests.benchmarks.memory_floor import MICRO_BATCH, SEQ, setup_distributed, world, zeroplug_config

GiB = 1024 ** 3
ROWS = {   # --rows key -> label
    "fsdp2": "fsdp2", "fsdp2-compiled": "fsdp2 compiled per block",
    "stage3": "zeroplug stage3", "stage3-compiled": "zeroplug stage3 compiled per block",
    "stage3-whole": "zeroplug stage3 compiled whole",
    "stage3-leaf": "zeroplug stage3 Block leaf", "stage3-leaf-compiled": "zeroplug stage3 Block leaf compiled per block",
}


def compile_blocks(model) -> None:
    for block in model.blocks:
        block.compile()


def row(label: str, model_name: str, device, steps: int, warmup: int) -> dict:
    from zeroplug.benchmarking.measure import make_runner, release, sync
    from zeroplug.plugins.workload.models import GPT, get_preset
    cfg = get_preset(model_name, activation_checkpointing=True)

    def build():
        torch.manual_seed(0)
        return GPT(cfg)

    def batch(dev):
        x = torch.randint(0, cfg.vocab_size, (MICRO_BATCH, SEQ + 1), device=dev)
        return x[:, :-1], x[:, 1:]

    torch._dynamo.reset()
    release(device)
    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    zero = {"plugin": "stage3"}
    if "Block leaf" in label:       # each block one unit (FSDP2's per-block fully_shard): one graph
        zero["stage3_leaf_modules"] = ["Block"]
    config = "fsdp2" if label.startswith("fsdp2") else zeroplug_config({"zero": zero})
    runner = make_runner(build, batch, config, device)
    model = runner.model if label.startswith("fsdp2") else runner.engine.module
    if "per block" in label:
        compile_blocks(model)
    elif "whole" in label:
        runner.engine.module = torch.compile(model)
    times, first = [], None
    for i in range(warmup + steps):
        b = runner.batches()
        t0 = time.perf_counter()
        loss = runner.step(b)
        sync(device)
        if i == 0:
            first = time.perf_counter() - t0
        if i >= warmup:
            times.append(time.perf_counter() - t0)
    runner.close()
    del runner
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) if cuda else 0], device=device)
    if world()[1] > 1:
        import torch.distributed as dist
        dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    release(device)
    med = statistics.median(times)
    return {"label": label, "tokens_per_s": MICRO_BATCH * SEQ / med, "step_s": med, "min_s": min(times),
            "max_s": max(times), "first_s": first, "peak_gib": peak.item() / GiB, "loss": loss}


def run_table(args, device) -> None:
    rank, size = world()
    keys = [k.strip() for k in args.rows.split(",")] if args.rows else list(ROWS)
    unknown = [k for k in keys if k not in ROWS]
    if unknown:
        raise SystemExit(f"error: --rows {','.join(unknown)}: the rows are {', '.join(ROWS)}")
    rows = [ROWS[k] for k in keys]
    if rank == 0:
        name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
        print(f"# {args.model}, {size} rank(s) ({name}), torch {torch.__version__}, "
              f"micro batch {MICRO_BATCH}, seq {SEQ}, {args.steps} steps after {args.warmup} warm-up", flush=True)
        fast = hasattr(getattr(torch._C, "_dynamo", None) and torch._C._dynamo.eval_frame, "get_eval_frame_callback")
        print(f"# stage-3 hooks in eager mode: {'called directly' if fast else 'through torch._dynamo.disable'}",
              flush=True)
    out = []
    for label in rows:
        r = row(label, args.model, device, args.steps, args.warmup)
        out.append(r)
        if rank == 0:
            print(f"{label:<46} {r['tokens_per_s'] / 1e3:8.1f}k tok/s/GPU  step {r['step_s'] * 1e3:7.1f} ms "
                  f"(min {r['min_s'] * 1e3:.1f}, max {r['max_s'] * 1e3:.1f})  first {r['first_s']:.1f} s  "
                  f"peak {r['peak_gib']:6.2f} GiB  loss {r['loss']:.4f}", flush=True)
    if rank == 0:
        by = {r["label"]: r["tokens_per_s"] for r in out}
        for a, b in (("zeroplug stage3 compiled per block", "zeroplug stage3"),
                     ("zeroplug stage3 Block leaf compiled per block", "zeroplug stage3 Block leaf"),
                     ("zeroplug stage3 Block leaf compiled per block", "fsdp2 compiled per block"),
                     ("fsdp2 compiled per block", "fsdp2"),
                     ("zeroplug stage3 compiled per block", "fsdp2 compiled per block"),
                     ("zeroplug stage3", "fsdp2")):
            if a in by and b in by:
                print(f"  {a} / {b}: {by[a] / by[b]:.3f}x", flush=True)


# -- the mixture-of-experts check ----------------------------------------------------------

D, HIDDEN, LAYERS, MOE_SEQ, MOE_BATCH, MOE_STEPS = 64, 96, 2, 16, 4, 6


class Expert(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.up = torch.nn.Linear(D, HIDDEN)
        self.down = torch.nn.Linear(HIDDEN, D)

    def forward(self, h):
        return self.down(F.gelu(self.up(h)))


class MoE(torch.nn.Module):
    def __init__(self, experts):
        super().__init__()
        self.gate = torch.nn.Linear(D, experts)
        self.experts = torch.nn.ModuleList(Expert() for _ in range(experts))

    def forward(self, h, route):
        flat, r = h.reshape(-1, D), route.reshape(-1)
        g = torch.sigmoid(self.gate(flat)).gather(1, r[:, None])
        out = torch.zeros_like(flat)
        for i, expert in enumerate(self.experts):
            mask = r == i
            if mask.any():
                out[mask] = g[mask] * expert(flat[mask])
        return out.view_as(h)


class MoENet(torch.nn.Module):
    def __init__(self, vocab, experts):
        super().__init__()
        self.vocab, self.n_experts = vocab, experts
        self.emb = torch.nn.Embedding(vocab, D)
        self.moe = torch.nn.ModuleList(MoE(experts) for _ in range(LAYERS))
        self.head = torch.nn.Linear(D, vocab, bias=False)

    def forward(self, x, y):
        h = self.emb(x)
        route = x * self.n_experts // self.vocab
        for m in self.moe:
            h = h + m(h, route)
        return F.cross_entropy(self.head(h).float().view(-1, self.vocab), y.view(-1))


def run_moe(args, device) -> int:
    import zeroplug
    rank, size = world()
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    experts, vocab = 2 * size, 32 * size
    g = torch.Generator().manual_seed(7)
    data = []       # per step, every rank's (x, y): rank r's tokens route to experts 2r, 2r + 1
    for _ in range(MOE_STEPS):
        data.append([(torch.randint(0, 32, (MOE_BATCH, MOE_SEQ), generator=g) + 32 * r,
                      torch.randint(0, vocab, (MOE_BATCH, MOE_SEQ), generator=g)) for r in range(size)])
    torch.manual_seed(0)
    ref = MoENet(vocab, experts).to(device)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-2, weight_decay=0.01)
    ref_losses = []
    for per in data:
        loss = ref(torch.cat([x for x, _ in per]).to(device), torch.cat([y for _, y in per]).to(device))
        loss.backward()
        opt.step()
        opt.zero_grad()
        ref_losses.append(loss.item())
    ref_state = {k: v.detach().float().cpu() for k, v in ref.state_dict().items()}
    ok = True
    for stage in (2, 3):
        cfg = {"zero": {"plugin": f"stage{stage}", "stage3_param_persistence_threshold": 0}, "precision": {"plugin": "fp32"},
               "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
               "batch": {"micro_batch_size": MOE_BATCH, "gradient_clipping": 0.0, "steps_per_print": 10 ** 9},
               "scheduler": {"plugin": "none"}, "monitor": {"plugin": "none"}}
        if stage == 2:
            cfg["zero"].pop("stage3_param_persistence_threshold")
        torch.manual_seed(0)
        engine = zeroplug.initialize(MoENet(vocab, experts), cfg, device=device)
        t0 = time.perf_counter()
        losses = []
        for per in data:
            x, y = per[rank]
            loss = engine(x.to(device), y.to(device))
            engine.backward(loss)
            engine.step()
            t = loss.detach().clone()
            engine.run.comm.all_reduce(t)
            losses.append(t.item() / size)
        took = time.perf_counter() - t0
        state = engine.consolidated_state_dict()
        engine.close()
        if rank == 0:
            dl = max(abs(a - b) / abs(b) for a, b in zip(losses, ref_losses))
            dp = max((state[k].float() - v).abs().max().item() for k, v in ref_state.items())
            good = dl <= 1e-4 and dp <= 1e-4
            ok = ok and good
            print(f"moe stage {stage}, {size} ranks, {experts} experts (2 per rank, disjoint): {MOE_STEPS} steps in "
                  f"{took:.1f} s; worst loss rel diff {dl:.2e}, worst param abs diff {dp:.2e} vs torch AdamW "
                  f"(tolerance 1e-4): {'PASS' if good else 'FAIL'}", flush=True)
    return 0 if ok else 1


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", choices=["table", "moe"])
    ap.add_argument("--model", default="1.3B")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rows", default=None, help="rows to run, comma-separated: " + ", ".join(ROWS) + " (default all)")
    args = ap.parse_args()
    device = setup_distributed()
    if device.type != "cuda" and world()[1] > 1:      # a CPU smoke run of the code paths
        import torch.distributed as dist
        dist.init_process_group("gloo")
    if args.what == "moe":
        return run_moe(args, device)
    run_table(args, device)
    return 0


if __name__ == "__main__":
    sys.exit(main())
