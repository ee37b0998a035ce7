"""Muon against AdamW at stage 3, on the GPU and with the optimizer states offloaded to the
CPU, beside DeepSpeed's Muon where DeepSpeed is importable (shared/WORKLOAD.md's 1.3B model:
micro batch 8, sequence 1,024, bf16, activation checkpointing, clipping 1.0, random tokens).

  python3 tests/benchmarks/muon_speed.py                 # the H100 table (one call, ~15 min)
  python3 tests/benchmarks/muon_speed.py --smoke         # a tiny model on the CPU, 3 steps per row

Each row runs in a fresh process, one after the other; a row prints the median step time after
two warm-up steps (min and max beside it), its ratio to the AdamW row of the same kind
(stage 3 / stage 3 + CPU offload; DeepSpeed's rows: to DeepSpeed's AdamW), and the optimizer
states' bytes per trainable parameter as held after the last step (every rank's share).
DeepSpeed's Muon splits the parameters by its own rule (2-D and no "embed" / "lm_head" in the
name), which on this model's names (``tok_emb``, ``head``) would put the embeddings and the head
on Muon: the rows here tag its parameters with zeroplug's split, so both run the same maths.
``--json PATH`` keeps the rows.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

ROWS = {
    "adamw-s3": ("zeroplug", "adamw", False),
    "muon-s3": ("zeroplug", "muon", False),
    "adamw-s3-cpu": ("zeroplug", "adamw", True),
    "muon-s3-cpu": ("zeroplug", "muon", True),
    "ds-adamw-s3": ("deepspeed", "adamw", False),
    "ds-muon-s3": ("deepspeed", "muon", False),
}
BASELINE = {"muon-s3": "adamw-s3", "muon-s3-cpu": "adamw-s3-cpu", "ds-muon-s3": "ds-adamw-s3"}
TARGET = {"muon-s3": 1.10, "muon-s3-cpu": 1.20}


def state_bytes(optimizer) -> int:
    """Bytes of the optimizer's state tensors (DeepSpeed's: the torch optimizer inside its wrapper)."""
    import torch
    seen, total = set(), 0
    while optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
        optimizer = getattr(optimizer, "optimizer", None)
    for st in (optimizer.state.values() if optimizer is not None else ()):
        for v in st.values():
            if torch.is_tensor(v) and v.dim() > 0 and v.untyped_storage()._cdata not in seen:
                seen.add(v.untyped_storage()._cdata)
                total += v.numel() * v.element_size()
    return total


def run_row(name: str, args) -> dict:
    import torch
    from zeroplug.plugins.optim.muon import split
    from zeroplug.param_groups import param_groups
    from zeroplug.plugins.workload.models import GPT, GPTConfig, get_preset
    engine_kind, opt, offload = ROWS[name]
    cuda = torch.cuda.is_available() and not args.smoke
    dev = torch.device("cuda", 0) if cuda else torch.device("cpu")
    mcfg = (GPTConfig(512, 64, 2, 64, 4) if args.smoke else get_preset(args.model)).with_(
        activation_checkpointing=True)
    seq, mb = (64, 2) if args.smoke else (args.seq, args.micro_batch)
    torch.manual_seed(0)
    if engine_kind == "zeroplug":
        import zeroplug
        optimizer = {"plugin": opt, "lr": 1e-4}
        if opt == "muon":
            optimizer.update(muon_lr=0.02, adam_lr=1e-4)
        cfg = {"batch": {"micro_batch_size": mb, "gradient_clipping": 1.0, "steps_per_print": 10_000},
               "zero": {"plugin": "stage3"}, "precision": {"plugin": "bf16" if cuda else "fp32"},
               "optimizer": optimizer, "monitor": {"plugin": "none"}}
        if offload:
            cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
            if opt == "adamw":
                cfg["optimizer"]["plugin"] = "auto"        # cpu_adam, as a DeepSpeed JSON gets it
        with zeroplug.init(cfg, device=dev):
            model = GPT(mcfg)
        engine = zeroplug.initialize(model, cfg, device=dev)
        step_fn = None
        inner = engine.optimizer
    else:
        import deepspeed
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29533")
        os.environ.setdefault("RANK", "0")
        os.environ.setdefault("LOCAL_RANK", "0")
        os.environ.setdefault("WORLD_SIZE", "1")
        model = GPT(mcfg)
        if opt == "muon":
            _, which = split(model, param_groups(model))
            original = deepspeed.set_optimizer_flags

            def tagged(config_class, module):      # DeepSpeed's own tagging, then zeroplug's split
                original(config_class, module)
                for n, p in module.named_parameters():
                    p.use_muon = which.get(n, False)
            deepspeed.set_optimizer_flags = tagged
            ds_opt = {"type": "Muon", "params": {"lr": 1e-4, "muon_lr": 0.02, "adam_lr": 1e-4}}
        else:
            ds_opt = {"type": "AdamW", "params": {"lr": 1e-4}}
        ds_cfg = {"train_micro_batch_size_per_gpu": mb, "gradient_clipping": 1.0, "bf16": {"enabled": cuda},
                  "zero_optimization": {"stage": 3}, "optimizer": ds_opt, "steps_per_print": 10_000}
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
        step_fn = engine
        inner = engine.optimizer
    g = torch.Generator().manual_seed(1234)
    times = []
    for _ in range(args.steps):
        x = torch.randint(0, mcfg.vocab_size, (mb, seq + 1), generator=g).to(dev)
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = (engine if step_fn is None else step_fn)(x[:, :-1], x[:, 1:])
        engine.backward(loss)
        engine.step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    params = sum(p.numel() for p in model.parameters())
    steady = times[2:] or times
    row = {"row": name, "step_s": statistics.median(steady), "min_s": min(steady), "max_s": max(steady),
           "state_bytes_per_param": state_bytes(inner) / params, "params": params,
           "peak_gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else 0.0,
           "loss": float(loss.float().item())}
    return row


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--smoke", action="store_true", help="a tiny model on the CPU, 3 steps per row")
    p.add_argument("--model", default="1.3B")
    p.add_argument("--steps", type=int, default=None, help="per row (default 12; --smoke: 3)")
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--rows", nargs="*", default=list(ROWS))
    p.add_argument("--one", help=argparse.SUPPRESS)      # run one row in this process (the children)
    p.add_argument("--json")
    args = p.parse_args()
    args.steps = args.steps or (3 if args.smoke else 12)
    if args.one:
        print("ROW " + json.dumps(run_row(args.one, args)), flush=True)
        return
    rows = {}
    for name in args.rows:
        if ROWS[name][0] == "deepspeed":
            try:
                import deepspeed  # noqa: F401
            except Exception as exc:        # noqa: BLE001 (any import failure: the row is left out)
                print(f"{name}: DeepSpeed is not importable here ({type(exc).__name__}); row left out", flush=True)
                continue
        cmd = [sys.executable, __file__, "--one", name, "--model", args.model, "--steps", str(args.steps),
               "--micro-batch", str(args.micro_batch), "--seq", str(args.seq)] + (["--smoke"] if args.smoke else [])
        out = subprocess.run(cmd, capture_output=True, text=True)
        line = next((ln for ln in out.stdout.splitlines() if ln.startswith("ROW ")), None)
        if line is None:
            print(f"{name}: failed (exit {out.returncode}): {(out.stderr or out.stdout).strip()[-600:]}", flush=True)
            continue
        rows[name] = json.loads(line[4:])
        print(f"{name}: {rows[name]['step_s']:.3f} s", flush=True)
    print()
    print(f"| row | step s (median) | min / max | ratio to AdamW | target | optimizer states B/param | peak GPU GiB |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, r in rows.items():
        base = rows.get(BASELINE.get(name, ""))
        ratio = f"{r['step_s'] / base['step_s']:.3f}" if base else "-"
        target = f"<= {TARGET[name]:.2f}" if name in TARGET else "-"
        print(f"| {name} | {r['step_s']:.3f} | {r['min_s']:.3f} / {r['max_s']:.3f} | {ratio} | {target} | "
              f"{r['state_bytes_per_param']:.2f} | {r['peak_gpu_gib']:.1f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
