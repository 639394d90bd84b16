"""Held-out evaluation: loss of the saved models (and of untrained ones), greedy agreement."""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from .common import log
from .models import load_model, new_model


def windows(s: torch.Tensor, ctx: int, max_tokens: int) -> torch.Tensor:
    """Evenly spread non-overlapping windows of ``ctx`` tokens over the held-out stream."""
    total = len(s) // ctx
    n = max(1, min(total, max_tokens // ctx))
    starts = [int(i * (len(s) - ctx) / max(1, n - 1)) for i in range(n)] if n > 1 else [0]
    return torch.stack([s[a : a + ctx] for a in starts]).long()


@torch.no_grad()
def eval_loss_and_preds(model, wins: torch.Tensor, keep_preds: bool):
    tot, cnt, preds = 0.0, 0, []
    for w in wins:
        logits = model(input_ids=w[None]).logits[0, :-1].float()
        tot += F.cross_entropy(logits, w[1:], reduction="sum").item()
        cnt += len(w) - 1
        if keep_preds:
            preds.append(logits.argmax(-1))
    return tot / cnt, (torch.stack(preds) if keep_preds else None)


def evaluate(target_dir, draft_dir, held_stream, args, untrained):
    res = {"untrained": untrained}
    target, draft = load_model(target_dir), load_model(draft_dir)
    torch.set_grad_enabled(False)
    for ctx in args.eval_ctx:
        if len(held_stream) < ctx:
            continue
        wins = windows(held_stream, ctx, args.eval_tokens)
        t0 = time.time()
        want_agree = ctx <= 4096
        t_loss, t_pred = eval_loss_and_preds(target, wins, want_agree)
        entry = {"windows": len(wins), "positions": int(wins.numel() - len(wins))}
        entry["target_loss"] = round(t_loss, 4)
        if want_agree:
            d_loss, d_pred = eval_loss_and_preds(draft, wins, True)
            entry["draft_loss"] = round(d_loss, 4)
            entry["agreement"] = round((t_pred == d_pred).float().mean().item(), 4)
            # Agreement restricted to positions with >= 512 tokens of context (late window).
            if ctx >= 1024:
                entry["agreement_pos_ge_512"] = round(
                    (t_pred[:, 511:] == d_pred[:, 511:]).float().mean().item(), 4
                )
        entry["seconds"] = round(time.time() - t0, 1)
        res[f"ctx{ctx}"] = entry
        log(f"eval ctx {ctx}: {entry}")
    torch.set_grad_enabled(True)
    return res


def untrained_losses(cfg, seed, held_stream, args):
    m = new_model(cfg, seed).eval()
    m = m.to(torch.bfloat16).float()  # same rounding as the saved weights
    wins = windows(held_stream, 1024, args.eval_tokens)
    loss, _ = eval_loss_and_preds(m, wins, False)
    return round(loss, 4)
