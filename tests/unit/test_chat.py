"""`generate(messages=[...])`: a system prompt and multi-turn chat through the model's template;
a bad message list, or a model without a template, is one ValueError naming the problem, raised
before anything compiles."""
import pytest

from ssd_jax.algorithm import steps
from ssd_jax.models import registry
from ssd_jax.models.config import tiny_config
from ssd_jax.models.model import Model
from ssd_jax.models.params import random_params
from ssd_jax.models.tokenizer import Tokenizer, check_messages
from ssd_jax.runtime.engine import Engine

from _byte_tokenizer import CHAT_TEMPLATE, byte_tokenizer

CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "user", "content": "more"}]
CFG = tiny_config("llama", vocab_size=259)


@pytest.mark.parametrize("messages,needle", [
    ("hi", "must be a list"),
    ([], "messages is empty"),
    (["hi"], r"messages\[0\] must be a dict"),
    ([{"content": "x"}], r"messages\[0\] has no 'role'"),
    ([{"role": "user", "content": "x"}, {"role": "robot", "content": "y"}],
     r"messages\[1\] has an unknown role 'robot'"),
    ([{"role": "user"}], r"messages\[0\] \(user\) has no 'content'"),
    ([{"role": "user", "content": 3}], "content must be a string"),
])
def test_bad_message_lists_are_named(messages, needle):
    with pytest.raises(ValueError, match=needle):
        check_messages(messages)


def test_the_qwen_template_renders_system_and_turns_as_chatml():
    tok = Tokenizer.from_gguf(registry.fetch(registry.DEFAULT_DRAFT, progress=False))
    text = tok.apply_chat_template(CHAT)
    assert text == ("<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\nhi<|im_end|>\n"
                    "<|im_start|>assistant\nhello<|im_end|>\n<|im_start|>user\nmore<|im_end|>\n"
                    "<|im_start|>assistant\n")
    ids = tok.encode(text)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 5  # matched whole, as special tokens


@pytest.fixture(scope="module")
def engine():
    params = random_params(CFG, 0, scale=1.0)
    return Engine(Model(CFG, params, byte_tokenizer(CHAT_TEMPLATE)), compilation_cache=False)


def test_generate_with_messages_is_generate_of_the_rendered_chat(engine):
    rendered = "<system>Be terse.<user>hi<assistant>hello<user>more<assistant>"
    want = engine.generate([rendered], mode="ar", max_new_tokens=6)
    got = engine.generate(messages=CHAT, mode="ar", max_new_tokens=6)
    assert got.token_ids == want.token_ids and got.texts == want.texts
    # a batch of conversations
    other = [{"role": "user", "content": "x"}]
    both = engine.generate(messages=[CHAT, other], mode="ar", max_new_tokens=6)
    assert both.token_ids[0] == want.token_ids[0]
    assert both.token_ids[1] == engine.generate(["<user>x<assistant>"], mode="ar",
                                                max_new_tokens=6).token_ids[0]
    # and streamed
    deltas = list(engine.stream(messages=CHAT, mode="ar", max_new_tokens=6))
    assert [i for d in deltas for i in d.token_ids] == want.token_ids[0]


def test_message_errors_come_before_any_compile(engine, monkeypatch):
    def never(*a, **k):
        raise AssertionError("compiled / ran before the messages were checked")
    monkeypatch.setattr(steps, "prefill", never)
    with pytest.raises(ValueError, match="unknown role 'bot'"):
        engine.generate(messages=[{"role": "bot", "content": "x"}], mode="ar")
    with pytest.raises(ValueError, match=r"conversation 1: messages\[0\] \(user\) has no 'content'"):
        engine.generate(messages=[CHAT, [{"role": "user"}]], mode="ar")
    with pytest.raises(ValueError, match="prompts or messages, not both"):
        engine.generate(["hi"], messages=CHAT, mode="ar")
    with pytest.raises(ValueError, match="give prompts"):
        engine.generate(mode="ar")
    plain = Engine(Model(CFG, engine.target.params, byte_tokenizer()), compilation_cache=False)
    with pytest.raises(ValueError, match="no chat template"):
        plain.generate(messages=CHAT, mode="ar")
    with pytest.raises(ValueError, match="no chat template"):
        plain.generate(["hi"], chat=True, mode="ar")
    bare = Engine(Model(CFG, engine.target.params, None), compilation_cache=False)
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate(messages=CHAT, mode="ar")
    refusing = byte_tokenizer("{% if messages[0].role == 'system' %}"
                              "{{ raise_exception('System role not supported') }}{% endif %}x")
    strict = Engine(Model(CFG, engine.target.params, refusing), compilation_cache=False)
    with pytest.raises(ValueError, match="refused these messages: System role not supported"):
        strict.generate(messages=CHAT, mode="ar")
