"""The built-in job's one-step delayed update in plain torch (as delayed_reference_job.py),
with delay-compensation variants: what the forward sees, and corrections of the stale gradient.
Prints the held-out loss (docs/benchmarks.md, "Delayed parameter update", compensation).

  python3 -m tests.benchmarks.delayed_compensation_job --seq 64 --max-bytes 400000 --warmup 40 \
      --pred adam --corr lsq --lam 2 --fir1 0.75          # the best found: +1.4-1.7% over exact

Semantics (as delayed_reference_job.py): after --warmup exact steps, the gradient of step t+1 is taken at
weights W published at the boundary of step t (after its backward, BEFORE update t): W may only
depend on the optimizer state after update t-1 (master m, previous master, exp_avg, exp_avg_sq,
extra buffers), never on step t's gradient. Gradient corrections run inside update t+1 (CPU).
AdamW is written out (same math as torch.optim.AdamW, single-tensor) so the moments can be fed
a corrected gradient.

  --pred plain|lin|adam|adamk|ema   weights W published for the next forward
      plain: W = m                          (original DPU)
      lin:   W = m + alpha*(m - m_prev)     (alpha=1: original --variant predict)
      adam:  W = m - alpha*lr_next*(mhat/(sqrt(vhat)+eps) + wd*m)  (Adam's next step, E[g]=exp_avg)
      adamk: as adam with beta1*exp_avg only (the part of the next step known without g)
      ema:   W = m + alpha*d, d = gamma*d + (1-gamma)*(m - m_prev)   (PipeMare-style velocity EMA)
  --corr  correction of g (taken at W_stale, applied at m), after clipping:
      dc:   g += lam * g*g * (m - W_stale)                      (DC-ASGD)
      dca:  g += lam * g*g/(sqrt(vhat)+eps) * (m - W_stale)     (DC-ASGD-a like)
      dcv:  g += lam * vhat * (m - W_stale)
      gext: g += lam * (g - g_prev)                              (gradient extrapolation/optimistic)
      gext2: g += lam * (g - g_prev) + lam2 * (g_prev - g_prev2)
      sec:  g += lam * clamp(r,-R,R) * (g - g_prev), r = (m - W)/(W - W_prev)  (diag secant DC)
      gsec: g += lam * clamp(<dg, m-W>/<dg, W-W_prev>, -R, R) * (g - g_prev)  (global rank-1 secant DC)
      gsect: same with per-tensor dot products
      lsq:  h = relu(E[dg*dw]/E[dw^2]) (EMAs, --gamma), g += lam*h*(m - W)   (smoothed secant DC)
  --lam-per-lr  lam is divided by the current lr (natural units for Adam)
  --corr-v      feed the corrected g to exp_avg_sq too (default: only exp_avg gets it)
"""
import argparse
import math
import time

import torch

from tests.benchmarks.delayed_reference_job import add_job_arguments, builtin_job


