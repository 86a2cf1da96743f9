"""The `ssd-jax` command line end to end on tiny random models saved as HF folders (config.json,
model.safetensors, a byte-level BPE tokenizer.json): `generate` in each mode (JSON and streaming),
`bench` writing its JSON, markdown table and plots, and every error a user can trigger printing one
`ssd-jax: error:` line without a traceback."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from _cli_models import CFG, PROMPT, SCRIPT, VOCAB, gen_args

from ssd_jax.runtime.defaults import Layout, choose, cpu_features, describe
from ssd_jax.tools import cli

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REAL_HOME = os.environ.get("SSD_JAX_HOME")  # where CI fetched the default pair (None: the default)
CHOICE = choose()  # what --backend / --dtype / --draft-quant auto resolve to on this machine


@pytest.fixture(autouse=True)
def home(tmp_path, monkeypatch):
    """An empty SSD_JAX_HOME (no default model fetched) and no persistent compile cache."""
    h = tmp_path / "home"
    h.mkdir()
    monkeypatch.setenv("SSD_JAX_HOME", str(h))
    monkeypatch.setenv("SSD_JAX_COMPILE_CACHE", "0")
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    return h


def run_cli(argv, capsys):
    """cli.main in this process -> (exit code, stdout, stderr). JAX has started in this process
    (`CHOICE`), so SSD with --placement auto runs split here (`defaults.ssd_layout`); the
    console-script tests run the two-process layout."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def progress_lines(err):
    return [ln for ln in err.splitlines() if ln.startswith("ssd-jax: ")
            and not ln.startswith(("ssd-jax: error", "ssd-jax: warning", "ssd-jax: SSD"))]


# ------------------------------------------------------------------------------------------ generate
def test_generate_json_each_mode_agrees(pair, capsys):
    got = {}
    for mode in ("ar", "sd", "ssd"):
        rc, out, err = run_cli(gen_args(pair, "--mode", mode, "--json"), capsys)
        assert rc == 0, err
        obj = json.loads(out)
        assert set(obj) == {"text", "token_ids", "logprobs", "finish_reason", "metrics"}
        assert obj["metrics"]["mode"] == mode and obj["metrics"]["schema"] == 1
        assert len(obj["logprobs"]) == len(obj["token_ids"])
        assert all(lp <= 0 for lp in obj["logprobs"])
        eos = obj["token_ids"][-1] == VOCAB - 1  # <|endoftext|>, the tokenizer's EOS
        assert obj["finish_reason"] == ("eos" if eos else "length")
        assert eos or len(obj["token_ids"]) == 12
        assert not progress_lines(err)  # stderr is no terminal here: no progress
        m = obj["metrics"]
        assert m["dtype"] == CHOICE["dtype"]  # --dtype auto, the default
        assert m["draft_quant"] == (None if mode == "ar" else CHOICE["draft_quant"])
        assert m["backend"]["target"] == CHOICE["backend"].name
        assert m["placement"] == ("split" if mode != "ssd" else m["placement"])
        assert m["cpu_features"] == cpu_features()
        assert 1 <= len(obj["token_ids"]) <= 12
        assert obj["metrics"]["new_tokens"] == len(obj["token_ids"])
        assert isinstance(obj["text"], str)
        got[mode] = obj
    # greedy: every mode emits the target's own tokens
    assert got["sd"]["token_ids"] == got["ar"]["token_ids"] == got["ssd"]["token_ids"]
    assert got["ssd"]["metrics"]["lookups"] > 0
    assert got["sd"]["metrics"]["accept_hist"] and sum(got["sd"]["metrics"]["accept_hist"]) > 0
    # every backup the library takes, "auto" included (ssd_jax.runtime.config.BACKUPS): the same tokens
    for backup in ("neural", "random", "ngram", "auto"):
        rc, out, err = run_cli(gen_args(pair, "--mode", "ssd", "--backup", backup, "--json"), capsys)
        assert rc == 0, err
        assert json.loads(out)["token_ids"] == got["ar"]["token_ids"], backup
    # an int8 or int4 draft (models/quant.py) changes acceptance only: the target's tokens all the same
    for quant in ("int8", "int4"):
        rc, out, err = run_cli(gen_args(pair, "--mode", "sd", "--draft-quant", quant, "--json"), capsys)
        assert rc == 0, err
        assert json.loads(out)["token_ids"] == got["ar"]["token_ids"], quant
    # so does a draft head cut to the first 40 of 97 ids (models/draft_head.py)
    rc, out, err = run_cli(gen_args(pair, "--mode", "sd", "--draft-quant", "int8", "--draft-vocab", "40",
                                    "--json"), capsys)
    assert rc == 0, err
    assert json.loads(out)["token_ids"] == got["ar"]["token_ids"]
    rc, out, err = run_cli(gen_args(pair, "--mode", "ar", "--dtype", "fp32", "--json"), capsys)
    assert rc == 0, err
    assert json.loads(out)["metrics"]["dtype"] == "float32"


