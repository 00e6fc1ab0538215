#!/usr/bin/python3
"""PyTorch baseline for bench/run.sh: a nanoGPT-style GPT-2 training step on the W-S / W-M
workloads, or a Llama one (Meta's model.py: RMSNorm, complex rotary embeddings, repeated K/V
for grouped-query attention, SwiGLU, untied head) on W-L (fp32, forward + backward + clip +
AdamW, random tokens), printed as one JSON line with the same fields and FLOP count as
build/bench/trainer_bench.

Written for Debian's python3-torch 1.13 (no F.scaled_dot_product_attention, no torch.compile).
Run it through bench/run.sh, which selects the OpenMP OpenBLAS and its kernels.
"""
import argparse
import ctypes
import json
import math
import os
import resource
import statistics
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

WORKLOADS = {
    # name: (n_layer, n_head, d_model, seq_len, batch, default warm-up, default timed steps)
    "W-S": (6, 6, 384, 256, 4, 2, 5),
    "W-M": (12, 12, 768, 1024, 1, 1, 3),
    "W-L": (12, 12, 768, 1024, 1, 1, 3),  # a 125M Llama
}
LLAMA = {"W-L": (4, 2048, 32000)}  # n_kv_head, ffn_hidden, vocabulary
VOCAB = 50257  # GPT-2's


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention and a GELU(tanh) MLP."""

    def __init__(self, n_head, d_model, seq_len, attn):
        super().__init__()
        self.n_head, self.attn = n_head, attn
        self.ln_1 = nn.LayerNorm(d_model)
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.ln_2 = nn.LayerNorm(d_model)
        self.c_fc = nn.Linear(d_model, 4 * d_model)
        self.mlp_proj = nn.Linear(4 * d_model, d_model)
        # Additive causal mask (0 on and below the diagonal, -inf above), built once.
        mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def attention(self, x):
        """Causal multi-head self-attention as matmul + masked softmax + matmul."""
        B, T, C = x.shape
        nh, hs = self.n_head, C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, nh, hs).transpose(1, 2)  # (B, nh, T, hs)
        k = k.view(B, T, nh, hs).transpose(1, 2)
        v = v.view(B, T, nh, hs).transpose(1, 2)
        scale = 1.0 / math.sqrt(hs)
        if self.attn == "sdpa":  # 1.13's private math path
            y, _ = F._scaled_dot_product_attention(q, k, v, is_causal=True)
        elif self.attn == "baddbmm":  # scale and mask fused into the QK^T GEMM
            q = q.reshape(B * nh, T, hs)
            k = k.reshape(B * nh, T, hs)
            att = torch.baddbmm(self.mask[:T, :T], q, k.transpose(1, 2), alpha=scale)
            y = torch.bmm(att.softmax(dim=-1), v.reshape(B * nh, T, hs)).view(B, nh, T, hs)
        else:  # nanoGPT's manual formulation
            att = (q @ k.transpose(-2, -1)) * scale
            att = att + self.mask[:T, :T]
            y = att.softmax(dim=-1) @ v
        y = y.transpose(1, 2).reshape(B, T, C)
        return self.c_proj(y)

    def forward(self, x):
        x = x + self.attention(self.ln_1(x))
        return x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))


class GPT(nn.Module):
    """GPT-2 with tied token embedding / LM head; vocab rows optionally padded (nanoGPT)."""

    def __init__(self, n_layer, n_head, d_model, seq_len, vocab, attn):
        super().__init__()
        self.wte = nn.Embedding(vocab, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.blocks = nn.ModuleList(Block(n_head, d_model, seq_len, attn) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model)
        self.lm_head = nn.Linear(d_model, vocab, bias=False)
        self.lm_head.weight = self.wte.weight
        for name, p in self.named_parameters():
            if p.dim() == 2:
                std = 0.02 / math.sqrt(2 * n_layer) if name.endswith("proj.weight") else 0.02
                nn.init.normal_(p, 0.0, std)
            elif "ln" not in name:
                nn.init.zeros_(p)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe.weight[:T]
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


class RMSNorm(nn.Module):
    def __init__(self, dim, eps=1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary(x, freqs_cis):
    xc = torch.view_as_complex(x.reshape(*x.shape[:-1], -1, 2))
    return torch.view_as_real(xc * freqs_cis).flatten(3)


class LlamaBlock(nn.Module):
    def __init__(self, n_head, n_kv, d_model, ffn, seq_len):
        super().__init__()
        self.n_head, self.n_kv, self.hs = n_head, n_kv, d_model // n_head
        self.attention_norm, self.ffn_norm = RMSNorm(d_model), RMSNorm(d_model)
        self.wq = nn.Linear(d_model, d_model, bias=False)
        self.wk = nn.Linear(d_model, n_kv * self.hs, bias=False)
        self.wv = nn.Linear(d_model, n_kv * self.hs, bias=False)
        self.wo = nn.Linear(d_model, d_model, bias=False)
        self.w1 = nn.Linear(d_model, ffn, bias=False)
        self.w3 = nn.Linear(d_model, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d_model, bias=False)
        mask = torch.full((seq_len, seq_len), float("-inf")).triu(1)
        self.register_buffer("mask", mask, persistent=False)

    def forward(self, x, freqs_cis):
        B, T, C = x.shape
        h = self.attention_norm(x)
        q = rotary(self.wq(h).view(B, T, self.n_head, self.hs), freqs_cis)
        k = rotary(self.wk(h).view(B, T, self.n_kv, self.hs), freqs_cis)
        v = self.wv(h).view(B, T, self.n_kv, self.hs)
        rep = self.n_head // self.n_kv
        k, v = k.repeat_interleave(rep, dim=2), v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2).reshape(B * self.n_head, T, self.hs) for t in (q, k, v))
        att = torch.baddbmm(self.mask[:T, :T], q, k.transpose(1, 2), alpha=self.hs ** -0.5)
        y = torch.bmm(att.softmax(dim=-1), v).view(B, self.n_head, T, self.hs)
        x = x + self.wo(y.transpose(1, 2).reshape(B, T, C))
        h = self.ffn_norm(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Llama(nn.Module):
    def __init__(self, n_layer, n_head, n_kv, d_model, ffn, seq_len, vocab):
        super().__init__()
        self.tok_embeddings = nn.Embedding(vocab, d_model)
        self.layers = nn.ModuleList(
            LlamaBlock(n_head, n_kv, d_model, ffn, seq_len) for _ in range(n_layer))
        self.norm = RMSNorm(d_model)
        self.output = nn.Linear(d_model, vocab, bias=False)
        hs = d_model // n_head
        freqs = 1.0 / (10000.0 ** (torch.arange(0, hs, 2).float() / hs))
        angles = torch.outer(torch.arange(seq_len).float(), freqs)
        self.freqs_cis = torch.polar(torch.ones_like(angles), angles).view(1, seq_len, 1, -1)
        for name, p in self.named_parameters():
            if p.dim() == 2:
                nn.init.normal_(p, 0.0, 0.02)

    def forward(self, idx, targets):
        T = idx.shape[1]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, self.freqs_cis[:, :T])
        logits = self.output(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))


def matmul_params(model, vocab, d_model):
    """The weights of matrix multiplies, as trainer counts them (model/param_table.h): the
    blocks' 2-D weights and the tied head once, its vocab unpadded."""
    n = sum(p.numel() for name, p in model.named_parameters() if p.dim() == 2)
    if isinstance(model, Llama):  # the untied head counts, the embedding does not
        n -= model.tok_embeddings.weight.numel()
        return n - (model.output.weight.shape[0] - vocab) * d_model
    n -= model.wpe.weight.numel()
    n -= (model.wte.weight.shape[0] - vocab) * d_model
    return n


