#!/usr/bin/env python3
"""An independent safetensors reader and writer for the tests: struct, json and numpy only,
following the format's description (https://github.com/huggingface/safetensors: a little-endian
u64 header length, a JSON header of {name: {dtype, shape, data_offsets}} and "__metadata__",
then the tensors' bytes), none of the trainer's code.

  safetensors_tool.py write OUT SPEC      SPEC: JSON {"metadata": {...}, "tensors": [[name,
                                          dtype, shape, [values...]], ...]}; F64, F32, F16, BF16
  safetensors_tool.py check FILE H5       the trainer's export of checkpoint H5: 8-byte aligned
                                          data, tensors back to back, each one params/<name>
                                          exactly (F32) or rounded to nearest even (BF16, F16)
  safetensors_tool.py drop IN OUT NAME    IN without tensor NAME
  safetensors_tool.py extra IN OUT NAME   IN with one more tensor NAME (F32, [2])
  safetensors_tool.py meta IN OUT KEY VAL IN with metadata KEY set to VAL
"""
import json
import struct
import sys

import numpy as np


def bf16_bits(values):
    """fp32 -> bf16 bits, rounded to nearest even (finite values)."""
    u = np.asarray(values, dtype=np.float32).view(np.uint32).astype(np.uint64)
    return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)


def encode(dtype, values):
    if dtype == "F64":
        return np.asarray(values, dtype="<f8").tobytes()
    if dtype == "F32":
        return np.asarray(values, dtype="<f4").tobytes()
    if dtype == "F16":
        return np.asarray(values, dtype=np.float32).astype("<f2").tobytes()
    if dtype == "BF16":
        return bf16_bits(values).astype("<u2").tobytes()
    raise ValueError(dtype)


def read(path):
    with open(path, "rb") as f:
        blob = f.read()
    (n,) = struct.unpack("<Q", blob[:8])
    header = json.loads(blob[8:8 + n].decode("utf-8"))
    meta = header.pop("__metadata__", {})
    data = blob[8 + n:]
    tensors = {}
    for name, e in header.items():
        begin, end = e["data_offsets"]
        tensors[name] = (e["dtype"], e["shape"], data[begin:end])
    return n, meta, header, tensors, len(data)


def write(path, meta, tensors):
    """tensors: list of (name, dtype, shape, raw bytes). No padding: readers must not need it."""
    header, at = {}, 0
    if meta:
        header["__metadata__"] = meta
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(raw)]}
        at += len(raw)
    text = json.dumps(header).encode("utf-8")
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for t in tensors:
            f.write(t[3])


def check(path, h5_path):
    import h5py
    n, meta, header, tensors, data_bytes = read(path)
    assert n % 8 == 0, f"header length {n}: the data does not start 8-byte aligned"
    spans = sorted(e["data_offsets"] for e in header.values())
    at = 0
    for begin, end in spans:
        assert begin == at, f"a gap or an overlap at byte {begin} (expected {at})"
        at = end
    assert at == data_bytes, f"tensors end at {at}, the data has {data_bytes} bytes"
    with h5py.File(h5_path, "r") as h5:
        names = set(h5["params"].keys())
        assert names == set(tensors), f"names differ: {sorted(names ^ set(tensors))}"
        for name, (dtype, shape, raw) in tensors.items():
            want = np.asarray(h5["params"][name], dtype=np.float32)
            assert list(want.shape) == shape, f"{name}: shape {shape}, checkpoint {want.shape}"
            assert raw == encode(dtype, want.reshape(-1)), f"{name}: values differ ({dtype})"
    print(f"ok {len(tensors)} tensors, {meta.get('arch')}")


def main():
    cmd = sys.argv[1]
    if cmd == "write":
        spec = json.loads(sys.argv[3])
        write(sys.argv[2], spec.get("metadata", {}),
              [(name, dtype, shape, encode(dtype, values))
               for name, dtype, shape, values in spec["tensors"]])
    elif cmd == "check":
        check(sys.argv[2], sys.argv[3])
    else:
        _, meta, header, tensors, _ = read(sys.argv[2])
        order = sorted(tensors, key=lambda k: header[k]["data_offsets"][0])
        out = [(k, tensors[k][0], tensors[k][1], tensors[k][2]) for k in order]
        if cmd == "drop":
            out = [t for t in out if t[0] != sys.argv[4]]
        elif cmd == "extra":
            out.append((sys.argv[4], "F32", [2], encode("F32", [1.0, 2.0])))
        elif cmd == "meta":
            meta[sys.argv[4]] = sys.argv[5]
        write(sys.argv[3], meta, out)


if __name__ == "__main__":
    main()