def test_generate_ssd_defaults(pair, capsys):
    """Without --k / --fanout, SSD runs the CLI's measured defaults (K=5, fan-out 0,0,0,0,0,1);
    a --fanout alone sets K to its length - 1."""
    base = ["generate", "--target", pair["target"], "--draft", pair["draft"], "--prompt", PROMPT,
            "--max-new-tokens", "8", "--max-len", "256", "--json"]
    rc, out, err = run_cli(base, capsys)
    assert rc == 0, err
    m = json.loads(out)["metrics"]
    assert m["mode"] == "ssd" and m["k"] == cli.DEFAULT_K["ssd"] == 5
    assert tuple(m["fanout"]) == cli.default_fanout(5) == (0, 0, 0, 0, 0, 1)
    rc, out, err = run_cli([*base, "--fanout", "1,0,1"], capsys)
    assert rc == 0, err
    m = json.loads(out)["metrics"]
    assert m["k"] == 2 and m["fanout"] == [1, 0, 1]


def test_generate_streams_the_same_text(pair, capsys, tmp_path):
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(PROMPT)
    args = ["generate", "--target", pair["target"], "--draft", pair["draft"], "--prompt-file",
            str(prompt_file), "--max-new-tokens", "12", "--k", "3", "--max-len", "256",
            "--placement", "colocated"]
    rc, out, err = run_cli([*args, "--json"], capsys)
    assert rc == 0, err
    want = json.loads(out)["text"]
    rc, out, err = run_cli(args, capsys)
    assert rc == 0, err
    assert out == want + "\n"
    assert err.startswith("ssd: ") and "tok/s" in err  # the metrics summary goes to stderr
    # a stop string: the streamed text is cut before it, as the JSON text is
    stop = want[3:5]
    rc, out, err = run_cli([*args, "--stop", stop, "--json"], capsys)
    assert rc == 0, err
    cut = json.loads(out)
    assert cut["finish_reason"] == "stop" and want.startswith(cut["text"]) and stop not in cut["text"]
    rc, out, err = run_cli([*args, "--stop", stop], capsys)
    assert rc == 0, err
    assert out == cut["text"] + "\n"


def test_json_logprobs_and_finish_are_the_python_results(pair, capsys):
    """--json carries what `Engine.generate` returns for the same request: log-probs and the
    finish reason (here a stop string, its text cut), beside text and ids."""
    from ssd_jax.models.load import load_model
    from ssd_jax.runtime.engine import Engine
    target = load_model(pair["target"], CHOICE["dtype"], use_cache=False)
    want = Engine(target, max_len=256, compilation_cache=False).generate(
        [PROMPT], mode="ar", max_new_tokens=12)
    stop = want.texts[0][3:5]
    assert stop
    want = Engine(target, max_len=256, compilation_cache=False).generate(
        [PROMPT], mode="ar", max_new_tokens=12, stop=[stop])
    rc, out, err = run_cli(gen_args(pair, "--mode", "ar", "--json", "--stop", stop), capsys)
    assert rc == 0, err
    obj = json.loads(out)
    assert obj["finish_reason"] == want.finish_reasons[0] == "stop"
    assert obj["token_ids"] == want.token_ids[0] and obj["text"] == want.texts[0]
    assert obj["logprobs"] == pytest.approx(want.logprobs[0], rel=1e-5)


def test_progress_goes_to_stderr_only(pair, capsys):
    """--progress (forced: stderr is no terminal here) says what loads, converts, compiles and
    when tokens come, on stderr; stdout stays the JSON object alone, or the text alone."""
    rc, out, err = run_cli(gen_args(pair, "--mode", "sd", "--json", "--progress"), capsys)
    assert rc == 0, err
    obj = json.loads(out)  # stdout: one JSON object, nothing else
    lines = progress_lines(err)
    text = "\n".join(lines)
    assert f"ssd-jax: loading target {pair['target']} ({CHOICE['dtype']}) ..." in lines
    assert "converting" in text and "(the first load; cached for later loads)" in text
    assert any(ln.startswith("ssd-jax: target loaded in ") and ln.endswith(" s") for ln in lines)
    assert any(ln.startswith("ssd-jax: draft loaded in ") for ln in lines)
    assert any(ln.startswith("ssd-jax: generating; a first run compiles") for ln in lines)
    assert any(ln.startswith("ssd-jax: first tokens after ") for ln in lines)
    order = [next(i for i, ln in enumerate(lines) if ln.startswith(p)) for p in
             ("ssd-jax: loading target", "ssd-jax: target loaded", "ssd-jax: loading draft",
              "ssd-jax: generating", "ssd-jax: first tokens")]
    assert order == sorted(order)
    assert obj["token_ids"]
    rc, out, err = run_cli(gen_args(pair, "--mode", "ar", "--progress"), capsys)
    assert rc == 0, err
    assert "ssd-jax" not in out and progress_lines(err)  # the streamed text alone on stdout
    rc, out, err = run_cli(gen_args(pair, "--mode", "ar", "--json", "--no-progress"), capsys)
    assert rc == 0 and not progress_lines(err)