def main() -> None:
    ap = argparse.ArgumentParser()
    add_job_arguments(ap)
    ap.add_argument("--variant", choices=["plain", "predict"], default=None, help="compat: predict == --pred lin")
    ap.add_argument("--pred", choices=["plain", "lin", "adam", "adamk", "ema"], default="plain")
    ap.add_argument("--alpha", type=float, default=1.0)
    ap.add_argument("--gamma", type=float, default=0.9)
    ap.add_argument("--corr", choices=["none", "dc", "dca", "dcv", "gext", "gext2", "sec", "lsq", "gsec", "gsect"], default="none")
    ap.add_argument("--lam", type=float, default=0.0)
    ap.add_argument("--R", type=float, default=1.0)
    ap.add_argument("--lam2", type=float, default=0.0)
    ap.add_argument("--fir1", type=float, default=0.0, help="extra: g += fir1*(g - g_prev) + fir2*(g_prev - g_prev2)")
    ap.add_argument("--fir2", type=float, default=0.0)
    ap.add_argument("--den-tensor", action="store_true", help="lsq: E[dw^2] as one scalar per tensor")
    ap.add_argument("--bf16-buf", action="store_true", help="store g_prev, W_prev, num, den rounded to bf16")
    ap.add_argument("--lam-per-lr", action="store_true")
    ap.add_argument("--corr-v", action="store_true")
    ap.add_argument("--seed", type=int, default=0, help="model init and data seed")
    ap.add_argument("--b1-delayed", type=float, default=None, help="Adam's beta1 once the delay runs")
    ap.add_argument("--lr-delayed", type=float, default=1.0, help="the learning rate's factor once the delay runs")
    ap.add_argument("--lr-scale", type=float, default=1.0, help="the whole schedule's factor (exact steps too)")
    ap.add_argument("--log", type=int, default=0, help="print train loss every N steps")
    a = ap.parse_args()
    if a.variant == "predict":
        a.pred, a.alpha = "lin", 1.0
    warmup = a.steps if a.warmup is None else a.warmup

    lr_at, model, data, held_out = builtin_job(a.steps, a.seq, a.max_bytes, a.micro_batch, a.seed)

    b1, b2, eps, wd = 0.9, 0.95, 1e-8, 0.1
    params = list(model.parameters())
    masters = [p.detach().clone() for p in params]
    before = [m.clone() for m in masters]                 # the masters before the last update
    S = [dict(ea=torch.zeros_like(m), es=torch.zeros_like(m), k=0) for m in masters]
    need_prev = a.corr in ("gext", "gext2", "sec", "lsq", "gsec", "gsect") or a.fir1 or a.fir2
    if a.pred == "ema":
        for s, m in zip(S, masters):
            s["d"] = torch.zeros_like(m)
    if need_prev:
        for s, m in zip(S, masters):
            s["gp"] = None                                # previous (clipped) gradient
            s["wp"] = None                                # weights it was taken at
            s["gpp"] = None                               # gradient before that (gext2)
            if a.corr == "lsq":
                s["num"], s["den"] = torch.zeros_like(m), torch.zeros_like(m)

    @torch.no_grad()
    def publish_exact() -> None:
        for p, m in zip(params, masters):
            p.copy_(m)

    @torch.no_grad()
    def publish_pred(lr_next: float) -> None:
        """Weights for the next forward from the state after the last update (no current gradient)."""
        for p, m, q, s in zip(params, masters, before, S):
            if a.pred == "plain":
                p.copy_(m)
            elif a.pred == "lin":
                p.copy_(m + a.alpha * (m - q))
            elif a.pred == "ema":
                p.copy_(m + a.alpha * s["d"])
            else:
                k = s["k"] + 1                            # bias corrections of the coming step
                mhat = s["ea"] * (b1 if a.pred == "adamk" else 1.0) / (1 - b1 ** k)
                vhat = s["es"] / (1 - b2 ** k)
                p.copy_(m - a.alpha * lr_next * (mhat / (vhat.sqrt() + eps) + wd * m))

    @torch.no_grad()
    def adamw(m, s, gm, gv, lr, beta1):
        s["k"] += 1
        k = s["k"]
        m.mul_(1 - lr * wd)
        s["ea"].lerp_(gm, 1 - beta1)
        s["es"].mul_(b2).addcmul_(gv, gv, value=1 - b2)
        denom = (s["es"].sqrt() / math.sqrt(1 - b2 ** k)).add_(eps)
        m.addcdiv_(s["ea"], denom, value=-lr / (1 - b1 ** k))

    start, pending, t0 = held_out(), False, time.time()
    for t in range(a.steps):
        x, y = next(data)
        loss = model(x, y)
        loss.backward()
        if a.log and t % a.log == 0:
            print(f"  step {t} loss {loss.item():.4f}")
        stale = [p.detach().clone() for p in params]      # where this gradient was taken
        grads = [p.grad for p in params]
        for p in params:
            p.grad = None
        if t >= warmup:             # step t+1 is delayed: publish before update t (state after update t-1)
            publish_pred(lr_at(t) * a.lr_scale)
        with torch.no_grad():       # clip_grad_norm_(masters, 1.0) on the gradient tensors
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            coef = (1.0 / (total + 1e-6)).clamp(max=1.0)
            for g in grads:
                g.mul_(coef)
        lr = lr_at(t) * a.lr_scale * (a.lr_delayed if pending else 1.0)
        beta1 = a.b1_delayed if (pending and a.b1_delayed is not None) else b1
        lam = a.lam / lr if (a.lam_per_lr and lr > 0) else a.lam
        with torch.no_grad():
            for q, m in zip(before, masters):
                q.copy_(m)
            if pending and a.corr in ("gsec", "gsect"):   # secant ratio <dg, m-w> / <dg, w-w_prev>
                nums = [((g - s["gp"]) * (m - w)).sum() for m, w, g, s in zip(masters, stale, grads, S)]
                dens = [((g - s["gp"]) * (w - s["wp"])).sum() for m, w, g, s in zip(masters, stale, grads, S)]
                if a.corr == "gsec":
                    nums, dens = [sum(nums)] * len(S), [sum(dens)] * len(S)
                ratios = [float((n / d).clamp(-a.R, a.R)) if d != 0 else 0.0 for n, d in zip(nums, dens)]
                if t % 20 == 0 and a.log:
                    print("   ratios", [round(r, 2) for r in ratios[:6]])
            for i, (m, w, g, s) in enumerate(zip(masters, stale, grads, S)):
                gc = g
                if pending and a.corr != "none":   # g was taken at w, is applied at m
                    vhat = s["es"] / (1 - b2 ** s["k"])
                    if a.corr == "dc":
                        gc = g + lam * g * g * (m - w)
                    elif a.corr == "dca":
                        gc = g + lam * g * g / (vhat.sqrt() + eps) * (m - w)
                    elif a.corr == "dcv":
                        gc = g + lam * vhat * (m - w)
                    elif a.corr == "gext":
                        gc = g + lam * (g - s["gp"])
                    elif a.corr == "gext2":
                        gc = g + lam * (g - s["gp"]) + a.lam2 * (s["gp"] - (s["gpp"] if s["gpp"] is not None else s["gp"]))
                    elif a.corr in ("gsec", "gsect"):
                        gc = g + lam * ratios[i] * (g - s["gp"])
                    elif a.corr == "sec":
                        dw = w - s["wp"]
                        r = torch.where(dw.abs() > 0, (m - w) / torch.where(dw == 0, torch.ones_like(dw), dw),
                                        torch.zeros_like(dw)).clamp_(-a.R, a.R)
                        gc = g + lam * r * (g - s["gp"])
                    elif a.corr == "lsq":
                        e = (m - w).bfloat16().float() if a.bf16_buf else (m - w)
                        gc = g + lam * (s["num"] / (s["den"] + 1e-30)).clamp_(min=0) * e
                if pending and (a.fir1 or a.fir2):
                    gc = gc + a.fir1 * (g - s["gp"]) + a.fir2 * (s["gp"] - (s["gpp"] if s["gpp"] is not None else s["gp"]))
                if need_prev:
                    if a.corr == "lsq" and s["gp"] is not None:
                        dg, dw = g - s["gp"], w - s["wp"]
                        if a.bf16_buf:
                            dw = dw.bfloat16().float()
                        s["num"].mul_(a.gamma).add_(dg * dw, alpha=1 - a.gamma)
                        s["den"].mul_(a.gamma).add_((dw * dw).mean() if a.den_tensor else dw * dw, alpha=1 - a.gamma)
                        if a.bf16_buf:
                            s["num"].copy_(s["num"].bfloat16())
                            s["den"].copy_(s["den"].bfloat16())
                    s["gpp"], s["gp"], s["wp"] = s["gp"], g.clone(), w
                    if a.bf16_buf:
                        s["gp"] = s["gp"].bfloat16().float()   # (W_prev kept exact; dw and m-W rounded at use)
                adamw(m, s, gc, gc if a.corr_v else g, lr, beta1)
            if a.pred == "ema":
                for m, q, s in zip(masters, before, S):
                    s["d"].mul_(a.gamma).add_(m - q, alpha=1 - a.gamma)
        pending = t >= warmup
        if not pending:
            publish_exact()
    publish_exact()
    extra = f" lam={a.lam}{'/lr' if a.lam_per_lr else ''}{' +v' if a.corr_v else ''}" if a.corr != "none" else ""
    if a.fir1 or a.fir2:
        extra += f" fir=({a.fir1},{a.fir2})"
    if a.corr == "lsq":
        extra += f" gamma={a.gamma}" + (" den/tensor" if a.den_tensor else "") + (" bf16buf" if a.bf16_buf else "")
    if a.corr == "gext2":
        extra += f" lam2={a.lam2}"
    if a.corr in ("sec", "gsec", "gsect"):
        extra += f" R={a.R}"
    print(f"seed={a.seed} warmup={warmup} pred={a.pred} alpha={a.alpha} corr={a.corr}{extra}: "
          f"held-out loss start {start:.4f} -> end {held_out():.6f} ({time.time() - t0:.0f}s)", flush=True)


if __name__ == "__main__":
    main()
