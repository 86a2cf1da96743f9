"""The HF transformers oracle's model (torch, fp32) on given weights, for the tests that compare
against it (tests/_hf_greedy.py, tests/unit/test_model_oracle.py,
tests/real_weights/test_loading.py).

Built without its random initialisation: every weight is loaded right after, and drawing the
1.5B model's random weights first was a large share of its oracle's time (the `alone` test). A
weight the given tensors lack would then hold whatever the memory held, so the load is strict:
nothing unexpected, nothing missing but a tied lm_head (which `tie` takes from the embedding)."""
from __future__ import annotations


def _no_init():
    """transformers' switch that skips weight initialisation (moved to `transformers.initialization`
    in 5.x; `transformers.modeling_utils` before)."""
    try:
        from transformers.initialization import no_init_weights
    except ImportError:
        from transformers.modeling_utils import no_init_weights
    return no_init_weights()


def empty_model(hf_cfg):
    """An fp32 `AutoModelForCausalLM` of `hf_cfg` whose weights are not initialised (load them all:
    `load_weights`)."""
    import torch
    import transformers

    with _no_init():
        model = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.float32)
    return model.eval()


def load_weights(model, tensors, tie: bool):
    """Load `tensors` (HF names -> numpy) into `model`, strictly but for a tied lm_head."""
    import torch

    state = {k: torch.from_numpy(v) for k, v in tensors.items()}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected, unexpected
    assert set(missing) <= ({"lm_head.weight"} if tie else set()), missing
    if tie:
        model.tie_weights()
    return model
