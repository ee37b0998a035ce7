"""The largest model that trains on one machine with parameters and optimizer offloaded to
the host: zeroplug beside DeepSpeed, in one call.

    python3 -m tests.benchmarks.largest_model                      # 5.3B .. 13B; every engine
    python3 -m tests.benchmarks.largest_model --budget-s 540 --engines zeroplug-int8,deepspeed-bf16
    python3 -m tests.benchmarks.largest_model --models char-tiny --seq 64 --micro 2   # CPU smoke run
    python3 -m tests.benchmarks.largest_model --gpus 4 --models 52B,43B,35B,28B,22B,13B   # a 4-GPU host
    python3 -m tests.benchmarks.largest_model --gpus 4 --offload nvme --nvme-path /root/zp_nvme

Each engine searches the presets (``--models``, ``zeroplug.plugins.workload.models.PRESETS``)
from the largest that its host-bytes estimate says fits (``--host-gib``, default what the
machine has available) downwards: every candidate is a fresh subprocess that builds the
model (stage 3 builds it partitioned: ``zeroplug.init`` or ``deepspeed.zero.Init``) and
trains ``--steps`` steps (the first ``--warmup`` untimed) of the reference workload
(shared/WORKLOAD.md: micro batch 8, sequence 1,024, bf16, AdamW lr 1e-4, clipping 1.0,
activation checkpointing on every block, random tokens). The first candidate that trains
is the engine's largest, and the search then tries the larger ones until one does not
train (``--no-probe-up``: it stops there); one that runs out of GPU memory (OOM), is
killed by the kernel (host OOM: SIGKILL), fails or passes its time limit sends the search
one size down.
``--budget-s`` bounds the whole run: the engines run in ``--engines`` order, each candidate
at most ``--timeout-s`` and never into the ``--reserve-s`` kept for each engine still to
come; what is known when it ends is printed.

Engines (``--engines``, in the order they run):

* ``zeroplug-int8`` / ``zeroplug-bf16`` / ``zeroplug-fp32``: stage 3, ``offload.param`` and
  ``offload.optimizer`` "cpu", optimizer "auto" (cpu_adam) with ``state_dtype`` int8 / bf16 /
  fp32, ``zero.stage3_params_from_masters`` (no bf16 parameter copy on the host);
* ``zeroplug-fp32-param-tier``: the same with fp32 states and bf16 shards in the param tier
  (what zeroplug held before stage3_params_from_masters);
* ``deepspeed``: DeepSpeed (when installed; else "not installed") from
  deepspeed_configs/zero3_offload_largest.json: offload_param and offload_optimizer cpu,
  pin_memory, fp32 master weights and states;
* ``deepspeed-bf16``: the same JSON plus DeepSpeed's smallest states (zero3_offload_bf16.json:
  ``bf16_master_weights_and_grads`` and ``bf16_optimizer_states``: master weights, gradients and
  Adam's moments in bf16 on the host; not exact, unlike zeroplug's fp32 masters).

``--gpus N`` runs each candidate under ``torchrun --standalone --nproc-per-node N`` (stage 3
shards the model over the N ranks; tokens/s per GPU is rank 0's; the host RSS is the sum over
the candidate's processes). ``--offload nvme`` puts both tiers on NVMe at ``--nvme-path``
instead (zeroplug: ``offload.optimizer`` and ``offload.param`` "nvme", the bf16 shards in the
param tier, as the masters are on disk; DeepSpeed: both ``offload_*.device`` "nvme" with its
``aio`` section), and the search also checks the estimate of the bytes on disk against the free
space there.

Per candidate: tokens/s (median step after the warm-up), peak host RSS (the parent samples
the child's RSS every 0.2 s, so a child the kernel kills still has a peak), peak GPU memory
(``torch.cuda.max_memory_allocated``), the build and initialize times, and the outcome. A
markdown table goes to stdout; the raw results to ``$OUT/largest_model.json`` when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path

import torch

from tests.benchmarks.memory_floor import OOM_EXIT, deepspeed_installed, zeroplug_config
from tests.benchmarks.probes import probe_env, rss_gib, run_watched

GiB = 1024 ** 3
DS_CONFIGS = Path(__file__).parent / "deepspeed_configs"
DEFAULT_MODELS = "13B,11.9B,10.7B,9.5B,8.6B,7.7B,6.7B,5.3B"
#: host memory of the process beside the states: torch and CUDA, staging, allocator slack
#: (docs/benchmarks.md, "The largest model": the peaks measured above the states)
FIXED_HOST_GIB = 3.0


def _zeroplug(state_dtype: str, from_masters: bool = True) -> dict:
    return {"kind": "zeroplug", "state_dtype": state_dtype, "from_masters": from_masters}


ENGINES = {
    "zeroplug-int8": _zeroplug("int8"),
    "zeroplug-bf16": _zeroplug("bf16"),
    "zeroplug-fp32": _zeroplug("fp32"),
    "zeroplug-fp32-param-tier": _zeroplug("fp32", from_masters=False),
    "deepspeed": {"kind": "deepspeed", "json": "zero3_offload_largest.json"},
    "deepspeed-bf16": {"kind": "deepspeed", "json": "zero3_offload_bf16.json"},
}
DEFAULT_ENGINES = "zeroplug-int8,deepspeed-bf16,zeroplug-fp32,deepspeed"


def host_bytes_per_param(engine: str, ranks: int = 1, offload: str = "cpu") -> float:
    """Host bytes per parameter the engine holds with both tiers offloaded, all ranks together.

    zeroplug: fp32 master 4 + gradient (bf16 2, exact with one rank; fp32 4 with several) +
    Adam's moments (8 fp32, 4 bf16, 2 + 8/256 int8) + 2 for a bf16 parameter copy in the param
    tier unless the gathers read the masters. DeepSpeed: bf16 parameters 2 + fp32 master 4 +
    fp32 gradient 4 + fp32 moments 8; with bf16 master weights, gradients and states 2 + 2 + 2
    + 4. ``offload="nvme"``: only the gradients stay in host memory (and swap buffers, counted
    per rank in :func:`predicted_host_gib`); the rest is on disk (:func:`disk_bytes_per_param`)."""
    spec = ENGINES[engine]
    if spec["kind"] == "deepspeed":
        bf16 = "bf16" in spec["json"]
        if offload == "nvme":
            return 2.0 if bf16 else 4.0
        return 10.0 if bf16 else 18.0
    from zeroplug.quantized_states import state_bytes
    grad = 2 if ranks == 1 else 4
    if offload == "nvme":
        return grad
    return 4 + grad + state_bytes(spec["state_dtype"]) + (0 if spec["from_masters"] else 2)


def disk_bytes_per_param(engine: str, offload: str = "cpu") -> float:
    """Bytes per parameter in the swap files with ``offload="nvme"`` (0 with "cpu"): the fp32
    master and Adam's moments, and the bf16 parameter shards."""
    if offload != "nvme":
        return 0.0
    spec = ENGINES[engine]
    if spec["kind"] == "deepspeed":
        return 2 + 2 + 4 if "bf16" in spec["json"] else 2 + 4 + 8
    from zeroplug.quantized_states import state_bytes
    return 2 + 4 + state_bytes(spec["state_dtype"])