def test_progress_lines_for_compiles_and_tokens():
    """The compile and token lines, driven by hand (a test process has compiled its steps)."""
    import io
    from ssd_jax.tools import progress as prog
    clock = iter([0.0, 1.0, 3.5, 4.0, 7.0])
    buf = io.StringIO()
    p = prog.Progress(True, stream=buf, clock=lambda: next(clock))
    import jax
    from ssd_jax.runtime.metrics import CompileTimer
    timer = CompileTimer()
    event = jax.monitoring.record_event_duration_secs  # to every listener, as JAX reports them
    with p.generating(), timer.measure():
        # a program's trace and lowering, then its compile: one line with the three (the phases
        # out.metrics.compile_s sums, so the running figure is that one)
        event("/jax/core/compile/jaxpr_trace_duration", 0.3, fun_name="verify")
        event("/jax/core/compile/jaxpr_to_mlir_module_duration", 0.2, fun_name="jit(verify)")
        event("/jax/core/compile/backend_compile_duration", 2.0, fun_name="jit(verify)")
        event("/jax/core/compile/backend_compile_duration", 0.1, fun_name="x")  # too short to show
        # what the draft process reported before a reply (transport's "compiled" frame)
        CompileTimer.add_remote("draft process: jit(stored_draft_tree)", dict(
            seconds=4.8, trace_s=0.0, lower_s=0.0, compile_s=4.8, count=1,
            source="persistent cache"))
        p.delta(1, counting=True)  # t = 1.0
        p.delta(3, counting=True)  # t = 3.5: 2.5 s after the last line
        p.delta(2, counting=True)  # t = 4.0: too soon
    prog._on_event("/jax/core/compile/backend_compile_duration", 5.0)  # after: not reported
    assert buf.getvalue().splitlines()[1:] == [
        "ssd-jax:   compiled jit(verify) in 2.5 s (2.5 s compiling so far)",
        "ssd-jax:   compiled draft process: jit(stored_draft_tree) in 4.8 s, persistent cache "
        "(7.4 s compiling so far)",
        "ssd-jax: first tokens after 1.0 s",
        "ssd-jax:   4 tokens so far",
    ]
    assert abs(timer.seconds - p.compile_s) < 1e-9  # one figure
    assert timer.programs["draft process: jit(stored_draft_tree)"]["source"] == "persistent cache"
    # the loader's log lines inside a step: shown once, as progress, not by a root handler too
    import logging
    root_out, shown = io.StringIO(), io.StringIO()
    root = logging.StreamHandler(root_out)
    logging.getLogger().addHandler(root)
    try:
        with prog.Progress(True, stream=shown).step("loading target x", "target loaded"):
            logging.getLogger("ssd_jax.load").info("x: converting it")
    finally:
        logging.getLogger().removeHandler(root)
    lines = shown.getvalue().splitlines()
    assert lines[:2] == ["ssd-jax: loading target x ...", "ssd-jax:   x: converting it"]
    assert lines[2].startswith("ssd-jax: target loaded in ") and root_out.getvalue() == ""
    assert logging.getLogger("ssd_jax.load").propagate  # restored after the step
    quiet = io.StringIO()
    with prog.Progress(None, stream=quiet).generating():  # not a terminal: off
        prog._on_event("/jax/core/compile/backend_compile_duration", 2.5)
    assert quiet.getvalue() == ""


def test_system_prompt_renders_through_the_chat_template(pair, capsys, monkeypatch):
    """--system puts a system turn before the prompt's user turn (the tiny tokenizer has no
    template of its own, so one is given to it here)."""
    from ssd_jax.models.tokenizer import Tokenizer
    template = "{% for m in messages %}[{{ m.role }}]{{ m.content }}{% endfor %}[assistant]"
    real = Tokenizer.from_hf_folder

    def with_template(cls, path):
        tok = real(path)
        tok.chat_template = template
        return tok
    monkeypatch.setattr(Tokenizer, "from_hf_folder", classmethod(with_template))
    rc, out, err = run_cli(gen_args(pair, "--mode", "ar", "--json", "--system", "Be brief."),
                           capsys)
    assert rc == 0, err
    raw = f"[system]Be brief.[user]{PROMPT}[assistant]"
    rc2, out2, err2 = run_cli(["generate", "--target", pair["target"], "--mode", "ar", "--prompt",
                               raw, "--max-new-tokens", "12", "--max-len", "256", "--json"], capsys)
    assert rc2 == 0, err2
    assert json.loads(out)["token_ids"] == json.loads(out2)["token_ids"]
    monkeypatch.setattr(Tokenizer, "from_hf_folder", real)
    rc, _, err = run_cli(gen_args(pair, "--mode", "ar", "--system", "Be brief."), capsys)
    assert_one_line_error(rc, err, "no chat template")


