#!/usr/bin/env python3
"""Reads a tch-dist sharded checkpoint into PyTorch tensors: safetensors files and JSON metadata, no pickle.

    python scripts/ckpt_to_torch.py CKPT/step-0000000100 --out model.safetensors [--prefix model]

writes the tensors under PREFIX (default `model`, the prefix stripped: a module's `state_dict()` names)
as one safetensors file that `model.load_state_dict(safetensors.torch.load_file(...))` takes. From Python:

    import ckpt_to_torch
    sd = ckpt_to_torch.load("CKPT/step-0000000100")   # {"model.l1.weight": tensor, ...}
    model.load_state_dict(ckpt_to_torch.section(sd, "model"))
    opt.load_state_dict(ckpt_to_torch.optimizer_state(sd, "optim", model, opt))

Every file is checked against the CRC-32 in the metadata (what `zlib.crc32` computes) before it is used.
"""
import argparse
import json
import os
import sys
import zlib

import torch

DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def load(ckpt_dir, verify=True):
    """Every tensor of the checkpoint in `ckpt_dir`, whole, by its global name."""
    with open(os.path.join(ckpt_dir, "metadata.json")) as f:
        meta = json.load(f)
    if meta.get("format") != "tch-dist-checkpoint":
        raise ValueError(f"{ckpt_dir}: not a tch-dist checkpoint")
    files = []
    for fm in meta["files"]:
        with open(os.path.join(ckpt_dir, fm["name"]), "rb") as f:
            data = f.read()
        if verify and (len(data) != fm["bytes"] or zlib.crc32(data) != fm["crc32"]):
            raise ValueError(f"{fm['name']}: its size or CRC-32 differs from the metadata's: the file is damaged")
        files.append(data)
    out = {}
    for name, t in meta["tensors"].items():
        dtype = DTYPES[t["dtype"]]
        full = torch.empty(t["shape"], dtype=dtype)
        covered = 0
        for c in t["chunks"]:
            raw = bytearray(files[c["file"]][c["begin"] : c["end"]])
            chunk = torch.frombuffer(raw, dtype=dtype).view(c["lengths"]) if raw else torch.empty(c["lengths"], dtype=dtype)
            index = tuple(slice(o, o + n) for o, n in zip(c["offsets"], c["lengths"]))
            full[index] = chunk
            covered += chunk.numel()
        if covered != full.numel():
            raise ValueError(f"{name}: its chunks hold {covered} of {full.numel()} elements")
        out[name] = full
    return out


def section(sd, prefix):
    """The tensors under `prefix.`, named without it (a module's state_dict)."""
    p = prefix + "."
    return {k[len(p) :]: v for k, v in sd.items() if k.startswith(p)}


def optimizer_state(sd, prefix, model, opt):
    """`opt.state_dict()` with the state of `model`'s parameters (`opt` built over `model.parameters()`)
    from the entries `{prefix}.state.{name}.{field}`; the step count becomes the float tensor torch keeps."""
    names = [n for n, _ in model.named_parameters()]
    state = {}
    for i, n in enumerate(names):
        stem = f"{prefix}.state.{n}."
        fields = {k[len(stem) :]: v for k, v in sd.items() if k.startswith(stem) and "." not in k[len(stem) :]}
        if fields:
            if "step" in fields:
                fields["step"] = fields["step"].reshape(()).to(torch.float32)
            state[i] = fields
    out = opt.state_dict()
    out["state"] = state
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("ckpt_dir")
    ap.add_argument("--out", required=True, help="safetensors file to write")
    ap.add_argument("--prefix", default="model", help="the section to write ('' for every tensor, names kept)")
    a = ap.parse_args()
    sd = load(a.ckpt_dir)
    tensors = section(sd, a.prefix) if a.prefix else sd
    if not tensors:
        sys.exit(f"{a.ckpt_dir}: no tensors under {a.prefix!r}")
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in tensors.items()}, a.out)
    print(f"{len(tensors)} tensors -> {a.out}")


if __name__ == "__main__":
    main()
