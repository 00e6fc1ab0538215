#!/usr/bin/python3
"""Independent check of the C++ models against plain PyTorch ones.

For each variant (GPT-2 with a tied head, and with an untied head and no biases; Llama with grouped-query attention, an
untied head and Llama 3.1 rotary scaling; Llama with one key/value head and a tied head) runs
the dump tool (tests/dump_reference.cpp), which writes a tiny model's weights, logits, loss and
gradients to HDF5; loads the weights into the model defined below (Llama written after Meta's
reference model.py: complex rotary embeddings, repeated K/V), recomputes the logits, the mean
cross-entropy loss and its gradients, and compares. Exits non-zero on any mismatch.
"""
import argparse
import math
import os
import subprocess
import sys

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

# Both sides compute in fp32 but sum in different orders (OpenBLAS vs. PyTorch's kernels,
# fused vs. unfused softmax/LayerNorm), so results differ by a few ulps amplified through
# the network: at most about 1.5e-6 relative here. 1e-4 relative to the tensor's largest
# magnitude leaves ample room for that while still catching real errors: a wrong index or a
# transposed weight shows up at 1e-2 or more, an exact instead of tanh GELU or a LayerNorm
# eps of 1e-6 at 1e-4 to 1e-3. The 1e-7 absolute term only matters for all-zero tensors.
REL_TOL = 1e-4
ABS_TOL = 1e-7


def layer_norm(d_model, bias):
    ln = nn.LayerNorm(d_model, eps=1e-5)
    if not bias:
        ln.register_parameter("bias", None)
    return ln


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head, bias):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model, bias=bias)
        self.proj = nn.Linear(d_model, d_model, bias=bias)

    def forward(self, x):
        B, T, C = x.shape
        hs = C // self.n_head
        q, k, v = self.qkv(x).split(C, dim=2)
        # Head h owns columns h*hs:(h+1)*hs of each of q, k and v.
        q, k, v = (t.view(B, T, self.n_head, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(hs)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        y = (att @ v).transpose(1, 2).reshape(B, T, C)
        return self.proj(y)


class MLP(nn.Module):
    def __init__(self, d_model, bias):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model, bias=bias)
        self.proj = nn.Linear(4 * d_model, d_model, bias=bias)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model, n_head, bias):
        super().__init__()
        self.ln1 = layer_norm(d_model, bias)
        self.attn = CausalSelfAttention(d_model, n_head, bias)
        self.ln2 = layer_norm(d_model, bias)
        self.mlp = MLP(d_model, bias)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.wte = nn.Embedding(a["vocab_size"], a["d_model"])
        self.wpe = nn.Embedding(a["seq_len"], a["d_model"])
        bias = bool(a["bias"])
        self.h = nn.ModuleList(Block(a["d_model"], a["n_head"], bias) for _ in range(a["n_layer"]))
        self.ln_f = layer_norm(a["d_model"], bias)
        self.tied = bool(a["tie_embeddings"])
        if not self.tied:
            self.lm_head = nn.Linear(a["d_model"], a["vocab_size"], bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x)
        x = self.ln_f(x)
        return x @ self.wte.weight.T if self.tied else self.lm_head(x)


# --- Llama, after Meta's llama/model.py ----------------------------------------------------


def rope_frequencies(a):
    """Meta's precompute_freqs_cis frequencies, with Llama 3.1's apply_scaling."""
    hs = a["d_model"] // a["n_head"]
    freqs = [1.0 / (a["rope_theta"] ** (i / hs)) for i in range(0, hs, 2)]
    factor = a["rope_scaling_factor"]
    if factor <= 0:
        return torch.tensor(freqs, dtype=torch.float64)
    low, high = a["rope_low_freq_factor"], a["rope_high_freq_factor"]
    old = a["rope_original_max_pos"]
    scaled = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < old / high:
            scaled.append(f)
        elif wavelen > old / low:
            scaled.append(f / factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            scaled.append((1 - smooth) * f / factor + smooth * f)
    return torch.tensor(scaled, dtype=torch.float64)


def apply_rotary_emb(x, freqs_cis):
    """x (B, T, H, hs): pairs (x[2i], x[2i+1]) as complex numbers, times e^(i t f)."""
    xc = torch.view_as_complex(x.float().reshape(*x.shape[:-1], -1, 2))
    out = torch.view_as_real(xc * freqs_cis.view(1, x.shape[1], 1, -1)).flatten(3)
    return out.type_as(x)


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class LlamaAttention(nn.Module):
    def __init__(self, a):
        super().__init__()
        C = a["d_model"]
        self.n_head, self.n_kv = a["n_head"], a["n_kv_head"]
        self.hs = C // self.n_head
        self.wq = nn.Linear(C, self.n_head * self.hs, bias=False)
        self.wk = nn.Linear(C, self.n_kv * self.hs, bias=False)
        self.wv = nn.Linear(C, self.n_kv * self.hs, bias=False)
        self.wo = nn.Linear(self.n_head * self.hs, C, bias=False)

    def forward(self, x, freqs_cis):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_head, self.hs)
        k = self.wk(x).view(B, T, self.n_kv, self.hs)
        v = self.wv(x).view(B, T, self.n_kv, self.hs)
        q, k = apply_rotary_emb(q, freqs_cis), apply_rotary_emb(k, freqs_cis)
        rep = self.n_head // self.n_kv  # Meta's repeat_kv: query head h uses kv head h // rep
        k = k.repeat_interleave(rep, dim=2)
        v = v.repeat_interleave(rep, dim=2)
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-2, -1)) / math.sqrt(self.hs)
        mask = torch.ones(T, T, dtype=torch.bool).tril()
        att = att.masked_fill(~mask, float("-inf")).softmax(dim=-1)
        return self.wo((att @ v).transpose(1, 2).reshape(B, T, -1))