#: host memory per rank for the swap buffers with ``offload="nvme"`` (both tiers' pinned buffers)
NVME_BUFFERS_GIB = 6.0


def predicted_host_gib(engine: str, model: str, ranks: int = 1, offload: str = "cpu") -> float:
    from zeroplug.plugins.workload.models import get_preset, param_count
    per_rank = FIXED_HOST_GIB + (NVME_BUFFERS_GIB if offload == "nvme" else 0.0)
    return param_count(get_preset(model)) * host_bytes_per_param(engine, ranks, offload) / GiB + ranks * per_rank


def predicted_disk_gib(engine: str, model: str, offload: str = "cpu") -> float:
    from zeroplug.plugins.workload.models import get_preset, param_count
    return param_count(get_preset(model)) * disk_bytes_per_param(engine, offload) / GiB


def host_available_gib() -> float:
    from zeroplug.observe.memory import host_available_bytes
    return host_available_bytes() / GiB


# -- one candidate, in its own process -------------------------------------------------------
def swap_buffer_elements(mcfg, ranks: int) -> int:
    """Elements the largest unit's shard (zeroplug) or parameter (DeepSpeed) can have: the
    swap buffers of ``offload_param`` must hold one."""
    d = mcfg.d_model
    root = 2 * mcfg.vocab_size * d + mcfg.seq_len * d + 2 * d     # embeddings, final norm, head
    block = 12 * d * d + 13 * d
    return max(root, block) // ranks + (1 << 20)


