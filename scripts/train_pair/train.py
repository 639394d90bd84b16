"""One training phase (target pre-training or draft distillation), budgeted by wall time."""

from __future__ import annotations

import math
import time

import torch
import torch.nn.functional as F

from .common import log


def lr_at(progress, peak, warm_frac, min_ratio=0.1):
    if progress < warm_frac:
        return peak * max(progress / warm_frac, 0.02)
    p = min((progress - warm_frac) / max(1e-9, 1 - warm_frac), 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def train_phase(
    name,
    model,
    batches,
    minutes,
    args,
    lr,
    save_fn,
    teacher=None,
    max_steps=None,
):
    """Train until the wall-time budget (or max_steps) is spent.

    Progress = max(elapsed / budget, step / max_steps) drives the LR schedule (linear warmup,
    cosine decay to 10%) and the switch to the long-context phase (last ``--long-frac``).
    """
    opt = torch.optim.AdamW(
        model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1, eps=1e-8, fused=False
    )
    budget = minutes * 60.0
    model.train()
    t0 = time.time()
    last_log = last_save = t0
    step, tok_done, ema = 0, 0, None
    hist = []
    amp = args.precision == "bf16"
    while True:
        elapsed = time.time() - t0
        progress = elapsed / budget
        if max_steps:
            progress = max(progress, step / max_steps)
        if progress >= 1.0:
            break
        long_phase = progress >= 1.0 - args.long_frac
        seq = args.long_seq if long_phase else args.seq
        bs = max(1, args.batch_tokens // seq)
        cur_lr = lr_at(progress, lr, args.warmup_frac)
        for g in opt.param_groups:
            g["lr"] = cur_lr
        x = batches.next(bs, seq)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            logits = model(input_ids=x).logits
        logits = logits[:, :-1].float()
        tgt = x[:, 1:]
        ce = F.cross_entropy(logits.reshape(-1, logits.size(-1)), tgt.reshape(-1))
        if teacher is not None:
            with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
                t_logits = teacher(input_ids=x).logits
            t_logp = F.log_softmax(t_logits[:, :-1].float(), dim=-1)
            s_logp = F.log_softmax(logits, dim=-1)
            kl = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()
            t_arg = t_logp.argmax(-1)  # hard distillation: the target's greedy choice
            g_ce = F.nll_loss(s_logp.reshape(-1, s_logp.size(-1)), t_arg.reshape(-1))
            data_w = 1 - args.kl_weight - args.greedy_weight
            loss = args.kl_weight * kl + args.greedy_weight * g_ce + data_w * ce
        else:
            loss = ce
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tok_done += x.numel()
        li = loss.item()
        ema = li if ema is None else 0.95 * ema + 0.05 * li
        now = time.time()
        if now - last_log >= args.log_every or step == 1:
            el = now - t0
            rate = tok_done / el
            eta = max(0.0, budget - el)
            if max_steps:
                eta = min(eta, (max_steps - step) * el / step)
            extra = f" ce {ce.item():.3f}" if teacher is not None else ""
            log(
                f"{name} step {step} seq {seq}x{bs} loss {li:.3f} (ema {ema:.3f}){extra} "
                f"lr {cur_lr:.2e} gnorm {gn:.2f} tok/s {rate:.0f} tokens {tok_done / 1e6:.2f}M "
                f"epoch {batches.epoch} eta {eta / 60:.1f}min"
            )
            hist.append(
                dict(step=step, loss=round(li, 4), ema=round(ema, 4), seconds=round(el, 1))
            )
            last_log = now
        if now - last_save >= args.save_every * 60:
            save_fn(model)
            log(f"{name}: checkpoint saved at step {step}")
            last_save = time.time()
    wall = time.time() - t0
    model.eval()
    save_fn(model)
    log(f"{name}: done, {step} steps, {tok_done / 1e6:.2f}M tokens, {wall / 60:.1f} min")
    return dict(
        steps=step,
        tokens=tok_done,
        wall_seconds=round(wall, 1),
        final_loss_ema=round(ema or float("nan"), 4),
        peak_lr=lr,
        history=hist,
    )
