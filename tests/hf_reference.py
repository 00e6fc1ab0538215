#!/usr/bin/python3
"""Independent check of `trainer export --format hf`: PyTorch models written in Hugging Face
transformers' conventions (GPT2LMHeadModel: Conv1D weights (in, out), gelu_new; LlamaForCausalLM:
q/k/v/o and gate/up/down projections, rotary embeddings on the two halves of each head
(rotate_half) with the llama3 frequency scaling as transformers computes it, repeat_kv) load the
directory our exporter writes (config.json, model.safetensors or its shards and index) and
compute the logits of the dump tool's tokens, which must equal the C++ model's.

For each variant the dump tool (tests/dump_reference.cpp) writes a tiny model's weights and
logits to HDF5 and the same weights in transformers' layout to a directory. The safetensors
files are read by tests/safetensors_tool.py (struct, json, numpy), not by the trainer's code or
the `safetensors` package. Exits non-zero on any mismatch.
"""
import argparse
import json
import math
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import safetensors_tool  # noqa: E402

# Both sides compute in fp32, summing in different orders: about 1e-6 of the largest logit.
REL_TOL = 1e-5
VARIANTS = ["gpt2", "gpt2-untied", "llama", "llama-mqa-tied"]


def load_hf_dir(path):
    """The state dict of a transformers model directory: model.safetensors or the shards its
    index names."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    state = {}
    for name in files:
        _, _, _, tensors, _ = safetensors_tool.read(os.path.join(path, name))
        for key, (dtype, shape, raw) in tensors.items():
            assert dtype == "F32", f"{key}: {dtype}"
            state[key] = torch.from_numpy(np.frombuffer(raw, dtype="<f4").reshape(shape).copy())
    return state


# --- GPT2LMHeadModel's layout ------------------------------------------------------------------


class Conv1D(nn.Module):
    """transformers' Conv1D: y = x W + b with W stored (in, out)."""

    def __init__(self, n_out, n_in):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_in, n_out))
        self.bias = nn.Parameter(torch.zeros(n_out))

    def forward(self, x):
        return x @ self.weight + self.bias


def gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x.pow(3))))


class GPT2Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.n_head, self.n_embd = c["n_head"], c["n_embd"]
        self.c_attn = Conv1D(3 * self.n_embd, self.n_embd)
        self.c_proj = Conv1D(self.n_embd, self.n_embd)

    def forward(self, x):
        B, T, C = x.shape
        hd = C // self.n_head
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, hd).transpose(1, 2) for t in (q, k, v))
        w = (q @ k.transpose(-1, -2)) / math.sqrt(hd)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min).softmax(-1)
        return self.c_proj((w @ v).transpose(1, 2).reshape(B, T, C))


class GPT2MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        inner = c["n_inner"] or 4 * c["n_embd"]
        self.c_fc = Conv1D(inner, c["n_embd"])
        self.c_proj = Conv1D(c["n_embd"], inner)

    def forward(self, x):
        return self.c_proj(gelu_new(self.c_fc(x)))


class GPT2Block(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.ln_1 = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])
        self.attn = GPT2Attention(c)
        self.ln_2 = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])
        self.mlp = GPT2MLP(c)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT2Transformer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.wte = nn.Embedding(c["vocab_size"], c["n_embd"])
        self.wpe = nn.Embedding(c["n_positions"], c["n_embd"])
        self.h = nn.ModuleList(GPT2Block(c) for _ in range(c["n_layer"]))
        self.ln_f = nn.LayerNorm(c["n_embd"], eps=c["layer_norm_epsilon"])


