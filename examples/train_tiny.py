#!/usr/bin/env python
"""Train a tiny KDA language model on multi-query associative recall (MQAR).

The model: token embedding, ``--layers`` pre-norm residual blocks (RMSNorm -> kdakit's
``KimiDeltaAttention`` -> residual, RMSNorm -> SwiGLU MLP -> residual), a final RMSNorm and a
linear head (run only at the positions the loss reads).

The task (Zoology's multi-query associative recall): each sequence starts with ``--pairs``
key-value pairs ``k1 v1 k2 v2 ...`` (keys distinct, from the lower half of the vocabulary; values
from the upper half; a fresh random mapping per sequence), then ``--queries`` two-token query
slots ``k v`` (a key of the pairs, drawn with replacement, and its value) at random slots of the
rest of the sequence, filler token 0 elsewhere (the CPU default fills every slot: no filler). The
loss is the cross-entropy of the value predicted at each query key, and only there. The mapping
changes every sequence and the short convolution sees three tokens back, so only the recurrent
state can carry it from the pairs to the queries: a model that ignores it cannot beat chance,
``log(number of values)`` nats (printed beside ``log(vocab)``). The curve shows the usual plateau at
chance, then the drop once the layers learn to write keys to values and read them back.

Episodes (``--episodes E``, the cuda default): each sequence is ``E`` such tasks back to back, ``seq // E``
tokens each: a separator token (``SEPARATOR``), the episode's own pairs (a fresh mapping), its queries. The
state is never reset, and keys recur across episodes with new values, so only the current episode's binding
is right: the state has to overwrite or forget the old ones along the whole sequence. A batch-1 step then
sees ``E`` mappings instead of one: single-episode MQAR at batch 1 stayed at chance on the H200 (150 steps at
64K tokens, so 150 mappings), and the CPU probes listed above ``DEVICE_DEFAULTS`` leave the plateau sooner the
more episodes a step holds.

CPU (the default): about a minute on one thread, seeded and deterministic (same numbers every run
on one machine); writes the loss curve as CSV (``--out``) and, when matplotlib is importable, as
PNG (otherwise ``pip install -e '.[plot]'``).

GPU (``--device cuda``): trains at long context (one sequence of 65536 tokens per step: 1024 episodes of
64 tokens, 8 pairs each, vocab 64; width 512, 4 heads x 128, bf16, lr 5e-3, 150 steps) and reports the
median step time and peak memory (``torch.cuda.max_memory_allocated`` / ``max_memory_reserved``),
then the same for the model built on FLA's ``fla.layers.kda.KimiDeltaAttention`` (same config,
same initial weights, same batches) when ``fla`` is importable (a clear message otherwise). The CPU
probes behind these defaults are listed above ``DEVICE_DEFAULTS``.

    python examples/train_tiny.py                      # CPU, ~1 min
    kdakit train-demo                                  # the same
    python examples/train_tiny.py --device cuda        # 64K tokens, 150 steps
"""

from __future__ import annotations

import argparse
import csv
import importlib
import math
import os
import statistics
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

FILLER = 0  # token id of the filler between query slots; keys and values never use it
SEPARATOR = 1  # --episodes > 1: the first token of every episode (keys then start at FIRST_EPISODE_KEY)
FIRST_EPISODE_KEY = 2


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------

