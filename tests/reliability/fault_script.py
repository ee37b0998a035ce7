"""The job of the fault matrix (test_fault_matrix.py), run by torchrun on 2 ranks: ToyNet under
ZeRO stage 3 with its parameters sharded per module, 2 micro-steps per step, the optimizer's
states on the nvme tier (an offloaded step of several sub-groups), a checkpoint after every
step; rank 1 (``--fault-rank``) meets fault ``--case`` in step ``--fault-step``, in its second
micro-step.

Cases: none, raise_forward, raise_backward, oom (a real allocation that fails: host memory on
CPU, GPU memory with --device cuda), kill_backward, kill_optimizer (SIGKILL), data_ends (rank
1's data ends a step early), accumulation (the ranks are given different
gradient_accumulation_steps), loader_stall (rank 1 sleeps in its data loader), checkpoint_dirs
(each rank saves into its own ``tempfile.mkdtemp()``), experts (an ``experts`` list on the
model itself, routed to disjoint experts per rank: trains).

Writes ``<root>/fault.json`` (the time the fault is injected) and, on rank 0,
``<root>/losses.json`` (each step's mean loss over the ranks, as the step ends).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import zeroplug  # noqa: E402
from tests.support.toy import ExpertsOnTheModel, ToyNet  # noqa: E402

VOCAB, SEQ, MICRO = 37, 8, 2


def config(args, rank: int) -> dict:
    gas = 1 if args.case == "accumulation" and rank == args.fault_rank else 2
    zero = {"plugin": f"stage{args.stage}", "reduce_bucket_size": 600, "sub_group_size": 900}
    if args.stage == 3:
        zero.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=2000)
    cfg = {"zero": zero, "batch": {"micro_batch_size": MICRO, "gradient_accumulation_steps": gas,
                                   "gradient_clipping": 1.0, "steps_per_print": 10_000},
           "optimizer": {"plugin": "adamw", "lr": 1e-2, "weight_decay": 0.01},
           "monitor": {"plugin": "none"}, "faults": {"timeout": args.timeout}}
    if args.offload == "nvme":
        cfg["offload"] = {"optimizer": {"plugin": "nvme", "nvme_path": str(args.root / "swap"),
                                        "buffer_count": 2, "reuse_resident": False}}
    elif args.offload == "cpu":
        cfg["offload"] = {"optimizer": {"plugin": "cpu"}}
    return cfg


def batch(rank: int, step: int, micro: int, device):
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    if args.case == "experts":          # rank r's tokens route to experts 2r, 2r+1
        x = torch.randint(0, VOCAB // 2, (MICRO, SEQ), generator=g) + rank * (VOCAB // 2 + 1)
        x = x.clamp(max=VOCAB - 1)
    else:
        x = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    y = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return x.to(device), y.to(device)


def mark_fault() -> None:
    (args.root / "fault.json").write_text(json.dumps({"case": args.case, "time": time.time()}))


def main() -> int:
    rank = int(os.environ.get("RANK", "0"))
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0"))) if args.device == "cuda" else \
        torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    torch.manual_seed(0)
    model = ExpertsOnTheModel(VOCAB) if args.case == "experts" else ToyNet()
    engine = zeroplug.initialize(model, config(args, rank), device=device)
    faulty = rank == args.fault_rank
    ck = args.root / "ck"
    start = 0
    if args.resume and (ck / "latest").exists():
        _, client = engine.load_checkpoint(ck)
        start = int(client["step"])
    losses = {}
    loss_file = args.root / "losses.json"
    if rank == 0 and loss_file.exists():
        losses = json.loads(loss_file.read_text())
    at_fault = False

    def forward_fault(module, inputs):
        if not at_fault:
            return
        if args.case == "raise_forward":
            mark_fault()
            raise RuntimeError("injected fault: an exception in rank 1's forward")
        if args.case == "oom":
            mark_fault()
            torch.empty(1 << 50, dtype=torch.uint8, device=device)    # 1 PiB: a real allocation failure

    def backward_fault(grad):
        if not at_fault:
            return grad
        mark_fault()
        if args.case == "raise_backward":
            raise RuntimeError("injected fault: an exception in rank 1's backward hook")
        if args.case == "kill_backward":
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    inner = model.blocks[1] if hasattr(model, "blocks") else model.head
    inner.register_forward_pre_hook(forward_fault)
    if args.case == "kill_optimizer" and faulty:
        real, calls = engine.optimizer.step, []

        def step_then_die(*a, **kw):
            if engine.global_step + 1 == args.fault_step:
                calls.append(1)
                if len(calls) == 2:         # the second sub-group of the offloaded step
                    mark_fault()
                    os.kill(os.getpid(), signal.SIGKILL)
            return real(*a, **kw)
        engine.optimizer.step = step_then_die

    steps = args.steps - 1 if args.case == "data_ends" and faulty else args.steps
    for step in range(start + 1, steps + 1):
        total = torch.zeros((), device=device)
        for micro in range(engine.gradient_accumulation_steps):
            at_fault = faulty and step == args.fault_step and micro == 1
            if at_fault and args.case == "loader_stall":
                mark_fault()
                time.sleep(args.stall)
            x, y = batch(rank, step, micro, device)
            loss = engine(x, y)
            if at_fault and args.case in ("raise_backward", "kill_backward"):
                loss.register_hook(backward_fault)
            engine.backward(loss)
            engine.step()
            total += loss.detach() / engine.gradient_accumulation_steps
        torch.distributed.all_reduce(total)
        save_dir = ck
        if args.case == "checkpoint_dirs" and step == args.fault_step:
            save_dir = Path(tempfile.mkdtemp())         # each rank its own: the ranks disagree
            if faulty:
                mark_fault()
        engine.save_checkpoint(save_dir, client_state={"step": step})
        if rank == 0:
            losses[str(step)] = total.item() / 2
            loss_file.write_text(json.dumps(losses))
    if args.case == "data_ends" and faulty:
        mark_fault()
    return 0


parser = argparse.ArgumentParser()
parser.add_argument("--case", default="none")
parser.add_argument("--root", type=Path, required=True)
parser.add_argument("--steps", type=int, default=4)
parser.add_argument("--fault-step", type=int, default=3)
parser.add_argument("--fault-rank", type=int, default=1)
parser.add_argument("--timeout", type=float, default=10.0)
parser.add_argument("--stall", type=float, default=60.0)
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--offload", default="nvme", choices=["nvme", "cpu", "none"])
parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
parser.add_argument("--resume", action="store_true")
args = parser.parse_args()

if __name__ == "__main__":
    sys.exit(main())
