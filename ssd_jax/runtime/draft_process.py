"""The draft process of the two-process transport (`python -m ssd_jax.runtime.draft_process`).

Serves the target process's messages with a `DraftWorker` on its own device. After every
speculation it sends (round 1's backup, or a resolve), it dispatches the tree for that speculation
at once, so the tree runs while the target verifies it.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from ssd_jax.runtime.transport import DRAFT, Channel, _init


def _load(spec: str, dtype: str, cache_dir: str | None, quant: str = "none",
          draft_vocab: int | None = None):
    from ssd_jax.models.load import load_draft

    path = Path(spec)
    # An HF folder without tokenizer files (how tests ship tiny random drafts) loads without one.
    with_tok = not (path.is_dir() and not (path / "tokenizer.json").exists())
    # No orbax cache here: orbax coordinates across all processes of the jax.distributed runtime,
    # and only this one is loading.
    model = load_draft(spec, dtype, quant, draft_vocab, cache_dir=cache_dir, use_cache=False,
                       with_tokenizer=with_tok)
    if model.tokenizer is None:
        return model, model.cfg.vocab_size, None
    return model, model.tokenizer.vocab_size, model.tokenizer.fingerprint()


def serve(channel: Channel, model) -> None:
    """Answer the target's messages (start, ready, propose, first, resolve, finish) with a
    `DraftWorker` for `model` on this process's devices until "shutdown"; after each speculation
    sent, dispatch its tree and wait for it."""
    import jax

    from ssd_jax.runtime.draft_worker import DraftWorker
    from ssd_jax.runtime.placement import make_placement

    worker = None
    while True:
        msg = channel.recv()
        kind = msg[0]
        if kind == "shutdown":
            jax.distributed.shutdown()
            return
        if kind == "start":
            _, tokens, lens, cache_len, row_vocab = msg
            if worker is None or worker.row_vocab != row_vocab:
                placement = make_placement("colocated", jax.local_devices())
                worker = DraftWorker(model, placement.draft, row_vocab)
            worker.start(tokens, lens, cache_len)
        elif kind == "ready":
            worker.ready()
            channel.send(True)
        elif kind == "propose":
            _, s, run = msg
            spec, rows = worker.propose(s, run)
            channel.send((np.asarray(spec), np.asarray(rows)))
        elif kind == "first":
            _, s, run = msg
            spec, rows = worker.backup(s, run)
            channel.send((np.asarray(spec), np.asarray(rows)))
            worker.dispatch_tree(s, spec, np.ones(len(s.n), bool), run, wait=True)
        elif kind == "resolve":
            _, k_acc, bonus, s, run = msg
            spec, rows, hit, times = worker.resolve(k_acc, bonus, s, run)
            channel.send((np.asarray(spec), np.asarray(rows), hit, times))
            if s.active.any():
                worker.dispatch_tree(s, spec, ~hit & s.active, run, wait=True)
        elif kind == "finish":
            worker._tree = None
        else:
            raise RuntimeError(f"draft process: unknown message {kind!r}")


def main(argv=None) -> None:
    """Command line: join the coordinator as the draft process, load the draft (or send the target
    the error), send its vocabulary and tokenizer fingerprint, then `serve`."""
    p = argparse.ArgumentParser()
    p.add_argument("--coordinator", required=True)
    p.add_argument("--draft", required=True)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--quant", choices=("none", "int8", "int4"), default="none")
    p.add_argument("--draft-vocab", type=int, default=None)
    p.add_argument("--cpu", type=int, default=None)
    p.add_argument("--cache-dir", default=None)
    a = p.parse_args(argv)
    _init(a.coordinator, DRAFT, a.cpu)
    channel = Channel()
    try:
        model, vocab_size, fingerprint = _load(a.draft, a.dtype, a.cache_dir, a.quant, a.draft_vocab)
    except Exception as e:  # tell the target instead of leaving it waiting
        channel.send({"error": f"{type(e).__name__}: {e}"})
        return
    import jax

    from ssd_jax.models.backends import select
    channel.send({"vocab_rows": model.cfg.vocab_size, "vocab_size": vocab_size,
                  "fingerprint": fingerprint, "name": a.draft,
                  "backend": select("auto", jax.local_devices()[:1]).name})
    serve(channel, model)


if __name__ == "__main__":
    main()
