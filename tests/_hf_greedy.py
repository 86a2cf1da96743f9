"""Oracle worker (run in a subprocess to keep torch's memory apart): HF transformers greedy
`generate` on the weights our GGUF loader reads. argv: gguf path, JSON list of prompts (ids), n."""
import json
import sys

import torch
import transformers
from _hf_model import empty_model, load_weights

from ssd_jax.models.config import ModelConfig
from ssd_jax.models.loading.gguf import load_gguf

path, prompts, n = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
config, tensors = load_gguf(path)
cfg = ModelConfig.from_hf(config)
hf_cfg = transformers.AutoConfig.for_model(**cfg.to_hf())
model = load_weights(empty_model(hf_cfg), tensors, cfg.tie_embeddings)
del tensors
out = []
with torch.no_grad():
    for ids in prompts:
        g = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, min_new_tokens=n,
                           eos_token_id=None, pad_token_id=0)
        out.append(g[0, len(ids):].tolist())
print(json.dumps(out))