class GPT2LMHeadModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.transformer = GPT2Transformer(c)
        self.tied = c["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(c["n_embd"], c["vocab_size"], bias=False)

    def forward(self, idx):
        t = self.transformer
        x = t.wte(idx) + t.wpe(torch.arange(idx.shape[1]))
        for block in t.h:
            x = block(x)
        x = t.ln_f(x)
        return x @ t.wte.weight.T if self.tied else self.lm_head(x)


# --- LlamaForCausalLM's layout -----------------------------------------------------------------


def llama_inv_freq(c):
    """transformers' default rotary frequencies, with its llama3 scaling when configured."""
    hd = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    inv_freq = 1.0 / (c["rope_theta"] ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    s = c.get("rope_scaling")
    if not s:
        return inv_freq
    assert s["rope_type"] == "llama3", s
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old / low, old / high
    wavelen = 2 * math.pi / inv_freq
    inv_freq_llama = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * inv_freq_llama / factor + smooth * inv_freq_llama
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, inv_freq_llama)


def rotate_half(x):
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2:]
    return torch.cat((-x2, x1), dim=-1)


class LlamaRMSNorm(nn.Module):
    def __init__(self, n, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(n))
        self.eps = eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LlamaAttention(nn.Module):
    def __init__(self, c):
        super().__init__()
        C = c["hidden_size"]
        self.h, self.kv = c["num_attention_heads"], c["num_key_value_heads"]
        self.hd = c.get("head_dim") or C // self.h
        self.q_proj = nn.Linear(C, self.h * self.hd, bias=False)
        self.k_proj = nn.Linear(C, self.kv * self.hd, bias=False)
        self.v_proj = nn.Linear(C, self.kv * self.hd, bias=False)
        self.o_proj = nn.Linear(self.h * self.hd, C, bias=False)

    def forward(self, x, cos, sin):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.hd).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        q, k = q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
        rep = self.h // self.kv  # repeat_kv
        k = k[:, :, None].expand(B, self.kv, rep, T, self.hd).reshape(B, self.h, T, self.hd)
        v = v[:, :, None].expand(B, self.kv, rep, T, self.hd).reshape(B, self.h, T, self.hd)
        w = (q @ k.transpose(-1, -2)) / math.sqrt(self.hd)
        mask = torch.tril(torch.ones(T, T, dtype=torch.bool))
        w = w.masked_fill(~mask, torch.finfo(w.dtype).min).softmax(-1)
        return self.o_proj((w @ v).transpose(1, 2).reshape(B, T, self.h * self.hd))


class LlamaMLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, I = c["hidden_size"], c["intermediate_size"]
        self.gate_proj = nn.Linear(C, I, bias=False)
        self.up_proj = nn.Linear(C, I, bias=False)
        self.down_proj = nn.Linear(I, C, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.input_layernorm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.self_attn = LlamaAttention(c)
        self.post_attention_layernorm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])
        self.mlp = LlamaMLP(c)

    def forward(self, x, cos, sin):
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["hidden_size"])
        self.layers = nn.ModuleList(LlamaDecoderLayer(c) for _ in range(c["num_hidden_layers"]))
        self.norm = LlamaRMSNorm(c["hidden_size"], c["rms_norm_eps"])


class LlamaForCausalLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = LlamaModel(c)
        self.tied = c["tie_word_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(c["hidden_size"], c["vocab_size"], bias=False)

    def forward(self, idx):
        T = idx.shape[1]
        freqs = torch.outer(torch.arange(T, dtype=torch.float64), llama_inv_freq(self.c))
        emb = torch.cat((freqs, freqs), dim=-1)
        cos, sin = emb.cos().float(), emb.sin().float()
        x = self.model.embed_tokens(idx)
        for layer in self.model.layers:
            x = layer(x, cos, sin)
        x = self.model.norm(x)
        return x @ self.model.embed_tokens.weight.T if self.tied else self.lm_head(x)


def write_random_gpt2(path, n_layer, n_head, n_embd, n_positions, vocab_size, seed):
    """A GPT-2 directory as the Hugging Face hub holds one: names without the "transformer."
    prefix, the attention's causal-mask buffers ("h.0.attn.bias") among the weights, random
    weights (normal, std 0.2; LayerNorm gains around 1)."""
    config = {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2",
              "vocab_size": vocab_size, "n_positions": n_positions, "n_embd": n_embd,
              "n_layer": n_layer, "n_head": n_head, "n_inner": None,
              "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    model = GPT2LMHeadModel(dict(config, tie_word_embeddings=True))
    gen = torch.Generator().manual_seed(seed)
    tensors = []
    for name, p in model.state_dict().items():
        v = torch.randn(p.shape, generator=gen) * 0.2 + (1.0 if name.endswith("ln_1.weight") or
                                                          name.endswith("ln_2.weight") or
                                                          name.endswith("ln_f.weight") else 0.0)
        tensors.append((name[len("transformer."):], "F32", list(p.shape),
                        v.numpy().astype("<f4").tobytes()))
    for i in range(n_layer):
        mask = np.tril(np.ones((n_positions, n_positions), dtype="<f4"))[None, None]
        tensors.append((f"h.{i}.attn.bias", "F32", list(mask.shape), mask.tobytes()))
    os.makedirs(path, exist_ok=True)
    safetensors_tool.write(os.path.join(path, "model.safetensors"), {"format": "pt"}, tensors)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def write_random_llmc(path, n_layer, n_head, n_embd, n_positions, vocab_size, seed, version):
    """An llm.c checkpoint as its train_gpt2.py writes one (write_model, write_tensors): the
    256-int32 header, then wte padded to a multiple of 128 rows, wpe, and each kind of block
    tensor stacked over the layers; random weights as write_random_gpt2's. version 3: fp32,
    5: bf16."""
    C, V = n_embd, vocab_size
    Vp = (V + 127) // 128 * 128
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape, mean=0.0):
        return torch.randn(shape, generator=gen) * 0.2 + mean

    wte = torch.cat([rand(V, C), torch.zeros(Vp - V, C)])
    tensors = [wte, rand(n_positions, C)]
    for kind, shape, mean in [("ln_1.weight", (C,), 1.0), ("ln_1.bias", (C,), 0.0),
                              ("c_attn.weight", (3 * C, C), 0.0), ("c_attn.bias", (3 * C,), 0.0),
                              ("attn.c_proj.weight", (C, C), 0.0), ("attn.c_proj.bias", (C,), 0.0),
                              ("ln_2.weight", (C,), 1.0), ("ln_2.bias", (C,), 0.0),
                              ("c_fc.weight", (4 * C, C), 0.0), ("c_fc.bias", (4 * C,), 0.0),
                              ("mlp.c_proj.weight", (C, 4 * C), 0.0),
                              ("mlp.c_proj.bias", (C,), 0.0)]:
        tensors += [rand(*shape, mean=mean) for _ in range(n_layer)]
    tensors += [rand(C, mean=1.0), rand(C)]
    header = np.zeros(256, dtype="<i4")
    header[:8] = [20240326, version, n_positions, V, n_layer, n_head, C, Vp]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        for t in tensors:
            v = t.numpy().astype(np.float32).reshape(-1)
            f.write(v.astype("<f4").tobytes() if version == 3 else
                    safetensors_tool.bf16_bits(v).astype("<u2").tobytes())


def greedy_bytes(path, prompt, n):
    """The greedy continuation (n tokens) of the bytes `prompt` by the GPT-2 directory's model
    over a byte vocabulary, the context cropped to the last n_positions tokens, as bytes."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.setdefault("tie_word_embeddings", True)
    model = GPT2LMHeadModel(config)
    state = {("transformer." + k if not k.startswith(("transformer.", "lm_head")) else k): v
             for k, v in load_hf_dir(path).items() if not k.endswith(".attn.bias")}
    model.load_state_dict(state, strict=True)
    tokens = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            context = torch.tensor([tokens[-config["n_positions"]:]])
            tokens.append(int(model(context)[0, -1].argmax()))
    return bytes(tokens[len(prompt):])


def score_choices(path, choices_file):
    """HellaSwag-style scoring of a GPT-2 directory's model over a byte vocabulary, as llm.c's
    evaluation does it: each ending after a space, its tokens' losses given the context (the
    context's first tokens dropped when the whole is longer than n_positions + 1); returns
    (acc_norm: lowest mean loss, acc: lowest total, examples)."""
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config.setdefault("tie_word_embeddings", True)
    model = GPT2LMHeadModel(config)
    model.load_state_dict(load_hf_dir(path), strict=True)
    T = config["n_positions"]
    right_mean = right_sum = n = 0
    with open(choices_file) as f:
        examples = [json.loads(line) for line in f if line.strip()]
    with torch.no_grad():
        for ex in examples:
            ctx = list(ex["ctx"].encode())
            means, sums = [], []
            for ending in ex["endings"]:
                end = list((" " + ending).encode())
                seq = (ctx + end)[-(T + 1):]
                x, y = torch.tensor([seq[:-1]]), torch.tensor(seq[1:])
                losses = F.cross_entropy(model(x)[0], y, reduction="none")[-len(end):]
                means.append(float(losses.mean()))
                sums.append(float(losses.sum()))
            right_mean += int(np.argmin(means)) == ex["label"]
            right_sum += int(np.argmin(sums)) == ex["label"]
            n += 1
    return right_mean / n, right_sum / n, n


def same_weights(a, b):
    """Whether two GPT-2 directories hold the same weights bit for bit (names with or without
    the "transformer." prefix; mask buffers ignored)."""
    def weights(path):
        return {k[len("transformer."):] if k.startswith("transformer.") else k: v
                for k, v in load_hf_dir(path).items() if not k.endswith(".attn.bias")}
    x, y = weights(a), weights(b)
    assert x.keys() == y.keys(), sorted(set(x) ^ set(y))
    for k in x:
        assert torch.equal(x[k], y[k]), k
    return len(x)


def check(dump_tool, work_dir, variant):
    h5_path = os.path.join(work_dir, f"hf-{variant}.h5")
    hf_dir = os.path.join(work_dir, f"hf-{variant}")
    shutil.rmtree(hf_dir, ignore_errors=True)  # an export goes into a new directory
    subprocess.run([dump_tool, h5_path, variant, hf_dir], check=True)
    with open(os.path.join(hf_dir, "config.json")) as f:
        config = json.load(f)
    with h5py.File(h5_path, "r") as f:
        tokens = torch.from_numpy(np.asarray(f["reference/tokens"]).astype(np.int64))
        ours = np.asarray(f["reference/logits"])
    arch = config["architectures"][0]
    model = {"GPT2LMHeadModel": GPT2LMHeadModel, "LlamaForCausalLM": LlamaForCausalLM}[arch](config)
    state = load_hf_dir(hf_dir)
    missing = set(model.state_dict()) - set(state)
    extra = set(state) - set(model.state_dict())
    if missing or extra:
        print(f"{variant:15s} FAIL names: missing {sorted(missing)}, extra {sorted(extra)}")
        return False
    model.load_state_dict(state, strict=True)
    with torch.no_grad():
        logits = model(tokens).numpy()
    err = float(np.max(np.abs(logits - ours)))
    scale = float(np.max(np.abs(ours)))
    ok = logits.shape == ours.shape and err <= REL_TOL * scale
    print(f"{variant:15s} {arch:17s} logits rel error {err / scale:.3e} {'ok' if ok else 'FAIL'}")
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--dump-tool", required=True)
    ap.add_argument("--work-dir", required=True)
    ap.add_argument("--variant", choices=VARIANTS, action="append")
    args = ap.parse_args()
    torch.set_num_threads(2)
    os.makedirs(args.work_dir, exist_ok=True)
    ok = all([check(args.dump_tool, args.work_dir, v) for v in (args.variant or VARIANTS)])
    print("PASS" if ok else "FAIL")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