class FeedForward(nn.Module):
    def __init__(self, a):
        super().__init__()
        C, F_ = a["d_model"], a["ffn_hidden"]
        self.w1 = nn.Linear(C, F_, bias=False)
        self.w2 = nn.Linear(F_, C, bias=False)
        self.w3 = nn.Linear(C, F_, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LlamaBlock(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.attention = LlamaAttention(a)
        self.feed_forward = FeedForward(a)
        self.attention_norm = RMSNorm(a["d_model"], a["norm_eps"])
        self.ffn_norm = RMSNorm(a["d_model"], a["norm_eps"])

    def forward(self, x, freqs_cis):
        h = x + self.attention(self.attention_norm(x), freqs_cis)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    def __init__(self, a):
        super().__init__()
        self.tok_embeddings = nn.Embedding(a["vocab_size"], a["d_model"])
        self.layers = nn.ModuleList(LlamaBlock(a) for _ in range(a["n_layer"]))
        self.norm = RMSNorm(a["d_model"], a["norm_eps"])
        self.tied = bool(a["tie_embeddings"])
        if not self.tied:
            self.output = nn.Linear(a["d_model"], a["vocab_size"], bias=False)
        angles = torch.outer(torch.arange(a["seq_len"], dtype=torch.float64), rope_frequencies(a))
        self.freqs_cis = torch.polar(torch.ones_like(angles), angles).to(torch.complex64)

    def forward(self, idx):
        T = idx.shape[1]
        h = self.tok_embeddings(idx)
        for layer in self.layers:
            h = layer(h, self.freqs_cis[:T])
        h = self.norm(h)
        return h @ self.tok_embeddings.weight.T if self.tied else self.output(h)


VARIANTS = ("gpt2", "gpt2-untied", "llama", "llama-mqa-tied")


def rel_error(ours, ref):
    """max|a-b| / max|b|, and whether it is within REL_TOL * max|b| + ABS_TOL."""
    err = float(np.max(np.abs(ours - ref)))
    scale = float(np.max(np.abs(ref)))
    return err / max(scale, 1e-30), err <= REL_TOL * scale + ABS_TOL


def check(dump_tool, work_dir, variant):
    """Runs one variant; returns whether it matched."""
    path = os.path.join(work_dir, f"reference-{variant}.h5")
    subprocess.run([dump_tool, path, variant], check=True)

    with h5py.File(path, "r") as f:
        a = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in f.attrs.items()}
        a = {k: (v if isinstance(v, str) else v.item() if hasattr(v, "item") else v)
             for k, v in a.items()}
        params = {k: np.asarray(v) for k, v in f["params"].items()}
        grads = {k: np.asarray(v) for k, v in f["grads"].items()}
        tokens = np.asarray(f["reference/tokens"]).astype(np.int64)
        targets = np.asarray(f["reference/targets"]).astype(np.int64)
        ref_logits = np.asarray(f["reference/logits"])
        ref_loss = np.asarray(f["reference/loss"])

    for k in ("vocab_size", "seq_len", "n_layer", "n_head", "d_model", "n_kv_head",
              "ffn_hidden", "rope_original_max_pos", "tie_embeddings", "bias"):
        a[k] = int(a[k])
    model = (Llama(a) if a["arch"] == "llama" else GPT2(a)).float()
    state = model.state_dict()
    if set(state) != set(params):
        sys.exit(f"{variant}: parameter names differ: torch-only {sorted(set(state) - set(params))}, "
                 f"dump-only {sorted(set(params) - set(state))}")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=True)

    idx = torch.from_numpy(tokens)
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, a["vocab_size"]), torch.from_numpy(targets).view(-1))
    model.zero_grad()
    loss.backward()

    ok = True

    def report(group, pairs):
        nonlocal ok
        worst, worst_name, failed = 0.0, "", []
        for name, ours, ref in pairs:
            if ours.shape != ref.shape:
                failed.append(f"{name} shape {ours.shape} vs {ref.shape}")
                continue
            rel, good = rel_error(ours, ref)
            if rel >= worst:
                worst, worst_name = rel, name
            if not good:
                failed.append(f"{name} rel {rel:.3e}")
        status = "ok" if not failed else "FAIL"
        print(f"{variant:15s} {group:8s} worst rel error {worst:.3e} ({worst_name}) {status}")
        for msg in failed:
            print(f"  FAIL {msg}")
        ok = ok and not failed

    # "ours" is the C++ dump, "ref" is PyTorch.
    report("logits", [("logits", ref_logits, logits.detach().numpy())])
    report("loss", [("loss", ref_loss, np.array([loss.item()], dtype=np.float32))])
    named = dict(model.named_parameters())
    report("grads", [(k, grads[k], named[k].grad.numpy()) for k in sorted(grads)])
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dump-tool", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--variant", choices=VARIANTS, action="append")
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.work_dir, exist_ok=True)
    results = [check(args.dump_tool, args.work_dir, v) for v in (args.variant or VARIANTS)]
    ok = all(results)
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
