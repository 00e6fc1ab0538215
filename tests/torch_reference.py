#!/usr/bin/python3
"""Independent check of the C++ GPT-2 against a plain PyTorch GPT-2.

Runs the dump tool (tests/dump_reference.cpp), which writes a tiny model's weights, logits,
loss and gradients to HDF5; loads the weights into the GPT-2 defined below, recomputes the
logits, the mean cross-entropy loss and its gradients, and compares. Exits non-zero on any
mismatch.
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


class CausalSelfAttention(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.n_head = n_head
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)

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
    def __init__(self, d_model):
        super().__init__()
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.proj = nn.Linear(4 * d_model, d_model)

    def forward(self, x):
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))


class Block(nn.Module):
    def __init__(self, d_model, n_head):
        super().__init__()
        self.ln1 = nn.LayerNorm(d_model, eps=1e-5)
        self.attn = CausalSelfAttention(d_model, n_head)
        self.ln2 = nn.LayerNorm(d_model, eps=1e-5)
        self.mlp = MLP(d_model)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT2(nn.Module):
    def __init__(self, vocab_size, seq_len, n_layer, n_head, d_model):
        super().__init__()
        self.wte = nn.Embedding(vocab_size, d_model)
        self.wpe = nn.Embedding(seq_len, d_model)
        self.h = nn.ModuleList(Block(d_model, n_head) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(d_model, eps=1e-5)

    def forward(self, idx):
        T = idx.shape[1]
        x = self.wte(idx) + self.wpe(torch.arange(T))
        for block in self.h:
            x = block(x)
        return self.ln_f(x) @ self.wte.weight.T  # LM head tied to the token embedding


def rel_error(ours, ref):
    """max|a-b| / max|b|, and whether it is within REL_TOL * max|b| + ABS_TOL."""
    err = float(np.max(np.abs(ours - ref)))
    scale = float(np.max(np.abs(ref)))
    return err / max(scale, 1e-30), err <= REL_TOL * scale + ABS_TOL


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dump-tool", required=True)
    ap.add_argument("--work-dir", required=True)
    args = ap.parse_args()
    torch.set_num_threads(2)

    os.makedirs(args.work_dir, exist_ok=True)
    path = os.path.join(args.work_dir, "reference.h5")
    subprocess.run([args.dump_tool, path], check=True)

    with h5py.File(path, "r") as f:
        keys = ("vocab_size", "seq_len", "n_layer", "n_head", "d_model")
        dims = {k: int(f.attrs[k]) for k in keys}
        params = {k: np.asarray(v) for k, v in f["params"].items()}
        grads = {k: np.asarray(v) for k, v in f["grads"].items()}
        tokens = np.asarray(f["reference/tokens"]).astype(np.int64)
        targets = np.asarray(f["reference/targets"]).astype(np.int64)
        ref_logits = np.asarray(f["reference/logits"])
        ref_loss = np.asarray(f["reference/loss"])

    model = GPT2(**dims).float()
    state = model.state_dict()
    if set(state) != set(params):
        sys.exit(f"parameter names differ: torch-only {sorted(set(state) - set(params))}, "
                 f"dump-only {sorted(set(params) - set(state))}")
    model.load_state_dict({k: torch.from_numpy(v) for k, v in params.items()}, strict=True)

    idx = torch.from_numpy(tokens)
    logits = model(idx)
    loss = F.cross_entropy(logits.view(-1, dims["vocab_size"]), torch.from_numpy(targets).view(-1))
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
        print(f"{group:8s} worst rel error {worst:.3e} ({worst_name}) {status}")
        for msg in failed:
            print(f"  FAIL {msg}")
        ok = ok and not failed

    # "ours" is the C++ dump, "ref" is PyTorch.
    report("logits", [("logits", ref_logits, logits.detach().numpy())])
    report("loss", [("loss", ref_loss, np.array([loss.item()], dtype=np.float32))])
    named = dict(model.named_parameters())
    report("grads", [(k, grads[k], named[k].grad.numpy()) for k in sorted(grads)])

    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
