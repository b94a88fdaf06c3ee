"""transformers' side of tests/models/hf.rs.

  make DIR [--max-shard-size S]   a tiny random LlamaForCausalLM (grouped-query attention, untied
                                  embeddings, rope theta 5000) saved with save_pretrained, and DIR/train.bin:
                                  4096 little-endian u16 token ids
  logits DIR DUMP                 transformers' logits of DUMP's input_ids with the model in DIR; prints the
                                  largest difference from DUMP's logits
"""
import argparse
import os

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import LlamaConfig, LlamaForCausalLM


def make(a):
    torch.manual_seed(7)
    cfg = LlamaConfig(
        vocab_size=96,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_theta=5000.0,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).float()
    with torch.no_grad():
        # norms away from one, so a scale read wrongly shows
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
    model.save_pretrained(a.dir, max_shard_size=a.max_shard_size)
    ids = np.random.default_rng(3).integers(0, cfg.vocab_size, 4096).astype("<u2")
    ids.tofile(os.path.join(a.dir, "train.bin"))


def logits(a):
    model = LlamaForCausalLM.from_pretrained(a.dir, dtype=torch.float32).eval()
    dump = load_file(a.dump)
    with torch.no_grad():
        ref = model(dump["input_ids"]).logits
    print(f"max_diff {(ref - dump['logits']).abs().max().item():.3e}")


p = argparse.ArgumentParser()
sub = p.add_subparsers(dest="cmd", required=True)
m = sub.add_parser("make")
m.add_argument("dir")
m.add_argument("--max-shard-size", default="5GB")
lg = sub.add_parser("logits")
lg.add_argument("dir")
lg.add_argument("dump")
a = p.parse_args()
{"make": make, "logits": logits}[a.cmd](a)
