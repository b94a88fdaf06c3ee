"""transformers' side of tests/models/hf.rs.

  make DIR [--max-shard-size S] [--vocab V --hidden H --layers L] [--bf16: saved in bfloat16]
                                  a tiny random LlamaForCausalLM (grouped-query attention, untied
                                  embeddings, rope theta 5000; 96 tokens, 32 features, 2 layers by default)
                                  saved with save_pretrained, and DIR/train.bin: 4096 little-endian u16
                                  token ids
  text DIR                        DIR/text.txt (lower-case words), DIR/tokenizer.json (a BPE of at most
                                  96 tokens trained on it with Hugging Face's tokenizers) and
                                  DIR/text.bin: the text's ids as that tokenizer gives them, u16
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
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=2 * a.hidden,
        num_hidden_layers=a.layers,
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
    if a.bf16:
        model = model.to(torch.bfloat16)  # as models are published: read back into float32 variables
    model.save_pretrained(a.dir, max_shard_size=a.max_shard_size)
    ids = np.random.default_rng(3).integers(0, min(cfg.vocab_size, 96), 4096).astype("<u2")
    ids.tofile(os.path.join(a.dir, "train.bin"))


def text(a):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    rng = np.random.default_rng(5)
    words = ["the", "model", "trains", "on", "many", "ranks", "and", "shards", "its", "weights", "over", "them"]
    body = " ".join(rng.choice(words, 3000))
    with open(os.path.join(a.dir, "text.txt"), "w") as f:
        f.write(body)
    tok = Tokenizer(models.BPE(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([body], trainers.BpeTrainer(vocab_size=96, special_tokens=["[UNK]"]))
    tok.save(os.path.join(a.dir, "tokenizer.json"))
    ids = np.array(tok.encode(body).ids, dtype="<u2")
    assert ids.max() < 96, ids.max()
    ids.tofile(os.path.join(a.dir, "text.bin"))


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
m.add_argument("--vocab", type=int, default=96)
m.add_argument("--hidden", type=int, default=32)
m.add_argument("--layers", type=int, default=2)
m.add_argument("--bf16", action="store_true")
t = sub.add_parser("text")
t.add_argument("dir")
lg = sub.add_parser("logits")
lg.add_argument("dir")
lg.add_argument("dump")
a = p.parse_args()
{"make": make, "text": text, "logits": logits}[a.cmd](a)