def mqar_batch(batch: int, seq: int, vocab: int, pairs: int, queries: int, generator: torch.Generator,
               first_key: int = 1):
    """One MQAR batch: ``(tokens [B, T], targets [B, T])``, targets -100 except at query keys.

    Keys come from ``[first_key, vocab // 2)``, values from ``[vocab // 2, vocab)``.
    """
    n_keys = vocab // 2 - first_key
    if pairs > n_keys:
        raise ValueError(f"{pairs} pairs need as many distinct keys; vocab {vocab} has {n_keys}")
    slots = (seq - 2 * pairs) // 2
    if slots < queries:
        raise ValueError(f"seq {seq} holds {pairs} pairs and at most {max(slots, 0)} query slots, asked for {queries} "
                         "queries")
    g = generator
    keys = torch.rand(batch, n_keys, generator=g).argsort(dim=1)[:, :pairs] + first_key     # distinct per row
    values = torch.randint(vocab // 2, vocab, (batch, pairs), generator=g)
    tokens = torch.full((batch, seq), FILLER, dtype=torch.long)
    targets = torch.full((batch, seq), -100, dtype=torch.long)
    tokens[:, 0:2 * pairs:2], tokens[:, 1:2 * pairs:2] = keys, values
    # query slots: `queries` of the `slots` two-token slots after the pairs, in order
    slot = torch.rand(batch, slots, generator=g).argsort(dim=1)[:, :queries].sort(dim=1).values
    pos = 2 * pairs + 2 * slot                                                              # [B, Q]
    which = torch.randint(0, pairs, (batch, queries), generator=g)                          # pair queried
    qk, qv = keys.gather(1, which), values.gather(1, which)
    tokens.scatter_(1, pos, qk)
    tokens.scatter_(1, pos + 1, qv)
    targets.scatter_(1, pos, qv)
    return tokens, targets


def episode_len(seq: int, episodes: int) -> int:
    """Tokens per episode: ``seq // episodes`` (the last ``seq % episodes`` tokens are filler)."""
    return seq // episodes


def episode_slots(seq: int, episodes: int, pairs: int) -> int:
    """Two-token query slots per episode: after its separator and its pairs."""
    return (episode_len(seq, episodes) - 1 - 2 * pairs) // 2


def mqar_episodes_batch(batch: int, seq: int, vocab: int, pairs: int, queries: int, episodes: int,
                        generator: torch.Generator):
    """``episodes`` independent MQAR episodes back to back in each sequence: ``(tokens, targets)`` as
    ``mqar_batch``. Episode ``e`` holds the tokens ``[e * L, (e + 1) * L)``, ``L = seq // episodes``: the
    ``SEPARATOR`` token, then its own ``pairs`` key-value pairs (a fresh random mapping: keys distinct within
    the episode, from ``[FIRST_EPISODE_KEY, vocab // 2)``), then ``queries`` two-token query slots of those
    keys (filler elsewhere). Keys recur across episodes with new values, so only the current episode's binding
    is right: the state has to overwrite (or forget) the old ones. The ``seq % episodes`` tokens after the last
    episode are filler."""
    length = episode_len(seq, episodes)
    if length < 1 + 2 * pairs + 2 * queries:
        raise ValueError(f"an episode of {length} tokens (seq {seq} / {episodes} episodes) holds a separator, "
                         f"{pairs} pairs and at most {max(0, episode_slots(seq, episodes, pairs))} query slots, "
                         f"asked for {queries} queries")
    tok, tgt = mqar_batch(batch * episodes, length - 1, vocab, pairs, queries, generator, first_key=FIRST_EPISODE_KEY)
    sep = torch.full((batch * episodes, 1), SEPARATOR, dtype=torch.long)
    tokens = torch.full((batch, seq), FILLER, dtype=torch.long)
    targets = torch.full((batch, seq), -100, dtype=torch.long)
    tokens[:, :episodes * length] = torch.cat([sep, tok], 1).view(batch, episodes * length)
    targets[:, :episodes * length] = torch.cat([torch.full_like(sep, -100), tgt], 1).view(batch, episodes * length)
    return tokens, targets


def make_batch(args, generator: torch.Generator):
    """The batch of ``args``: single-episode MQAR (``--episodes 1``) or ``args.episodes`` episodes per sequence."""
    if args.episodes == 1:
        return mqar_batch(args.batch, args.seq, args.vocab, args.pairs, args.queries, generator)
    return mqar_episodes_batch(args.batch, args.seq, args.vocab, args.pairs, args.queries, args.episodes, generator)


def chance_loss(vocab: int) -> float:
    """Cross-entropy of a uniform guess over the values: the best a context-blind model does."""
    return math.log(vocab - vocab // 2)


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------

class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class MLP(nn.Module):
    """SwiGLU MLP."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate_up = nn.Linear(dim, 2 * hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, attn: nn.Module, dim: int, mlp_ratio: int):
        super().__init__()
        self.attn_norm, self.attn = RMSNorm(dim), attn
        self.mlp_norm, self.mlp = RMSNorm(dim), MLP(dim, mlp_ratio * dim)

    def forward(self, x):
        # kdakit's layer returns (out, final_state), FLA's (out, attentions, past_key_values)
        x = x + self.attn(self.attn_norm(x))[0]
        return x + self.mlp(self.mlp_norm(x))


def layer_config(args) -> dict:
    """Keyword arguments shared by kdakit's and FLA's ``KimiDeltaAttention``."""
    return dict(hidden_size=args.dim, head_dim=args.head_dim, num_heads=args.heads, expand_v=1,
                mode="chunk", use_short_conv=True, conv_size=4)


class TinyKDA(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, mlp_ratio: int, make_attn):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(make_attn(i), dim, mlp_ratio) for i in range(layers))
        self.norm = RMSNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens, where=None):
        """Logits ``[B, T, vocab]``, or ``[N, vocab]`` at the positions where the bool mask ``where`` is set
        (the head then runs on those positions only: at 64K tokens full logits would dwarf the layers)."""
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        if where is not None:
            x = x[where]
        return self.head(self.norm(x))


def build_model(args, impl: str = "kdakit") -> TinyKDA:
    """The model on kdakit's layer (``impl="kdakit"``) or FLA's (``impl="fla"``), seeded by ``args.seed``."""
    if impl == "kdakit":
        from kdakit.nn import KimiDeltaAttention
    else:
        from fla.layers.kda import KimiDeltaAttention
    cfg = layer_config(args)
    torch.manual_seed(args.seed)
    return TinyKDA(args.vocab, args.dim, args.layers, args.mlp_ratio,
                   lambda i: KimiDeltaAttention(layer_idx=i, **cfg))


def _cast(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    model.to(dtype)
    for name, p in model.named_parameters():  # the KDA gate parameters stay fp32 (kdakit's layer does this itself)
        if name.endswith(("A_log", "dt_bias")):
            p.data = p.data.float()
    return model


# ---------------------------------------------------------------------------------------------
# Training
# ---------------------------------------------------------------------------------------------

class Progress:
    """A plain-text progress line: rewritten in place on a terminal, otherwise a line every ``every`` steps."""

    def __init__(self, total: int, stream=None, label: str = "train", every: int | None = None):
        self.total, self.label = total, label
        self.stream = sys.stderr if stream is None else stream
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every or max(1, total // 10)
        self.t0 = time.perf_counter()

    def __call__(self, step: int, loss: float) -> None:
        done = step + 1
        if not self.tty and done % self.every and done != self.total:
            return
        width = 24
        filled = width * done // self.total
        elapsed = time.perf_counter() - self.t0
        eta = elapsed * (self.total - done) / done
        text = (f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                f"loss {loss:.3f}  {elapsed:.0f} s elapsed, {eta:.0f} s left")
        if self.tty:
            self.stream.write("\r\x1b[K" + text + ("\n" if done == self.total else ""))
        else:
            self.stream.write(text + "\n")
        self.stream.flush()


def lr_at(step: int, steps: int, lr: float, warmup: int) -> float:
    if step < warmup:
        return lr * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    return lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * t)))


def train(model: nn.Module, args, device: torch.device, label: str = "kdakit", quiet: bool = False,
          steps: int | None = None):
    """Train ``model`` for the first ``steps`` (default all ``args.steps``) steps of the ``args.steps``-step
    schedule; returns ``(losses, step_times_s)``."""
    gen = torch.Generator().manual_seed(args.seed + 1)  # the data stream (same for every impl)
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and not getattr(p, "_no_weight_decay", False)]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and not getattr(p, "_no_weight_decay", False))]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": rest, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.98))
    warmup = max(1, min(args.warmup, args.steps // 5))
    steps = args.steps if steps is None else steps
    progress = None if quiet else Progress(steps, label=f"train ({label})")
    losses, times = [], []
    model.train()
    for step in range(steps):
        tokens, targets = make_batch(args, gen)
        tokens, targets = tokens.to(device, non_blocking=True), targets.to(device, non_blocking=True)
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args.steps, args.lr, warmup)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        where = targets != -100
        loss = F.cross_entropy(model(tokens, where).float(), targets[where])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        value = loss.item()  # synchronizes
        times.append(time.perf_counter() - t0)
        if not math.isfinite(value):
            raise FloatingPointError(f"{label}: the loss is {value} at step {step}")
        losses.append(value)
        if progress:
            progress(step, value)
    return losses, times


@torch.no_grad()
def evaluate(model: nn.Module, args, device: torch.device, batches: int = 4) -> tuple[float, float]:
    """Held-out loss and query accuracy on fresh sequences (a separate seed)."""
    gen = torch.Generator().manual_seed(args.seed + 1_000_003)
    model.eval()
    total, correct, count = 0.0, 0, 0
    for _ in range(batches):
        tokens, targets = make_batch(args, gen)
        tokens, targets = tokens.to(device), targets.to(device)
        where = targets != -100
        logits, want = model(tokens, where).float(), targets[where]
        total += F.cross_entropy(logits, want, reduction="sum").item()
        correct += (logits.argmax(-1) == want).sum().item()
        count += want.numel()
    model.train()
    return total / count, correct / count


def smooth(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def write_curve(out_dir: str, losses: list[float], chance: float, title: str) -> tuple[str, str | None]:
    """Write ``loss_curve.csv`` (always) and ``loss_curve.png`` (when matplotlib is importable)."""
    os.makedirs(out_dir, exist_ok=True)
    window = max(1, len(losses) // 20)
    smoothed = smooth(losses, window)
    csv_path = os.path.join(out_dir, "loss_curve.csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["step", "loss", "loss_smoothed", "chance"])
        for i, (a, b) in enumerate(zip(losses, smoothed)):
            w.writerow([i, f"{a:.6f}", f"{b:.6f}", f"{chance:.6f}"])
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("train_tiny: matplotlib is not installed, so no PNG (the CSV has the curve); "
              "install it with: pip install -e '.[plot]'", file=sys.stderr)
        return csv_path, None
    png_path = os.path.join(out_dir, "loss_curve.png")
    fig, ax = plt.subplots(figsize=(7, 4), dpi=120)
    ax.plot(losses, color="tab:blue", alpha=0.3, lw=0.8, label="loss")
    ax.plot(smoothed, color="tab:blue", lw=1.8, label=f"loss (mean of {window})")
    ax.axhline(chance, color="tab:red", ls="--", lw=1.2, label=f"chance, log(values) = {chance:.2f}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy at query keys (nats)")
    ax.set_title(title, fontsize=9)
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)
    return csv_path, png_path


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

# The defaults that --device picks for the options left unset. CPU: about a minute on one core (the ops are
# small, so one thread is as fast and far steadier on a shared machine); two 64-token chunks, so the state
# crosses a chunk boundary; one episode (8 sequences of 16 pairs and 48 queries) per row.
#
# CUDA: one sequence of 64K tokens per step, cut into 1024 episodes of 64 tokens (a separator, 8 pairs of the
# 30 keys of vocabulary 64, 23 queries), so a step sees 1024 fresh mappings and the state runs through all of
# them: keys recur every few episodes with new values, only the current binding is right. The layer config
# (width 512, 4 heads x 128, bf16) is the one FLA's autotune cache is warmed for; only the task and lr changed.
# History: single-episode MQAR at batch 1 sees one mapping per step and stayed at chance on the H200 (256 pairs,
# vocab 1024, lr 3e-3, 150 steps: 6.275 vs 6.238, benchmarks/results/train_tiny_cuda_h200.log; 1024 pairs over
# 30 steps: train_tiny_cuda_h200_9878ce6.log), and so did its CPU analog at 2K tokens. The episode task, CPU, one
# thread, batch 1, 64-token episodes of 8 pairs, vocab 64 (chance log 32 = 3.47; final = mean of the last tenth):
#   width 64, 2 x 32, lr 1e-2: 32 episodes (2K tokens) 150 steps 0.076 (98% held-out, leaves chance ~step 45);
#     100 steps: 32 episodes 1.48, 64 episodes (4K tokens) 0.30: more episodes per step, fewer steps on the plateau
#   width 512, 4 x 128 (this layer config), 16 episodes (1K tokens), 60 steps: lr 5e-3 0.136 fp32, 0.152 bf16
#     (97% held-out); lr 1e-2 stayed at chance (3.51); 4 pairs, lr 5e-3: 0.022. With the cuda schedule (150
#     steps, lr 5e-3, 30 warm-up), bf16, only 8 episodes (512 tokens): 0.008, 100% held-out, off chance ~step 45
#     (seed 1: 0.014, 99%)
#   stayed at chance over 150 steps (width 64): 16 pairs per 64-token episode (3.47 vs 3.47; vocab 256: 4.86 vs
#     4.85), 8 pairs with vocab 256 (4.86 vs 4.85), 8 x 128-token episodes of 16 pairs at lr 2e-2 (3.46).
#   So the cuda run has the episode shape, lr and schedule that learned, with 64-128x their episodes per step.
EPISODE_TOKENS = 64  # the cuda default --episodes is seq // EPISODE_TOKENS
DEVICE_DEFAULTS = {
    "cpu": dict(seq=128, batch=8, steps=300, vocab=64, episodes=1, pairs=16, queries="fill", dim=64, heads=2,
                head_dim=32, dtype="fp32", threads=1, lr=1e-2),
    "cuda": dict(seq=65536, batch=1, steps=150, vocab=64, episodes="per64", pairs=8, queries="fill", dim=512,
                 heads=4, head_dim=128, dtype="bf16", threads=None, lr=5e-3),
}


# Steps of the FLA comparison on cuda: its median step time (after 3 warm-up steps, the first of which tunes FLA's
# kernels for the config) and its peaks settle within a few steps; the full run would double the GPU time.
FLA_STEPS = 40


def add_arguments(parser: argparse.ArgumentParser) -> None:
    cpu, cuda = DEVICE_DEFAULTS["cpu"], DEVICE_DEFAULTS["cuda"]

    def a(name, help, key=None, **kw):
        key = key or name[2:].replace("-", "_")
        if key in cpu:
            shown = {"fill": "all that fit after the pairs", None: "torch's default",
                     "per64": f"seq / {EPISODE_TOKENS}, {EPISODE_TOKENS}-token episodes"}
            help = f"{help} (default: CPU {shown.get(cpu[key], cpu[key])}, cuda {shown.get(cuda[key], cuda[key])})"
            kw["default"] = None
        parser.add_argument(name, help=help, **kw)

    a("--device", "where to train", choices=["cpu", "cuda"], default="cpu")
    a("--seq", "tokens per sequence", type=int)
    a("--batch", "sequences per step", type=int)
    a("--steps", "optimizer steps", type=int)
    a("--vocab", "vocabulary: keys in [1, vocab/2), values in [vocab/2, vocab)", type=int)
    a("--episodes", "MQAR episodes per sequence, each a separator, its own pairs and its queries (1: one "
                    "episode, no separator)", type=int)
    a("--pairs", "key-value pairs per episode", type=int)
    a("--queries", "queries per episode", type=int)
    a("--dim", "model width", type=int)
    a("--heads", "KDA heads", type=int)
    a("--head-dim", "KDA head dim", type=int)
    a("--dtype", "model dtype", choices=["fp32", "bf16"])
    a("--threads", "CPU threads", type=int)
    a("--layers", "KDA blocks (default 2)", type=int, default=2)
    a("--mlp-ratio", "MLP hidden = ratio * dim (default 2)", type=int, default=2)
    a("--lr", "peak learning rate, warm-up then cosine to a tenth", type=float)
    a("--warmup", "warm-up steps (default 40, at most steps / 5)", type=int, default=40)
    a("--weight-decay", "AdamW weight decay on matrices (default 0.1)", type=float, default=0.1)
    a("--seed", "seed of the weights and of the data (default 0)", type=int, default=0)
    a("--out", "folder for loss_curve.csv / loss_curve.png (default out/train_tiny)", default=os.path.join("out", "train_tiny"))
    a("--no-fla", "cuda: skip the comparison with FLA's layer", action="store_true")
    a("--fla-steps", f"cuda: steps of the model on FLA's layer, the first of the same schedule and data (default "
      f"{FLA_STEPS}: enough for its step time and peak memory; its loss is compared with kdakit's at that step)",
      type=int, default=FLA_STEPS)
    a("--quiet", "no progress line", action="store_true")


def resolve(args) -> argparse.Namespace:
    """Fill the options left unset from DEVICE_DEFAULTS[args.device] and check them."""
    for key, value in DEVICE_DEFAULTS[args.device].items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.episodes == "per64":
        args.episodes = max(1, args.seq // EPISODE_TOKENS)
    if not args.episodes > 0:
        raise ValueError(f"--episodes must be positive, got {args.episodes}")
    if args.queries == "fill":  # every two-token slot after the pairs holds a query
        args.queries = ((args.seq - 2 * args.pairs) // 2 if args.episodes == 1
                        else episode_slots(args.seq, args.episodes, args.pairs))
    for key in ("seq", "batch", "steps", "vocab", "pairs", "queries", "dim", "layers", "heads", "head_dim",
                "mlp_ratio", "lr"):
        if not getattr(args, key) > 0:
            raise ValueError(f"--{key.replace('_', '-')} must be positive, got {getattr(args, key)}")
    if args.threads is not None and args.threads <= 0:
        raise ValueError(f"--threads must be positive, got {args.threads}")
    if args.vocab < 4:
        raise ValueError(f"--vocab must be at least 4, got {args.vocab}")
    first_key = 1 if args.episodes == 1 else FIRST_EPISODE_KEY
    if args.pairs > args.vocab // 2 - first_key:
        raise ValueError(f"--pairs {args.pairs} needs as many distinct keys; --vocab {args.vocab} has "
                         f"{args.vocab // 2 - first_key}")
    if args.episodes > 1:
        if args.queries > episode_slots(args.seq, args.episodes, args.pairs):
            raise ValueError(f"an episode of {episode_len(args.seq, args.episodes)} tokens (--seq {args.seq} / "
                             f"--episodes {args.episodes}) holds a separator, {args.pairs} pairs and at most "
                             f"{max(0, episode_slots(args.seq, args.episodes, args.pairs))} two-token query slots, "
                             f"asked for --queries {args.queries}")
    elif args.queries > (args.seq - 2 * args.pairs) // 2:
        raise ValueError(f"--seq {args.seq} holds {args.pairs} pairs and at most {max(0, (args.seq - 2 * args.pairs) // 2)} "
                         f"two-token query slots, asked for --queries {args.queries}")
    return args


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.3f} GiB"


def _tail_mean(losses: list[float]) -> float:
    return statistics.fmean(losses[-max(1, len(losses) // 10):])


def _measure(args, impl: str, device: torch.device, dtype: torch.dtype, state=None, quiet=False,
             steps: int | None = None) -> dict:
    """Build (with ``state`` loaded when given), train (``steps`` steps: see ``train``) and measure one model;
    returns a result dict."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = _cast(build_model(args, impl), dtype).to(device)
    if state is not None:
        model.load_state_dict(state)  # the same initial weights as the first model
    t0 = time.perf_counter()
    losses, times = train(model, args, device, label=impl, quiet=quiet, steps=steps)
    res = dict(impl=impl, model=model, losses=losses, wall_s=time.perf_counter() - t0,
               step_s=statistics.median(times[min(3, len(times) - 1):]))  # the first steps compile / autotune
    cuda = device.type == "cuda"
    res.update(allocated=torch.cuda.max_memory_allocated(device) if cuda else None,
               reserved=torch.cuda.max_memory_reserved(device) if cuda else None)
    return res


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="train_tiny", description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    run(parser.parse_args(argv))
    return 0


def run(args) -> dict:
    """Train (and on cuda compare) with the options parsed by ``add_arguments``; returns a summary dict
    (``final_loss``, ``eval_loss``, ``eval_acc``, ``chance``, ``losses``, ``wall_s``, ``csv``, ``png``, and on cuda
    ``results``). Restores torch's thread count and determinism flag."""
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    try:
        return _run(resolve(args))
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)


def _run(args) -> dict:
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: no CUDA device is available (torch.cuda.is_available() is False)")
    if args.threads:
        torch.set_num_threads(args.threads)
    if device.type == "cpu":
        torch.use_deterministic_algorithms(True)
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    chance = chance_loss(args.vocab)
    n_values = args.vocab - args.vocab // 2

    probe = build_model(args, "kdakit")
    initial = {k: v.detach().clone() for k, v in _cast(probe, dtype).state_dict().items()}
    n_params = sum(p.numel() for p in probe.parameters())
    del probe
    episodes = (f"{args.episodes} episodes of {episode_len(args.seq, args.episodes)} tokens (a separator, "
                f"{args.pairs} key-value pairs + {args.queries} queries each)" if args.episodes > 1
                else f"{args.pairs} key-value pairs + {args.queries} queries")
    print(f"train_tiny: MQAR, {episodes} in {args.seq} tokens, vocab "
          f"{args.vocab}; {args.layers} x kdakit KimiDeltaAttention (dim {args.dim}, {args.heads} heads x "
          f"{args.head_dim}), {n_params / 1e6:.2f} M parameters, {args.dtype} on {device}"
          f"{f', {torch.get_num_threads()} thread(s)' if device.type == 'cpu' else ''}; batch {args.batch}, "
          f"{args.steps} steps, seed {args.seed}", flush=True)
    res = _measure(args, "kdakit", device, dtype, quiet=args.quiet)
    final = _tail_mean(res["losses"])
    eval_loss, eval_acc = evaluate(res.pop("model"), args, device, batches=1 if device.type == "cuda" else 4)
    print(f"train_tiny: trained in {res['wall_s']:.1f} s; final loss {final:.3f} (mean of the last "
          f"{max(1, len(res['losses']) // 10)} steps), held-out {eval_loss:.3f} with query accuracy {eval_acc:.1%}; "
          f"chance = log({n_values} values) = {chance:.3f} (log(vocab) = {math.log(args.vocab):.3f})")
    csv_path, png_path = write_curve(
        args.out, res["losses"], chance,
        f"kdakit KDA, MQAR {args.pairs} pairs{f' x {args.episodes} episodes' if args.episodes > 1 else ''} in {args.seq} "
        f"tokens, {args.layers} layers d{args.dim}, seed {args.seed}")
    print(f"train_tiny: wrote {csv_path}" + (f" and {png_path}" if png_path else ""), flush=True)
    summary = dict(final_loss=final, eval_loss=eval_loss, eval_acc=eval_acc, chance=chance, losses=res["losses"],
                   wall_s=res["wall_s"], csv=csv_path, png=png_path)
    if device.type == "cuda":
        summary["results"] = _compare_fla(args, device, dtype, res, initial)
    return summary


def _compare_fla(args, device, dtype, res, initial) -> list[dict]:
    results = [res]
    if args.no_fla:
        print("train_tiny: --no-fla: not comparing with FLA's layer")
    else:
        try:
            importlib.import_module("fla.layers.kda")
        except Exception as exc:  # ImportError, or FLA failing to import on this setup
            print(f"train_tiny: FLA comparison skipped: fla.layers.kda is not importable ({type(exc).__name__}: "
                  f"{exc}); install FLA (pip install flash-linear-attention, which holds fla.layers) to compare")
        else:
            try:
                fla_res = _measure(args, "fla", device, dtype, state=initial, quiet=args.quiet,
                                   steps=min(args.fla_steps, args.steps))
                fla_res.pop("model")
                results.append(fla_res)
            except Exception as exc:
                print(f"train_tiny: FLA comparison failed: {type(exc).__name__}: {exc}")
    print(f"\ntrain_tiny: B={args.batch} T={args.seq} {args.dtype}, {args.layers} layers d{args.dim} "
          f"({args.heads} heads x {args.head_dim}), same initial weights and data; median step time after 3 warm-up "
          f"steps, peaks over the whole run (weights, AdamW state, activations)")
    common = min(len(r["losses"]) for r in results)  # each loss at the last step all the runs reached
    head = f"loss @ {common}"
    print(f"{'layer':8} {'steps':>6} {'step time':>11} {'peak allocated':>15} {'peak reserved':>14} {head:>12} "
          f"{'final loss':>11}")
    for r in results:
        r["loss_at_common_step"] = statistics.fmean(r["losses"][max(0, common - 5):common])
        print(f"{r['impl']:8} {len(r['losses']):6d} {r['step_s'] * 1e3:8.1f} ms {_gib(r['allocated']):>15} "
              f"{_gib(r['reserved']):>14} {r['loss_at_common_step']:12.3f} {_tail_mean(r['losses']):11.3f}")
    print(f"(loss @ {common}: the mean of steps {max(0, common - 5) + 1}-{common}, the same data for every run)")
    return results


if __name__ == "__main__":
    sys.exit(main())