# ------------------------------------------------------------------------------------------ the parser
def _actions(parser, path=("ssd-jax",)):
    """(command path, action) for every argparse action of the parser and its subparsers."""
    import argparse
    for a in parser._actions:
        if isinstance(a, argparse._SubParsersAction):
            for name, sub in a.choices.items():
                yield from _actions(sub, (*path, name))
        else:
            yield " ".join(path), a


def test_every_flag_has_help_that_shows_its_default():
    """Every action of every subcommand has a help string; one with a value default names it
    (and says "default"), one without says what happens by default; flags (on/off) need only
    help."""
    import argparse
    flags = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction,
             argparse._HelpAction, argparse._VersionAction)
    missing, no_default, seen = [], [], set()
    for where, a in _actions(cli.build_parser()):
        name = f"{where} {'/'.join(a.option_strings) or a.dest}"
        seen.add(where)
        h = a.help or ""
        if not h.strip() or h == argparse.SUPPRESS:
            missing.append(name)
            continue
        if isinstance(a, flags):
            continue
        d = a.default
        if d is None or d == [] or d == "":
            shown = "default" in h.lower()
        elif isinstance(d, (list, tuple)):
            shown = "default" in h.lower() and all(str(x) in h for x in d)
        else:
            text = str(int(d)) if isinstance(d, float) and d == int(d) else str(d)
            shown = "default" in h.lower() and text in h
        if not shown:
            no_default.append(f"{name} (default {d!r}): {h}")
    assert seen == {"ssd-jax", "ssd-jax fetch", "ssd-jax generate", "ssd-jax bench",
                    "ssd-jax inspect"}
    assert missing == [] and no_default == [], (missing, no_default)