def matmul_peak(n=1536, repeats=10):
    """Best FLOP/s of an n x n fp32 matmul (first run is warm-up), as trainer's sgemm peak."""
    a, b = torch.full((n, n), 0.5), torch.full((n, n), 0.25)
    best = math.inf
    for r in range(repeats + 1):
        t0 = time.perf_counter()
        torch.mm(a, b)
        s = time.perf_counter() - t0
        if r > 0:
            best = min(best, s)
    return 2.0 * n**3 / best


def mapped_library(fragment):
    """Path of the first shared library mapped into this process whose path has `fragment`."""
    with open("/proc/self/maps") as maps:
        paths = sorted({line.split()[-1] for line in maps if fragment in line and "/" in line})
    return paths[0] if paths else "none"


def openblas_core(path):
    """OpenBLAS's kernel set ("SkylakeX", "Prescott", ...) of the library at `path`."""
    try:
        core = ctypes.CDLL(path).openblas_get_corename
    except (OSError, AttributeError):
        return "unknown"
    core.restype = ctypes.c_char_p
    return core().decode()


def cpu_sample():
    """(wall, machine busy + stolen CPU seconds, this process's CPU seconds)."""
    with open("/proc/stat") as stat:
        user, nice, system, _, _, irq, softirq, steal = map(int, stat.readline().split()[1:9])
    machine = (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return time.perf_counter(), machine, t.user + t.system


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workload", choices=WORKLOADS, default="W-S")
    ap.add_argument("--warmup", type=int, default=None)
    ap.add_argument("--steps", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=1337)
    ap.add_argument("--peak-gflops", type=float, default=None,
                    help="MFU denominator (e.g. trainer's sgemm peak); default: torch's own")
    ap.add_argument("--attn", choices=["baddbmm", "manual", "sdpa"], default="baddbmm")
    ap.add_argument("--pad-vocab", type=int, default=64,
                    help="round the embedding rows up to this multiple (1: no padding)")
    ap.add_argument("--foreach", type=int, choices=[0, 1], default=0,
                    help="AdamW's multi-tensor implementation (measured no faster on CPU)")
    args = ap.parse_args()
    if args.steps is not None and args.steps < 1:
        ap.error("--steps must be at least 1")

    L, NH, C, T, B, warmup, steps = WORKLOADS[args.workload]
    warmup = warmup if args.warmup is None else args.warmup
    steps = steps if args.steps is None else args.steps
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)

    vocab = LLAMA[args.workload][2] if args.workload in LLAMA else VOCAB
    vocab_rows = (vocab + args.pad_vocab - 1) // args.pad_vocab * args.pad_vocab
    if args.workload in LLAMA:
        n_kv, ffn, _ = LLAMA[args.workload]
        model = Llama(L, NH, n_kv, C, ffn, T, vocab_rows)
        embedding = model.tok_embeddings.weight
    else:
        model = GPT(L, NH, C, T, vocab_rows, args.attn)
        embedding = model.wte.weight
    decay = [p for p in model.parameters() if p.dim() == 2 and p is not embedding]
    no_decay = [p for p in model.parameters() if p.dim() != 2 or p is embedding]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=3e-4, betas=(0.9, 0.95), eps=1e-8, foreach=bool(args.foreach))
    idx = torch.randint(0, vocab, (B, T))
    targets = torch.randint(0, vocab, (B, T))

    torch_peak = matmul_peak()
    peak = args.peak_gflops * 1e9 if args.peak_gflops else torch_peak
    n_params = matmul_params(model, vocab, C)
    flops_per_token = 6.0 * n_params + 6.0 * L * C * T  # causal attention, as trainer counts

    times, fwd, bwd, upd = [], [], [], []
    for step in range(warmup + steps):
        if step == warmup:
            cpu0 = cpu_sample()
        t_step = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = model(idx, targets)
        if step == 0:
            first_loss = loss.item()
        t_fwd = time.perf_counter()
        loss.backward()
        t_bwd = time.perf_counter()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        t_end = time.perf_counter()
        if step >= warmup:
            times.append(t_end - t_step)
            fwd.append(t_fwd - t_step)
            bwd.append(t_bwd - t_fwd)
            upd.append(t_end - t_bwd)

    cpu1 = cpu_sample()
    self_cores = (cpu1[2] - cpu0[2]) / (cpu1[0] - cpu0[0])
    other_cores = max(0.0, (cpu1[1] - cpu0[1]) / (cpu1[0] - cpu0[0]) - self_cores)
    step_s = statistics.median(times)
    tokens_per_s = B * T / step_s
    blas_lib = mapped_library("libblas.so")
    out = {
        "framework": "pytorch",
        "workload": args.workload,
        "tokens_per_s": tokens_per_s,
        "ms_per_step": step_s * 1e3,
        "mfu": flops_per_token * tokens_per_s / peak,
        # PaLM's count: attention's full T x T square, 12 L C T a token (see trainer_bench).
        "mfu_palm": (flops_per_token + 6.0 * L * C * T) * tokens_per_s / peak,
        "peak_gflops": peak / 1e9,
        "flops_per_token": flops_per_token,
        "matmul_params": n_params,
        "threads": torch.get_num_threads(),
        "blas_core": openblas_core(blas_lib),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
        "batch": B,
        "seq_len": T,
        "warmup": warmup,
        "steps": steps,
        "forward_ms": statistics.median(fwd) * 1e3,
        "backward_ms": statistics.median(bwd) * 1e3,
        "optimizer_ms": statistics.median(upd) * 1e3,
        "first_loss": first_loss,
        "final_loss": loss.item(),
        "self_cpu_cores": self_cores,
        "other_cpu_cores": other_cores,
        "torch_peak_gflops": torch_peak / 1e9,
        "mfu_vs_torch_peak": flops_per_token * tokens_per_s / torch_peak,
        "torch_version": torch.__version__,
        "blas_lib": blas_lib,
        "attn": args.attn,
        "vocab_rows": vocab_rows,
        "foreach": bool(args.foreach),
        "malloc": mapped_library("jemalloc"),
        "malloc_conf": os.environ.get("MALLOC_CONF", ""),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