def zeroplug_cfg(spec: dict, micro: int, offload: str = "cpu", nvme_path: str = "", mcfg=None,
                 ranks: int = 1) -> dict:
    if offload == "nvme":
        tier = {"plugin": "nvme", "nvme_path": nvme_path}
        tiers = {"optimizer": dict(tier), "param": dict(tier, buffer_size=swap_buffer_elements(mcfg, ranks))}
        from_masters = False        # the masters are on disk: the gathers read the param tier
    else:
        tiers = {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}}
        from_masters = spec["from_masters"]
    cfg = zeroplug_config({
        "zero": {"plugin": "stage3", "stage3_params_from_masters": from_masters},
        "optimizer": {"plugin": "auto", "lr": 1e-4, "state_dtype": spec["state_dtype"]},
        "offload": tiers})
    cfg["batch"]["micro_batch_size"] = micro
    return cfg


def deepspeed_cfg(spec: dict, micro: int, offload: str = "cpu", nvme_path: str = "", mcfg=None) -> dict:
    cfg = json.loads((DS_CONFIGS / spec["json"]).read_text())
    cfg["train_micro_batch_size_per_gpu"] = micro
    if offload == "nvme":
        zo = cfg["zero_optimization"]
        zo["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True,
                                   "buffer_count": 4, "fast_init": False}
        d = mcfg.d_model
        zo["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "pin_memory": True, "buffer_count": 5,
                               "buffer_size": max(mcfg.vocab_size * d, 4 * d * d) + (1 << 20),
                               "max_in_cpu": int(1e9)}
        cfg["aio"] = {"block_size": 1048576, "queue_depth": 8, "thread_count": 1, "single_submit": False,
                      "overlap_events": True}
    return cfg