def test_version_is_the_installed_distributions(capsys):
    from importlib.metadata import version
    rc, out, _ = run_cli(["--version"], capsys)
    assert rc == 0 and out.strip() == f"ssd-jax {version('ssd_jax')}"
    proc = subprocess.run([sys.executable, "-m", "ssd_jax", "--version"], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip() == f"ssd-jax {version('ssd_jax')}"
    proc = subprocess.run([sys.executable, "-m", "ssd_jax", "generate", "--help"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "--max-new-tokens" in proc.stdout and "default" in proc.stdout


def test_console_script_generate_json(pair):
    """The installed `ssd-jax` entry point, in its own process (with a persistent compile
    cache, so its step store is on: ssd_jax/algorithm/aot.py)."""
    cache = pair["root"] / "console_compile_cache"
    env = dict(os.environ, SSD_JAX_COMPILE_CACHE=str(cache))
    proc = subprocess.run([SCRIPT, *gen_args(pair, "--mode", "ssd", "--json")], capture_output=True,
                          text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    obj = json.loads(proc.stdout)
    assert obj["metrics"]["mode"] == "ssd" and obj["token_ids"]
    # both processes stored their steps (the draft's in its own process when two-process)
    stored = {p.name.split("-")[0] for p in (cache / "steps").iterdir()}
    assert {"prefill", "verify", "prefill_cache", "draft_tree"} <= stored, stored
    # a fresh process on a CPU: --placement auto runs SSD in the layout that overlaps, and says so
    lay = fresh_layout()
    assert obj["metrics"]["placement"] == lay.placement, proc.stderr[-3000:]
    if lay.placement == "two-process":
        a, b = lay.cores
        assert f"ssd-jax: SSD with the draft in its own process on core {b}, the target on core {a}" \
            in proc.stderr
        # the draft process compiled its tree in the warm-up beside the target's load, and the
        # target its verify after: the call compiles nothing (tests/unit/test_warmup.py)
        warmup, compiles = obj["metrics"]["warmup"], obj["metrics"]["compiles"]
        assert any("draft_tree" in n and p["count"] for n, p in warmup["draft"]["programs"].items())
        assert any("verify" in n and p["count"] for n, p in warmup["target"]["programs"].items())
        assert obj["metrics"]["compile_s"] == 0 and compiles == {}, compiles
    else:
        assert "ssd-jax: SSD with the draft in its own process cannot run here" in proc.stderr


def fresh_layout():
    """`defaults.ssd_layout()` as a fresh process sees it (this one has started JAX)."""
    code = ("import json; from ssd_jax.runtime.defaults import ssd_layout; "
            "print(json.dumps(ssd_layout().__dict__))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    d = json.loads(proc.stdout)
    return Layout(d["placement"], tuple(d["cores"]) if d["cores"] else None, d["reason"])


# ------------------------------------------------------------------------------------------ bench
def test_bench_writes_json_table_and_plots(pair, capsys, tmp_path):
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("\n".join(json.dumps({"id": f"p{i}", "text": t}) for i, t in
                                 enumerate([PROMPT, "The cat sat on", "import os\n"])))
    out_dir = tmp_path / "bench"
    rc, out, err = run_cli(["bench", "--target", pair["target"], "--draft", pair["draft"],
                            "--prompts-file", str(prompts), "--limit", "2", "--max-new-tokens", "8",
                            "--layouts", "colocated", "--k", "3", "--fanout", "plan",
                            "--max-len", "256", "--out", str(out_dir)], capsys)
    assert rc == 0, err
    rep = json.loads((out_dir / "bench.json").read_text())
    assert rep["machine"]["jax"] and rep["command"].startswith("ssd-jax bench --target ")
    assert [p["id"] for p in rep["prompts"]] == ["p0", "p1"]
    lay = rep["layouts"]["colocated"]
    assert lay["cores"] and list(lay["modes"]) == ["ar", "sd", "ssd"]
    ar = lay["modes"]["ar"]
    for mode in ("sd", "ssd"):
        m = lay["modes"][mode]
        assert m["tokens_per_s"] > 0 and len(m["accept_hist"]) == 4
        # greedy outputs equal AR's, prompt by prompt
        assert [p["token_ids"] for p in m["prompts"]] == [p["token_ids"] for p in ar["prompts"]]
    assert lay["modes"]["ssd"]["lookups"] > 0 and lay["modes"]["ssd"]["hit_rate"] is not None
    # --fanout plan: each SSD prompt ran the fan-out planned from this layout's AR and SD runs
    fans = [p["fanout"] for p in lay["modes"]["ssd"]["prompts"]]
    assert len(fans[0]) == 4 and sum(fans[0]) >= 1 and fans == [fans[0]] * len(fans)
    assert not rep["errors"]
    if "hf" in rep:  # torch installed: HF AR on the same weights agrees with ours
        assert [p["token_ids"] for p in rep["hf"]["modes"]["ar"]["prompts"]] == \
            [p["token_ids"] for p in ar["prompts"]]
    md = (out_dir / "bench.md").read_text()
    assert "| colocated | " in md and "| SSD |" in md and rep["machine"]["cpu_count"] is not None
    # the CPU's features beside the figures: in the JSON (machine and each layout) and the table
    assert rep["machine"]["cpu_features"] == cpu_features() == lay["cpu_features"]
    assert lay["backend"]["target"] == CHOICE["backend"].name
    assert f"- CPU features: {describe(cpu_features())}" in md
    assert md in out  # the table is printed too
    if importlib.util.find_spec("matplotlib") is not None:  # the plots need the notebooks extra
        for png in ("tokens_per_s.png", "hit_rate.png", "accepted_lengths.png", "speedup.png"):
            assert (out_dir / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", png


def test_prompt_file_formats(tmp_path):
    from ssd_jax.tools.bench import load_prompt_file
    plain = tmp_path / "p.txt"
    plain.write_text("first prompt\n\nsecond {not json}\n")
    assert [p["text"] for p in load_prompt_file(plain)] == ["first prompt", "second {not json}"]
    jl = tmp_path / "p.jsonl"
    jl.write_text('{"text": "a\\nb", "id": "x"}\n{"text": "c"}\n')
    got = load_prompt_file(jl)
    assert [p["text"] for p in got] == ["a\nb", "c"] and got[0]["id"] == "x"


# ------------------------------------------------------------------------------------------ errors
def assert_one_line_error(rc, err, *needles):
    assert rc not in (0, None), err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("ssd-jax: error:"), err
    assert "Traceback" not in err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.mark.parametrize("extra,needle", [
    (["--temperature", "-1"], "--temperature"),
    (["--top-p", "0"], "--top-p"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--fanout", "1,x"], "fan-out"),
    (["--fanout", "1,2"], "K+1"),
    (["--fanout", "plan"], "ssd-jax bench"),
    (["--k", "0"], "--k must be an int >= 1"),
    (["--backend", "nope"], "--backend"),
    (["--top-k", "-1"], "--top-k"),
    (["--fanout", "1,-1,1,1"], ">= 0"),
    (["--fanout", "0,0,0,0"], "positive sums"),
    (["--saguaro-c", "0"], "--saguaro-c"),
    (["--max-len", "0"], "--max-len"),
    (["--placement", "two-process", "--mode", "ar"], "--mode sd or ssd"),
    (["--saguaro-c", "2"], "--saguaro-c"),
    (["--dtype", "fp8"], "dtype"),
    (["--mode", "fast"], "--mode"),
    (["--draft-quant", "int3"], "--draft-quant"),
    (["--draft-vocab", "0"], "draft head's vocabulary"),
    (["--draft-vocab", "98"], "[1, 97]"),
    (["--bogus"], "--bogus"),
])
def test_generate_bad_flags(pair, capsys, extra, needle):
    rc, _, err = run_cli(gen_args(pair, *extra), capsys)
    assert_one_line_error(rc, err, needle)


@pytest.mark.parametrize("extra,needle", [
    (["--k", "0"], "--k must be an int >= 1"),
    (["--k", "4", "--fanout", "1,1"], "K+1"),
    (["--fanout", "1,-1,1,1,1"], ">= 0"),
    (["--saguaro-c", "1.5"], "--saguaro-c"),
    (["--temperature", "-0.5"], "--temperature"),
    (["--top-p", "1.5"], "--top-p"),
    (["--top-k", "-3"], "--top-k"),
    (["--max-new-tokens", "0"], "--max-new-tokens"),
    (["--backend", "bogus"], "--backend"),
    (["--k", "0", "--mode", "ar"], "--k must be an int >= 1"),
    (["--k", "-2", "--mode", "sd"], "--k must be an int >= 1"),
    (["--saguaro-c", "2", "--mode", "sd"], "--saguaro-c"),  # SSD knobs: checked in every mode
    (["--fanout", "1,-1", "--mode", "ar"], ">= 0"),
    (["--fanout", "1,1,1", "--k", "1"], "K+1 = 2 entries"),
    (["--max-new-tokens", "5000"], "exceeds the cache length --max-len=4096"),
    (["--max-len", "8", "--max-new-tokens", "8"], "exceeds the cache length --max-len=8"),
    (["--seed", str(2 ** 31)], "--seed must be an int"),
    (["--stop", ""], "--stop needs a non-empty string"),
    (["--prompt", ""], "the prompt is empty"),
    (["--top-p", "nan"], "--top-p"),
    (["--temperature", "inf"], "--temperature"),
    (["--draft-vocab", "0"], "draft head's vocabulary"),
    (["--placement", "two-process", "--mode", "ar"], "--mode sd or ssd"),
    (["--dtype", "fp8"], "dtype"),
    (["--k", "100"], "--k=100 is past the bound MAX_K=8"),  # issue 35: compiled for 600 s and more
    (["--fanout", "1,1,1,1,1,1,1,1,1,1"], "MAX_K=8"),
    (["--max-len", str(2 ** 20)], "--max-len must be in [2, MAX_LEN=131072]"),
])
def test_generate_checks_arguments_before_any_load(capsys, monkeypatch, tmp_path, extra, needle):
    """A bad argument is the error even with a missing --target: nothing loads, nothing starts,
    and the answer comes in well under a model load."""
    import ssd_jax.models.load as load
    from ssd_jax.runtime import transport

    def never(*a, **k):
        raise AssertionError("loaded or started before the arguments were checked")
    for mod, name in ((load, "load_model"), (load, "load_draft"), (transport, "start_two_process")):
        monkeypatch.setattr(mod, name, never)
    t0 = time.perf_counter()
    rc, _, err = run_cli(["generate", "--target", str(tmp_path / "bogus"), "--draft",
                          str(tmp_path / "bogus_draft"), "--prompt", "x", *extra], capsys)
    assert time.perf_counter() - t0 < 5
    assert_one_line_error(rc, err, needle)
    assert any(f in err for f in extra if f.startswith("--")), err  # it names a flag given
    assert str(tmp_path) not in err  # not the missing model


def test_generate_checks_files_before_any_load(capsys, monkeypatch, tmp_path):
    """An empty --prompt-file and a --cache-dir that is a file: one line, nothing loaded."""
    import ssd_jax.models.load as load

    def never(*a, **k):
        raise AssertionError("loaded before the arguments were checked")
    monkeypatch.setattr(load, "load_model", never)
    empty, a_file = tmp_path / "empty.txt", tmp_path / "not_a_dir"
    empty.write_text("")
    a_file.write_text("x")
    base = ["generate", "--target", str(tmp_path / "bogus"), "--mode", "ar"]
    rc, _, err = run_cli([*base, "--prompt-file", str(empty)], capsys)
    assert_one_line_error(rc, err, "the prompt is empty")
    rc, _, err = run_cli([*base, "--prompt", "x", "--cache-dir", str(a_file)], capsys)
    assert_one_line_error(rc, err, "--cache-dir", "is a file, not a folder")


def test_a_fanout_with_a_minus_gets_one_message_in_either_spelling(capsys, monkeypatch, tmp_path):
    """Issue 35: `--fanout -1,2` was argparse's "expected one argument", `--fanout=-1,2` the
    fan-out's own check; now both are the fan-out's message, before any load."""
    import ssd_jax.models.load as load

    monkeypatch.setattr(load, "load_model", lambda *a, **k: pytest.fail("loaded"))
    errs = []
    for spelling in (["--fanout=-1,2"], ["--fanout", "-1,2"]):
        rc, _, err = run_cli(["generate", "--target", str(tmp_path / "bogus"), "--prompt", "x",
                              *spelling], capsys)
        assert_one_line_error(rc, err, "--fanout", "must be >= 0", "'-1,2'")
        errs.append(err)
    assert errs[0] == errs[1]
    assert cli._join_dash_values(["--fanout", "-1,2", "--k", "3"]) == ["--fanout=-1,2", "--k", "3"]
    assert cli._join_dash_values(["--fanout", "--k", "3"]) == ["--fanout", "--k", "3"]


def test_file_errors_name_the_file_and_the_flag(capsys, monkeypatch, tmp_path):
    """Issue 35: a non-UTF-8 --prompt-file named neither the file nor the flag; an HF folder with
    only config.json, given as ".", named no path."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes("caf\xe9".encode("latin-1"))
    base = ["generate", "--target", str(tmp_path / "bogus"), "--mode", "ar"]
    rc, _, err = run_cli([*base, "--prompt-file", str(bad)], capsys)
    assert_one_line_error(rc, err, "--prompt-file", str(bad), "not UTF-8", "offset 3")
    rc, _, err = run_cli([*base, "--prompt-file", str(tmp_path / "absent.txt")], capsys)
    assert_one_line_error(rc, err, "--prompt-file", str(tmp_path / "absent.txt"))
    only_config = tmp_path / "only_config"
    only_config.mkdir()
    (only_config / "config.json").write_text(json.dumps(CFG.to_hf()))
    monkeypatch.chdir(only_config)
    rc, _, err = run_cli(["generate", "--target", ".", "--mode", "ar", "--prompt", "x"], capsys)
    assert_one_line_error(rc, err, "--target", str(only_config), "no *.safetensors")
    (only_config / "config.json").write_text("{}")
    rc, _, err = run_cli(["generate", "--target", ".", "--mode", "ar", "--prompt", "x"], capsys)
    assert_one_line_error(rc, err, "--target", str(only_config / "config.json"), "hidden_size")


def test_only_ssd_lets_a_fanout_set_k():
    """`--fanout 1,1` alone is SSD at K=1 (it once failed after both models loaded); with
    --mode sd the fan-out is checked but K stays SD's default."""
    for mode, k in (("ssd", 1), ("sd", cli.DEFAULT_K["sd"])):
        args = cli.build_parser().parse_args(["generate", "--prompt", "x", "--mode", mode,
                                              "--fanout", "1,1"])
        cli._validate_generate(args)
        assert args.k == k and args.fanout_used == (1, 1)


def test_console_script_checks_k_before_the_target(tmp_path):
    proc = subprocess.run([SCRIPT, "generate", "--target", str(tmp_path / "bogus"), "--prompt", "x",
                           "--k", "0"], capture_output=True, text=True, env=dict(os.environ),
                          timeout=300)
    assert_one_line_error(proc.returncode, proc.stderr, "--k must be an int >= 1")


def test_generate_model_errors(pair, capsys, tmp_path):
    rc, _, err = run_cli(["generate", "--target", str(tmp_path / "missing"), "--prompt", "x"], capsys)
    assert_one_line_error(rc, err, "missing")
    # a default name while SSD_JAX_HOME is empty: not fetched
    rc, _, err = run_cli(["generate", "--prompt", "x"], capsys)
    assert_one_line_error(rc, err, "not fetched", "ssd-jax fetch")
    rc, _, err = run_cli(["generate", "--target", pair["target"], "--draft", pair["other"],
                          "--prompt", "x", "--max-len", "256"], capsys)
    assert_one_line_error(rc, err, "different tokenizers")
    rc, _, err = run_cli(["generate", "--target", pair["target"], "--draft", pair["draft"],
                          "--prompt-file", str(tmp_path / "nope.txt")], capsys)
    assert_one_line_error(rc, err, "nope.txt")
    rc, _, err = run_cli(["generate"], capsys)
    assert_one_line_error(rc, err, "--prompt")


@pytest.mark.parametrize("which", ["--target", "--draft"])
@pytest.mark.parametrize("fault,needle", [("empty", "too short (0 bytes)"),
                                          ("truncated", "truncated")])
def test_a_broken_model_file_is_refused_before_any_process_starts(pair, capsys, monkeypatch,
                                                                  tmp_path, which, fault, needle):
    """An empty .gguf or a cut safetensors file, as --target or --draft: one line naming the flag
    and the fault, from the file's header read in this process, before the draft process
    starts or anything loads (#58: it was refused after the draft process had started)."""
    import ssd_jax.models.load as load
    from ssd_jax.runtime import transport

    def never(*a, **k):
        raise AssertionError("loaded or started before the model files were checked")
    for mod, name in ((load, "load_model"), (load, "load_draft"), (transport, "start_two_process")):
        monkeypatch.setattr(mod, name, never)
    if fault == "empty":
        bad = tmp_path / "model.gguf"
        bad.write_bytes(b"")
    else:
        bad = tmp_path / "cut"
        shutil.copytree(pair["target"], bad)
        weights = bad / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    files = {"--target": pair["target"], "--draft": pair["draft"], which: str(bad)}
    rc, _, err = run_cli(["generate", "--target", files["--target"], "--draft", files["--draft"],
                          "--placement", "two-process", "--mode", "ssd", "--prompt", "x",
                          "--max-len", "256"], capsys)
    assert_one_line_error(rc, err, which, needle)


@pytest.mark.parametrize("extra,needle", [
    (["--layouts", "colocated,bogus"], "--layouts"),
    (["--max-new-tokens", "0"], "max-new-tokens"),
    (["--fanout", "1,x"], "fan-out"),
    (["--temperature", "-1"], "--temperature"),
    (["--cores", "0"], "--cores"),
    (["--cores", "0,4096"], "may only use CPUs"),
    (["--limit", "-2"], "limit"),
    (["--fanout", "plan", "--modes", "ar,ssd"], "--fanout plan needs"),
    (["--k", "100"], "--k must be in [1, MAX_K=8]"),
    (["--fanout", "-1,2"], "must be >= 0"),
])
def test_bench_bad_flags(pair, capsys, tmp_path, extra, needle):
    rc, _, err = run_cli(["bench", "--target", pair["target"], "--draft", pair["draft"],
                          "--out", str(tmp_path / "b"), *extra], capsys)
    assert_one_line_error(rc, err, needle)
    assert not (tmp_path / "b").exists()


def test_bench_model_errors(pair, capsys, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    base = ["bench", "--prompts-file", str(prompts), "--out", str(tmp_path / "b")]
    rc, _, err = run_cli([*base, "--target", pair["target"], "--draft", pair["other"]], capsys)
    assert_one_line_error(rc, err, "different tokenizers")
    rc, _, err = run_cli(base, capsys)
    assert_one_line_error(rc, err, "not fetched")
    rc, _, err = run_cli(["bench", "--target", pair["target"], "--draft", pair["draft"],
                          "--prompts-file", str(tmp_path / "absent.jsonl")], capsys)
    assert_one_line_error(rc, err, "absent.jsonl")


def test_bench_takes_hub_ids(pair, capsys, tmp_path, monkeypatch):
    # "Org/Name" from the local HF cache, as load_model takes it: resolved (here up to the shared
    # tokenizer check, before any worker starts), or one line saying where it looked
    hub_root = tmp_path / "hf" / "hub"
    for repo_id, folder in (("Org/target", pair["target"]), ("Org/other", pair["other"])):
        org, name = repo_id.split("/")
        repo = hub_root / f"models--{org}--{name}"
        (repo / "refs").mkdir(parents=True)
        (repo / "refs" / "main").write_text("c0ffee\n")
        shutil.copytree(folder, repo / "snapshots" / "c0ffee")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub_root))
    monkeypatch.chdir(tmp_path)
    prompts = tmp_path / "p.txt"
    prompts.write_text("hello\n")
    base = ["bench", "--prompts-file", str(prompts), "--out", str(tmp_path / "b")]
    rc, _, err = run_cli([*base, "--target", "Org/target", "--draft", "Org/other"], capsys)
    assert_one_line_error(rc, err, "different tokenizers")
    rc, _, err = run_cli([*base, "--target", "Org/target", "--draft", "Org/absent"], capsys)
    assert_one_line_error(rc, err, str(hub_root / "models--Org--absent"))
    assert not (tmp_path / "b").exists()


def test_console_script_errors_have_no_traceback(pair, tmp_path):
    for args in (["generate", "--prompt", "x"],  # default pair not fetched (empty SSD_JAX_HOME)
                 ["generate", "--target", pair["target"], "--prompt", "x", "--fanout", "1,x"]):
        proc = subprocess.run([SCRIPT, *args], capture_output=True, text=True, env=dict(os.environ),
                              timeout=300)
        assert_one_line_error(proc.returncode, proc.stderr)


# ------------------------------------------------------------------------------------------ real pair
@pytest.mark.slow
def test_real_default_pair_ssd_json(monkeypatch):
    """`ssd-jax generate --mode ssd` on the fetched Qwen pair (CI fetches them)."""
    if REAL_HOME is None:
        monkeypatch.delenv("SSD_JAX_HOME")
    else:
        monkeypatch.setenv("SSD_JAX_HOME", REAL_HOME)
    monkeypatch.delenv("SSD_JAX_COMPILE_CACHE")
    from ssd_jax.models import registry
    for name in (registry.DEFAULT_TARGET, registry.DEFAULT_DRAFT):
        registry.fetch(name, progress=False)  # fails, never skips, when the weights cannot be had
    proc = subprocess.run([SCRIPT, "generate", "--prompt", "def fibonacci(n):", "--mode", "ssd",
                           "--max-new-tokens", "8", "--json"], capture_output=True, text=True,
                          env=dict(os.environ), timeout=1800)
    assert proc.returncode == 0, proc.stderr[-3000:]
    obj = json.loads(proc.stdout)
    assert obj["metrics"]["mode"] == "ssd"
    assert 1 <= len(obj["token_ids"]) <= 8 and obj["text"]
