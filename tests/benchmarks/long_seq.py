"""The longest sequence that trains on one GPU: zeroplug's ``[sequence]`` plugin beside DeepSpeed's
ALST recipe, in one call.

    python3 -m tests.benchmarks.long_seq                               # the three models, both frameworks
    python3 -m tests.benchmarks.long_seq --models llama-1b --seqs 32768,524288      # given lengths only
    python3 -m tests.benchmarks.long_seq --smoke                        # CPU: tiny shapes, the code paths

Models (``--models``): ``gpt-1.3b``, the reference GPT's 1.3B preset (its learned positions grow
with the sequence: ``seq_len`` = the probe's length); ``llama-1b`` and ``llama-8b``, Llama-3.2-1B
and Llama-3.1-8B shapes built from config (transformers; random weights). Micro batch 1, bf16,
AdamW on the host, activation checkpointing on every block, random tokens.

Frameworks (``--frameworks``):

* ``zeroplug``: stage 3 with parameters and optimizer offloaded to the host (cpu_adam; int8 Adam
  states for the 8B shape, whose fp32 states would not leave host memory for activations),
  ``[sequence] plugin = "ulysses"`` (one rank: the MLP and the head's loss in tiles, chunk sizes
  from the memory budget) and ``[activation_checkpointing] plugin = "cpu"`` (the checkpointed
  blocks' inputs in pinned host memory; where the estimate says the host cannot hold them all
  beside the states, as for the 8B shape past about 200K tokens, the first of them stay on the GPU:
  ``device_bytes``);
* ``deepspeed``: DeepSpeed (when ``import deepspeed`` works; else "deepspeed not installed") with
  its ALST recipe for one GPU: ZeRO-3 with parameters and optimizer offloaded to the host (bf16
  master weights and states for the 8B shape, for the same reason), ``TiledMLP`` on the MLP with
  ``ceil(seq / hidden)`` shards, the head's loss through ``TiledFusedLogitsLoss``, activation
  checkpoints offloaded to the host (``get_checkpoint_hidden_states_offloading_ctx_manager`` for
  Hugging Face models, ``deepspeed.checkpointing`` with ``checkpoint_in_cpu`` for the GPT), and
  ``PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`` (both frameworks). A piece its version
  lacks is left out and named in the row's notes.

Search, per model and framework: 32K first (the row's second figures), then doubling from
``--start`` until a length fails, then bisection down to ``--resolution`` of the longest that
trains; ``--seqs`` probes only the lengths given. Every probe is a fresh process (an OOM does
not poison the next) that builds the model, initializes, and trains ``--steps`` steps (the first
untimed) within its time limit; ``--budget-s`` bounds the whole run (what is known when it ends
is printed). The bound of a maximum is how the next length failed: GPU memory (CUDA OOM), host
memory (refused by zeroplug's budget, or the process killed), or the time limit.

tokens/s = tokens / step time (the median after the first step); MFU = tokens/s x (6 x params
+ 12 x layers x d_model x seq) / ``--peak-tflops`` (989: H100 SXM, bf16 dense), model FLOPs
without the recomputation (shared/WORKLOAD.md). A markdown table goes to stdout, the raw
probes to ``$OUT/long_seq.json`` when OUT is set.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import signal
import statistics
import sys
import time
from pathlib import Path

from tests.benchmarks.probes import probe_env, run_watched

GiB = 1024 ** 3
OOM_EXIT = 3

# name -> shape (GPT: a preset; Llama: the config's fields)
MODELS = {
    "gpt-1.3b": {"kind": "gpt", "preset": "1.3B"},
    "llama-1b": {"kind": "llama", "hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                 "tie_word_embeddings": True, "rope_theta": 500000.0},
    "llama-8b": {"kind": "llama", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 128256,
                 "tie_word_embeddings": False, "rope_theta": 500000.0, "int8": True},
    # --smoke: the same code paths at tiny sizes
    "gpt-tiny": {"kind": "gpt", "preset": "char-tiny"},
    "llama-tiny": {"kind": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                   "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256,
                   "tie_word_embeddings": False, "rope_theta": 10000.0, "int8": True},
}
DEFAULT_MODELS = "llama-1b,gpt-1.3b,llama-8b"


# -- one probe, in its own process ------------------------------------------------------------
def shape(name: str, seq: int) -> dict:
    """layers, d_model, parameter count of ``name`` at sequence length ``seq``."""
    m = MODELS[name]
    if m["kind"] == "gpt":
        from zeroplug.plugins.workload.models import get_preset, param_count
        cfg = get_preset(m["preset"], seq_len=seq)
        return {"layers": cfg.n_layer, "d": cfg.d_model, "params": param_count(cfg), "vocab": cfg.vocab_size}
    d, L, f, V = m["hidden_size"], m["num_hidden_layers"], m["intermediate_size"], m["vocab_size"]
    kv = d // m["num_attention_heads"] * m["num_key_value_heads"]
    per_layer = d * d * 2 + 2 * d * kv + 3 * d * f + 2 * d
    params = L * per_layer + V * d * (1 if m["tie_word_embeddings"] else 2) + d
    return {"layers": L, "d": d, "params": params, "vocab": V}


def build(name: str, seq: int, device):
    import torch
    m = MODELS[name]
    torch.manual_seed(0)
    if m["kind"] == "gpt":
        from zeroplug.plugins.workload.models import GPT, get_preset
        with torch.device(device):
            return GPT(get_preset(m["preset"], seq_len=max(seq, 1024), activation_checkpointing=True))
    import transformers as T
    fields = {k: v for k, v in m.items() if k not in ("kind", "int8")}
    cfg = T.LlamaConfig(**fields, max_position_embeddings=max(seq, 8192), attention_dropout=0.0)
    with torch.device(device):
        model = T.LlamaForCausalLM(cfg)
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    return model


def kept_on_device(name: str, seq: int) -> int:
    """Bytes of checkpoints to keep on the GPU (activation_checkpointing.device_bytes): what the
    estimate (zeroplug.tools.sequence) says the host cannot hold beside the states, as far as the
    GPU has room; 0 where the host holds them all."""
    from zeroplug.observe.memory import host_available_bytes
    from zeroplug.tools.sequence import Shape, need
    s, m = shape(name, seq), MODELS[name]
    sh = Shape(s["layers"], s["d"], m.get("intermediate_size", 4 * s["d"]), s["vocab"], None, None)
    full = need(sh, seq, 1, 2, tiled=True, on_host=True, degree=1)
    states = s["params"] * (4 + 2 + (2.04 if m.get("int8") else 8))
    host_room = host_available_bytes() - states - 8 * GiB          # torch, CUDA and pinned slack
    if full.checkpoints <= host_room:
        return 0
    gpu = 76 * GiB
    return int(max(0, min(full.checkpoints, gpu - full.device)) // GiB * GiB)


def zeroplug_config(name: str, device_type: str, smoke: bool = False, seq: int = 0) -> dict:
    int8 = MODELS[name].get("int8", False)
    sequence = {"plugin": "ulysses", "sequence_parallel_size": 1}
    if smoke:       # tiny shapes: chunks small enough to tile
        sequence.update(mlp_chunk_tokens=16, loss_chunk_tokens=16)
    return {"zero": {"plugin": "stage3", "stage3_params_from_masters": True},
            "precision": {"plugin": "bf16" if device_type == "cuda" else "fp32"},
            "optimizer": {"plugin": "auto", "lr": 1e-5, "state_dtype": "int8" if int8 else "fp32"},
            "offload": {"optimizer": {"plugin": "cpu"}, "param": {"plugin": "cpu"}},
            "scheduler": {"plugin": "none"}, "monitor": {"plugin": "none"},
            "batch": {"micro_batch_size": 1, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9},
            "sequence": sequence,
            # Note: the 8B shape's checkpoints outgrow the host (128 GiB, 64 of them the states) before the
            # GPU runs out: the first of them stay on the GPU
            "activation_checkpointing": {"plugin": "cpu", "min_offload_bytes": 0 if smoke else 1 << 20,
                                         "device_bytes": 0 if smoke or device_type != "cuda"
                                         else kept_on_device(name, seq)}}


def deepspeed_config(name: str) -> dict:
    bf16_states = MODELS[name].get("int8", False)
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 1.0,
            "bf16": {"enabled": True, **({"bf16_master_weights_and_grads": True, "bf16_optimizer_states": True}
                                         if bf16_states else {})},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "weight_decay": 0.0,
                                                      **({"fp32_optimizer_states": False} if bf16_states else {})}},
            "zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu", "pin_memory": True},
                                  "offload_param": {"device": "cpu", "pin_memory": True},
                                  "overlap_comm": True, "contiguous_gradients": True,
                                  "stage3_param_persistence_threshold": 1e5},
            "sequence_parallel_size": 1, "steps_per_print": 10 ** 9, "wall_clock_breakdown": False}


def _batch(name: str, seq: int, device):
    import torch
    V = shape(name, seq)["vocab"]
    x = torch.randint(0, V, (1, seq + 1), device=device)
    if MODELS[name]["kind"] == "gpt":
        return (x[:, :-1], x[:, 1:]), {}
    return (), {"input_ids": x[:, :-1], "labels": x[:, :-1]}


class ZeroplugRun:
    def __init__(self, name, seq, device, smoke=False):
        import zeroplug
        self.name = name
        model = build(name, seq, device if device.type == "cuda" else "cpu")
        cfg = zeroplug_config(name, device.type, smoke, seq)
        self.engine = zeroplug.initialize(model, cfg, device=device)
        stats = getattr(self.engine.activations, "stats", None)
        kept = cfg["activation_checkpointing"]["device_bytes"]
        self.notes = "tiles and host checkpoints" + (f" ({kept / GiB:.0f} GiB of them on the GPU)" if kept else "")
        self.stats = stats

    def step(self, args, kwargs) -> float:
        out = self.engine(*args, **kwargs)
        loss = out if MODELS[self.name]["kind"] == "gpt" else out.loss
        self.engine.backward(loss)
        self.engine.step()
        return float(loss)

    def close(self):
        self.engine.close()


class DeepSpeedRun:
    """DeepSpeed's ALST recipe for one GPU (the module docstring); what its version lacks is noted."""

    def __init__(self, name, seq, device, smoke=False):
        import torch

        from zeroplug.benchmarking.measure import init_deepspeed
        deepspeed = init_deepspeed()
        self.name, self.notes, self.ctx = name, [], None
        gpt = MODELS[name]["kind"] == "gpt"
        try:
            from deepspeed.runtime.sequence_parallel.ulysses_sp import TiledFusedLogitsLoss, TiledMLP
        except ImportError:
            TiledMLP = TiledFusedLogitsLoss = None
            self.notes.append("no TiledMLP / TiledFusedLogitsLoss")
        model = build(name, seq, device)
        if gpt and not self._gpt_cpu_checkpointing(deepspeed):
            self.notes.append("checkpoints on the GPU")
        if TiledMLP is not None:
            self._tile_mlp(model, TiledMLP, gpt)
        self.engine, *_ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=deepspeed_config(name))
        self.module = self.engine.module
        self.tiled_loss = TiledFusedLogitsLoss
        if not gpt:
            try:
                from deepspeed.runtime.activation_checkpointing.offload_activations import (
                    get_checkpoint_hidden_states_offloading_ctx_manager)
                self.ctx = get_checkpoint_hidden_states_offloading_ctx_manager()
            except ImportError:
                self.notes.append("checkpoints on the GPU (no offloading context manager)")
        self.notes = "; ".join(self.notes) or "TiledMLP, tiled loss, host checkpoints"
        self.torch = torch

    @staticmethod
    def _gpt_cpu_checkpointing(deepspeed) -> bool:
        """The reference GPT's checkpoints through deepspeed.checkpointing with checkpoint_in_cpu."""
        try:
            deepspeed.checkpointing.configure(None, checkpoint_in_cpu=True, partition_activations=False)
            from zeroplug.plugins.workload import models
            models.checkpoint = lambda fn, x, use_reentrant=False: deepspeed.checkpointing.checkpoint(fn, x)
            return True
        except Exception:
            return False

    @staticmethod
    def _tile_mlp(model, TiledMLP, gpt: bool) -> None:
        mlps = [m for n, m in model.named_modules() if n.rsplit(".", 1)[-1] == "mlp"]
        cls = type(mlps[0])
        orig = cls.forward

        def forward(self, x):
            shards = max(1, math.ceil(x.shape[1] / x.shape[-1]))      # the tutorial's choice
            return TiledMLP.apply(orig, self, x, shards, list(self.parameters()))
        cls.forward = forward

    def _loss(self, hidden, head, targets):
        import torch.nn.functional as F
        V = head.weight.shape[0]
        count = (targets != -100).sum().clamp(min=1)
        if self.tiled_loss is None:
            return F.cross_entropy(head(hidden).float().view(-1, V), targets.reshape(-1))

        def fn(self_, x, y):
            return F.cross_entropy(head(x).float().view(-1, V), y.reshape(-1), reduction="sum")
        shards = max(1, math.ceil(hidden.shape[1] / 4096))
        total = self.tiled_loss.apply(fn, head, hidden, targets, None, shards, [head.weight], "sum")
        return total / count

    def step(self, args, kwargs) -> float:
        import contextlib
        ctx = self.ctx if self.ctx is not None else contextlib.nullcontext()
        m = self.module
        with ctx:
            if MODELS[self.name]["kind"] == "gpt":
                idx, targets = args
                x = m.tok_emb(idx) + m.pos_emb(self.torch.arange(idx.shape[1], device=idx.device))
                for block in m.blocks:
                    from zeroplug.plugins.workload import models
                    x = models.checkpoint(block, x, use_reentrant=False)
                loss = self._loss(m.ln_f(x), m.head, targets)
            else:
                ids, labels = kwargs["input_ids"], kwargs["labels"]
                hidden = m.model(input_ids=ids, use_cache=False)[0]
                shift = self.torch.cat((labels[:, 1:], self.torch.full_like(labels[:, :1], -100)), dim=1)
                loss = self._loss(hidden, m.lm_head, shift)
            self.engine.backward(loss)
        self.engine.step()
        return float(loss)

    def close(self):
        pass