def probe(args) -> int:
    """Build and train one candidate; print ``PROBE {json}``; exit OOM_EXIT on GPU OOM."""
    from zeroplug.benchmarking.measure import make_runner, peak_host_bytes, sync
    from zeroplug.errors import HostMemoryError
    from zeroplug.plugins.workload.models import GPT, get_preset, param_count
    spec = ENGINES[args.engine]
    rank, ranks = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    mcfg = get_preset(args.model, activation_checkpointing=True)
    out: dict = {"model": args.model, "engine": args.engine, "params": param_count(mcfg), "ranks": ranks,
                 "offload": args.offload,
                 "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if spec["kind"] == "deepspeed":
        if not deepspeed_installed():
            out["error"] = "not installed"
            print("PROBE " + json.dumps(out), flush=True)
            return 0
        config = "deepspeed:" + str(_write_ds_json(deepspeed_cfg(spec, args.micro, args.offload, args.nvme_path, mcfg),
                                                   spec["json"], rank))
    else:
        config = zeroplug_cfg(spec, args.micro, args.offload, args.nvme_path, mcfg, ranks)
    where = args.build_on if device.type == "cuda" else "cpu"
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    def build():
        # Note: each module's constructor initialises its parameters on the GPU (a second per
        # billion) instead of the CPU; zeroplug.init / zero.Init keep only the shards.
        torch.manual_seed(0)
        if where == "device" and spec["kind"] == "zeroplug":
            with torch.device(device):
                return GPT(mcfg)
        return GPT(mcfg)

    def batch(dev):
        x = torch.randint(0, mcfg.vocab_size, (args.micro, args.seq + 1), device=dev)
        return x[:, :-1], x[:, 1:]

    t0 = time.perf_counter()
    runner = None
    try:
        runner = make_runner(build, batch, config, device)
        out["init_s"] = round(time.perf_counter() - t0, 1)   # build + initialize
        out["rss_after_init_gib"] = rss_gib()
        times = []
        for i in range(args.steps):
            b = runner.batches()
            t = time.perf_counter()
            loss = runner.step(b)
            sync(device)
            if i >= args.warmup:
                times.append(time.perf_counter() - t)
        step = statistics.median(times) if times else float("nan")
        out.update(step_s=round(step, 3), tokens_per_s=args.micro * args.seq / step, loss=loss,
                   step_times=[round(t, 3) for t in times])
    except torch.OutOfMemoryError as exc:
        out["error"] = "GPU OOM: " + str(exc).splitlines()[0][:160]
    except HostMemoryError as exc:      # zeroplug's budget check, before anything is allocated
        out["error"] = "host memory (refused by initialize): " + str(exc)[:240]
    finally:
        if device.type == "cuda":
            out["peak_gpu_gib"] = torch.cuda.max_memory_allocated(device) / GiB
        out["peak_host_rss_gib"] = peak_host_bytes() / GiB
        if rank == 0:
            print("PROBE " + json.dumps(out, default=str), flush=True)
        if runner is not None:
            runner.close()
    return OOM_EXIT if "error" in out else 0


def _write_ds_json(cfg: dict, name: str, rank: int) -> Path:
    import tempfile
    path = Path(tempfile.mkdtemp(prefix=f"largest_model_{rank}_")) / name
    path.write_text(json.dumps(cfg))
    return path


def _tree(pid: int) -> list[int]:
    """``pid`` and every process below it (torchrun's ranks)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return out


def _tree_rss_gib(pid: int) -> float:
    return sum(rss_gib(p) for p in _tree(pid))


def run_candidate(model: str, engine: str, args, timeout: float) -> dict:
    """A fresh process for one candidate; its outcome, peak RSS sampled from here."""
    launch = [sys.executable] if args.gpus <= 1 else [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.gpus}"]
    cmd = launch + [os.path.abspath(__file__), "probe", "--model", model, "--engine", engine,
                    "--steps", str(args.steps), "--warmup", str(args.warmup), "--seq", str(args.seq),
                    "--micro", str(args.micro), "--build-on", args.build_on, "--offload", args.offload,
                    "--nvme-path", args.nvme_path]
    w = run_watched(cmd, probe_env(), timeout, memory=_tree_rss_gib)
    res = {"model": model, "engine": engine, "wall_s": w.wall_s, "rc": w.rc,
           "sampled_peak_rss_gib": round(w.peak_gib, 2), **w.record}
    if w.timed_out:
        res["outcome"] = f"timeout ({timeout:.0f} s)"
    elif res.get("error") == "not installed":
        res["outcome"] = "not installed"
    elif w.rc in (-signal.SIGKILL, 137, 247) or (args.gpus > 1 and "SIGKILL" in w.err):
        # torchrun exits 1 when the kernel kills a rank, and names the signal
        res["outcome"] = "host OOM (killed)"
    elif "error" in res:
        res["outcome"] = res["error"]
    elif w.rc != 0 or "tokens_per_s" not in res:
        tail = [ln for ln in w.err.splitlines() if ln.strip()]
        res["outcome"] = "failed: " + (tail[-1][:200] if tail else f"exit {w.rc}")
    else:
        res["outcome"] = "trains"
    return res


def search(args) -> dict:
    """Per engine: down from the largest preset predicted to fit until one trains, then up
    from there until one does not (the estimate may be wrong either way), within the budget."""
    deadline = time.time() + args.budget_s
    from zeroplug.plugins.workload.models import get_preset, param_count
    models = sorted(args.models.split(","), key=lambda m: param_count(get_preset(m)))     # smallest first
    engines = args.engines.split(",")
    host = args.host_gib or host_available_gib()
    disk = float("inf")
    if args.offload == "nvme":
        os.makedirs(args.nvme_path, exist_ok=True)
        disk = shutil.disk_usage(args.nvme_path).free / GiB
    found: dict = {}
    for i, engine in enumerate(engines):
        tried: list = []
        found[engine] = {"largest": None, "tried": tried,
                         "bytes_per_param": host_bytes_per_param(engine, args.gpus, args.offload)}
        if ENGINES[engine]["kind"] == "deepspeed" and not deepspeed_installed():
            found[engine]["note"] = "not installed"
            print(f"{engine}: not installed", flush=True)
            continue
        fits = [k for k, m in enumerate(models) if predicted_host_gib(engine, m, args.gpus, args.offload) <= host
                and predicted_disk_gib(engine, m, args.offload) <= disk]
        start = fits[-1] if fits else 0
        if start + 1 < len(models):
            room = f"{host:.0f} GiB" + (f" and {disk:.0f} GiB of disk" if args.offload == "nvme" else "")
            tried.append({"note": f"predicted not to fit {room}: {', '.join(models[start + 1:])}"})

        def attempt(k: int) -> bool | None:
            """True: trains; False: does not; None: no time left for it."""
            # what is left, less what the engines after this one are promised
            limit = min(args.timeout_s, deadline - time.time() - args.reserve_s * (len(engines) - 1 - i))
            if limit < 15:
                tried.append({"note": "budget spent"})
                return None
            model = models[k]
            r = run_candidate(model, engine, args, limit)
            r["predicted_host_gib"] = round(predicted_host_gib(engine, model, args.gpus, args.offload), 1)
            tried.append(r)
            print(f"  {engine:<24} {model:>9}: {r['outcome']}  ({r.get('tokens_per_s', 0):,.0f} tokens/s, host peak "
                  f"{r['sampled_peak_rss_gib']:.1f} GiB (predicted {r['predicted_host_gib']:.1f}), GPU peak "
                  f"{r.get('peak_gpu_gib', 0):.1f} GiB, {r['wall_s']} s)", flush=True)
            return r["outcome"] == "trains"

        best = None
        for k in range(start, -1, -1):
            ok = attempt(k)
            if ok is None:
                break
            if ok:
                best = k
                break
        if best is not None and args.probe_up:
            failed = {t["model"] for t in tried if "model" in t and t["outcome"] != "trains"}
            for k in range(best + 1, len(models)):
                if models[k] in failed:     # tried on the way down: known not to train
                    break
                ok = attempt(k)
                if not ok:
                    break
                best = k
        found[engine]["largest"] = models[best] if best is not None else None
    return {"host_gib": host, "engines": found}


def table(result: dict) -> str:
    rows = ["| engine | host bytes / param (est.) | largest that trains | tokens/s | peak host RSS GiB | "
            "peak GPU GiB | build + initialize s | tried (outcome) |",
            "| --- | ---: | --- | ---: | ---: | ---: | ---: | --- |"]
    for engine, f in result["engines"].items():
        ok = next((t for t in f["tried"] if t.get("outcome") == "trains" and t.get("model") == f["largest"]), {})
        tried = "; ".join(f"{t['model']}: {t['outcome']}" if "model" in t else t["note"] for t in f["tried"])
        rows.append(f"| {engine} | {f['bytes_per_param']:.2f} | {f['largest'] or f.get('note', 'none')} | "
                    f"{ok.get('tokens_per_s', 0):,.0f} | {ok.get('sampled_peak_rss_gib', 0):.1f} | "
                    f"{ok.get('peak_gpu_gib', 0):.1f} | {ok.get('init_s', 0):.0f} | {tried or '-'} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("what", nargs="?", default="search", choices=["search", "probe"])
    ap.add_argument("--models", default=DEFAULT_MODELS, help="presets to search (any order)")
    ap.add_argument("--engines", default=DEFAULT_ENGINES, help="comma-separated: " + ", ".join(ENGINES))
    ap.add_argument("--model", help="probe: the preset")
    ap.add_argument("--engine", help="probe: the engine")
    ap.add_argument("--steps", type=int, default=3, help="steps per candidate, warm-up included")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--build-on", choices=["device", "cpu"], default="device",
                    help="where zeroplug's module constructors initialise the parameters (CUDA runs)")
    ap.add_argument("--budget-s", type=float, default=540.0, help="seconds for the whole search")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="seconds per candidate at most")
    ap.add_argument("--reserve-s", type=float, default=150.0,
                    help="seconds of the budget kept for each engine after the one running (engines run in "
                         "--engines order, so the first ones may use the rest)")
    ap.add_argument("--host-gib", type=float, default=0.0, help="host memory to plan for (0: available now)")
    ap.add_argument("--gpus", type=int, default=1, help="ranks per candidate (torchrun on one host when > 1)")
    ap.add_argument("--offload", choices=["cpu", "nvme"], default="cpu",
                    help="where both tiers offload: host memory, or swap files at --nvme-path")
    ap.add_argument("--nvme-path", default="/root/zeroplug_nvme", help="--offload nvme: a directory on the disk")
    ap.add_argument("--no-probe-up", dest="probe_up", action="store_false",
                    help="stop at the first preset that trains (default: then try the larger ones until one fails)")
    args = ap.parse_args(argv)
    unknown = [e for e in args.engines.split(",") if e not in ENGINES]
    if args.what == "search" and unknown:
        print(f"error: --engines {','.join(unknown)}: unknown; choose from {', '.join(ENGINES)}", file=sys.stderr)
        return 2
    if args.what == "probe":
        return probe(args)
    # Note: the parent never creates a CUDA context (host memory the candidates need); the
    # children name the GPU
    gpu = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "cpu"
    if args.gpus > 1:
        gpu = f"{args.gpus} ranks, {gpu}"
    where = "the host" if args.offload == "cpu" else f"NVMe ({args.nvme_path})"
    print(f"largest model with parameters and optimizer offloaded to {where}: {gpu}, {os.cpu_count()} cores, "
          f"torch {torch.__version__}, micro batch {args.micro} x {args.seq}, budget {args.budget_s:.0f} s", flush=True)
    result = search(args)
    names = {t["gpu"] for f in result["engines"].values() for t in f["tried"] if t.get("gpu")}
    result.update(argv=sys.argv[1:] if argv is None else argv, gpu=", ".join(sorted(names)) or gpu)
    print(f"\n{result['gpu']}, host memory planned for: {result['host_gib']:.1f} GiB")
    print()
    print(table(result), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "largest_model.json").write_text(json.dumps(result, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