def probe(args) -> int:
    """Build, initialize, train ``--steps`` steps at ``--seq``; print ``PROBE {json}``."""
    import torch

    from zeroplug.benchmarking.measure import peak_host_bytes, sync
    from zeroplug.errors import HostMemoryError
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    out = {"model": args.model, "framework": args.framework, "seq": args.seq,
           "gpu": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    if args.framework == "deepspeed":
        import importlib.util
        if importlib.util.find_spec("deepspeed") is None:
            out["error"] = "deepspeed not installed"
            print("PROBE " + json.dumps(out), flush=True)
            return 0
    run = None
    t0 = time.perf_counter()
    try:
        run = (ZeroplugRun if args.framework == "zeroplug" else DeepSpeedRun)(args.model, args.seq, device,
                                                                              args.smoke)
        out["notes"] = run.notes
        out["init_s"] = round(time.perf_counter() - t0, 1)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for i in range(args.steps):
            a, kw = _batch(args.model, args.seq, device)
            t = time.perf_counter()
            out["loss"] = run.step(a, kw)
            sync(device)
            times.append(time.perf_counter() - t)
            print(f"step {i + 1}: {times[-1]:.2f} s", file=sys.stderr, flush=True)
        step = statistics.median(times[1:] or times)
        out.update(step_s=round(step, 3), tokens_per_s=args.seq / step, step_times=[round(t, 2) for t in times])
    except torch.OutOfMemoryError as exc:
        out["error"] = "GPU memory (CUDA OOM): " + str(exc).splitlines()[0][:160]
    except HostMemoryError as exc:
        out["error"] = "host memory (refused): " + str(exc)[:300]
    except Exception as exc:  # noqa: BLE001 - any other failure is the probe's outcome
        text = f"{type(exc).__name__}: {exc}"
        out["error"] = ("GPU memory (CUDA OOM): " if "out of memory" in text.lower() else "failed: ") + text[:300]
    finally:
        if device.type == "cuda":
            out["peak_gpu_gib"] = round(torch.cuda.max_memory_allocated(device) / GiB, 2)
        out["peak_host_rss_gib"] = round(peak_host_bytes() / GiB, 2)
        print("PROBE " + json.dumps(out, default=str), flush=True)
    if run is not None:
        run.close()
    return OOM_EXIT if "error" in out else 0


# -- the search, in the parent (it never touches CUDA) -------------------------------------------
def run_probe(model: str, framework: str, seq: int, args, timeout: float) -> dict:
    cmd = [sys.executable, os.path.abspath(__file__), "probe", "--model", model, "--framework", framework,
           "--seq", str(seq), "--steps", str(args.steps)] + (["--smoke"] if args.smoke else [])
    env = probe_env()
    env.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    w = run_watched(cmd, env, timeout)
    res = {"model": model, "framework": framework, "seq": seq, "wall_s": w.wall_s,
           "rc": w.rc, "sampled_peak_rss_gib": round(w.peak_gib, 1), **w.record}
    if w.timed_out:
        res["outcome"] = f"time limit ({timeout:.0f} s)"
    elif res.get("error") == "deepspeed not installed":
        res["outcome"] = "deepspeed not installed"
    elif w.rc in (-signal.SIGKILL, 137):
        res["outcome"] = "host memory (killed)"
    elif "error" in res:
        res["outcome"] = res["error"]
    elif w.rc != 0 or "tokens_per_s" not in res:
        tail = [ln for ln in w.err.splitlines() if ln.strip()]
        res["outcome"] = "failed: " + (tail[-1][:200] if tail else f"exit {w.rc}")
    else:
        res["outcome"] = "trains"
    return res


def mfu(model: str, seq: int, tokens_per_s: float, peak_tflops: float) -> float:
    s = shape(model, seq)
    return tokens_per_s * (6 * s["params"] + 12 * s["layers"] * s["d"] * seq) / (peak_tflops * 1e12)


class Search:
    def __init__(self, args):
        self.args = args
        self.deadline = time.time() + args.budget_s
        self.probes: list = []

    def attempt(self, model, framework, seq) -> dict | None:
        limit = min(self.args.timeout_s, self.deadline - time.time())
        if limit < 20:
            return None
        r = run_probe(model, framework, seq, self.args, limit)
        self.probes.append(r)
        print(f"  {model:<9} {framework:<9} {seq:>9,}: {r['outcome']}"
              + (f" ({r['tokens_per_s']:,.0f} tokens/s, step {r['step_s']} s, " if "tokens_per_s" in r else " (")
              + f"GPU peak {r.get('peak_gpu_gib', 0)} GiB, host peak {r['sampled_peak_rss_gib']} GiB, "
                f"{r['wall_s']} s)", flush=True)
        return r

    def longest(self, model, framework) -> dict:
        args = self.args
        row = {"model": model, "framework": framework, "max": None, "bound": "", "at_max": None, "at_32k": None}
        if args.seqs:
            for seq in args.seqs:
                r = self.attempt(model, framework, seq)
                if r is None:
                    row["bound"] = row["bound"] or "budget spent"
                    break
                if r["outcome"] == "deepspeed not installed":
                    row["bound"] = r["outcome"]
                    return row
                if r["outcome"] == "trains":
                    if row["max"] is None or seq > row["max"]:
                        row["max"], row["at_max"] = seq, r
                    if seq == args.short:
                        row["at_32k"] = r
                elif row["max"] is None or seq > row["max"]:
                    row["bound"] = f"{seq:,}: {r['outcome']}"
            return row
        r = self.attempt(model, framework, args.short)
        if r is None:
            row["bound"] = "budget spent"
            return row
        if r["outcome"] == "deepspeed not installed":
            row["bound"] = r["outcome"]
            return row
        ok, bad = (args.short, None) if r["outcome"] == "trains" else (None, args.short)
        if ok:
            row["at_32k"] = row["at_max"] = r
            seq = max(args.start, 2 * args.short)
            while bad is None and seq <= args.max_seq:
                r = self.attempt(model, framework, seq)
                if r is None:
                    row["bound"] = "budget spent"
                    break
                if r["outcome"] == "trains":
                    ok, row["at_max"], seq = seq, r, 2 * seq
                else:
                    bad, row["bound"] = seq, f"{seq:,}: {r['outcome']}"
            while bad is not None and bad - ok > max(args.granule, ok * args.resolution):
                mid = (ok + bad) // 2 // args.granule * args.granule
                if mid <= ok:
                    break
                r = self.attempt(model, framework, mid)
                if r is None:
                    break
                if r["outcome"] == "trains":
                    ok, row["at_max"] = mid, r
                else:
                    bad, row["bound"] = mid, f"{mid:,}: {r['outcome']}"
            if bad is None and not row["bound"]:
                row["bound"] = f"--max-seq {args.max_seq:,} reached"
        else:
            row["bound"] = f"{args.short:,}: {r['outcome']}"
        row["max"] = ok
        return row


def _k(n: int) -> str:
    return f"{n // 1024}K" if n >= 1024 and n % 1024 == 0 else str(n)


def table(rows: list, args) -> str:
    out = [f"| model | framework | longest that trains (tokens) | tokens/s there | MFU there | tokens/s at "
           f"{_k(args.short)} | MFU at {_k(args.short)} | peak GPU / host GiB there | bound (the next length) "
           f"| notes |", "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |"]
    for r in rows:
        m, s = r["at_max"] or {}, r["at_32k"] or {}

        def rate(p):
            return f"{p['tokens_per_s']:,.0f}" if p.get("tokens_per_s") else "-"

        def util(p):
            return f"{mfu(r['model'], p['seq'], p['tokens_per_s'], args.peak_tflops):.1%}" if p.get("tokens_per_s") else "-"
        longest = f"{r['max']:,}" if r["max"] else "-"
        out.append(f"| {r['model']} | {r['framework']} | {longest} | "
                   f"{rate(m)} | {util(m)} | {rate(s)} | {util(s)} | "
                   f"{m.get('peak_gpu_gib', '-')} / {m.get('sampled_peak_rss_gib', '-')} | {r['bound'] or '-'} | "
                   f"{m.get('notes') or s.get('notes') or ''} |")
    return "\n".join(out)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0].replace("\n", " "))
    ap.add_argument("what", nargs="?", default="search", choices=["search", "probe"])
    ap.add_argument("--models", default=DEFAULT_MODELS, help="comma-separated: " + ", ".join(MODELS))
    ap.add_argument("--frameworks", default="zeroplug,deepspeed")
    ap.add_argument("--model", help="probe: the model")
    ap.add_argument("--framework", help="probe: the framework")
    ap.add_argument("--seq", type=int, help="probe: the sequence length")
    ap.add_argument("--seqs", help="probe only these lengths (comma-separated) instead of searching")
    ap.add_argument("--steps", type=int, default=2, help="steps per probe (the first untimed when there are more)")
    ap.add_argument("--short", type=int, default=32768, help="the fixed length reported beside the longest (32K)")
    ap.add_argument("--start", type=int, default=65536, help="the search's first length after --short")
    ap.add_argument("--max-seq", type=int, default=4 * 1024 * 1024, help="the search stops doubling here")
    ap.add_argument("--resolution", type=float, default=0.125,
                    help="bisect until the gap is this fraction of the longest that trains")
    ap.add_argument("--granule", type=int, default=4096, help="lengths are multiples of this")
    ap.add_argument("--budget-s", type=float, default=3 * 3600.0, help="seconds for the whole run")
    ap.add_argument("--timeout-s", type=float, default=1800.0, help="seconds per probe at most")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak for MFU")
    ap.add_argument("--smoke", action="store_true",
                    help="tiny models and lengths (CPU): gpt-tiny, llama-tiny at 32 .. 128 tokens")
    args = ap.parse_args(argv)
    if args.what == "probe":
        return probe(args)
    if args.smoke:
        if args.models == DEFAULT_MODELS:
            args.models = "gpt-tiny,llama-tiny"
        args.short, args.start, args.max_seq, args.granule = 32, 64, 128, 16
        args.budget_s = min(args.budget_s, 900.0)
    args.seqs = [int(s) for s in args.seqs.split(",")] if args.seqs else None
    unknown = [m for m in args.models.split(",") if m not in MODELS]
    if unknown:
        print(f"error: --models {','.join(unknown)}: unknown; choose from {', '.join(MODELS)}", file=sys.stderr)
        return 2
    import torch
    gpu = f"{torch.cuda.device_count()} GPU(s)" if torch.cuda.is_available() else "cpu"
    print(f"longest sequence that trains: {gpu}, {os.cpu_count()} cores, torch {torch.__version__}, "
          f"micro batch 1, {args.steps} steps per probe, budget {args.budget_s:.0f} s", flush=True)
    search = Search(args)
    rows = [search.longest(m, f) for m in args.models.split(",") for f in args.frameworks.split(",")]
    names = sorted({p["gpu"] for p in search.probes if p.get("gpu")})
    print(f"\n{', '.join(names) or gpu}; command: python3 -m tests.benchmarks.long_seq "
          f"{' '.join(sys.argv[1:] if argv is None else argv)}\n")
    print(table(rows, args), flush=True)
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "long_seq.json").write_text(json.dumps({"rows": rows, "probes": search.probes}, indent=1,
                                                            default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
