"""The language task's training step at the paper profile's shape, with its native parts on and off.

One step is what ``nalu-cuda language`` trains per step (``tasks/language.py``: the 169 training
phrases through embedding -> LSTM -> head, the squared loss, backward, and ``FlatAdam``'s step with
the paper's two learning rates per member and per-member gradient clipping at 100), for E = 20
members (2 learning rates x 10 seeds) at the paper's sizes (embedding 256, LSTM 10 or 20 units).

Rows (the same model, data and parameters in every row):

* ``torch``: the LSTM's sequence as torch ops (``_LSTMSequence``) and Adam as tensor ops: the
  step before the native parts;
* ``native LSTM``: the sequence as ``nalu_cuda::lstm_sequence_forward``/``_backward``
  (``csrc/experiments/cpu/lstm_sequence.cpp``), Adam as tensor ops;
* ``native``: the native sequence and the fused CPU Adam step (``flat_adam_step`` with the
  members' learning rates and the clip), as the task runs now.

``--steps`` steps are timed after 10 warm-up steps; ``--repeats`` rounds time every row once,
interleaved, each row the median of its rounds. One intra-op thread unless ``--threads``.

    python benchmarks/bench_sequence_step.py                         # about a minute
    python benchmarks/bench_sequence_step.py --heads nalu --hidden 20 --steps 20 --repeats 1   # smoke
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

import harness  # benchmarks/harness.py (this script's folder is on sys.path)
from nalu_cuda.experiments.parts.number_words import make_split, tokens_tensor
from nalu_cuda.experiments.parts.optim import FlatAdam
from nalu_cuda.experiments.tasks.language import HEADS, NumberReader

E_SEEDS, LRS, EMB, CLIP = 10, (1e-3, 1e-2), 256, 100.0
ROWS = ("torch", "native LSTM", "native")


def step_rate(head: str, hidden: int, row: str, steps: int) -> float:
    """Training steps per second of `row` (one of ROWS) over `steps` steps after a warm-up."""
    split = make_split(0)
    tok, mask = tokens_tensor(split["train"])
    y = torch.tensor(split["train"], dtype=torch.float32)
    members = [(lr, s) for lr in LRS for s in range(E_SEEDS)]
    E = len(members)
    torch.manual_seed(0)
    model = NumberReader(E, head, EMB, hidden)
    model.reset_parameters([s for _, s in members])
    model.lstm.native = row != "torch"
    opt = FlatAdam(model.parameters(), [lr for lr, _ in members], ensemble=E, clip=CLIP)
    if row != "native":
        opt._segments = (E, None)  # no fused step: Adam and the clip as tensor ops
    frozen = torch.zeros(E, dtype=torch.bool)
    t0 = 0.0
    for i in range(steps + 10):
        if i == 10:
            t0 = time.perf_counter()
        opt.zero_grad()
        loss = ((model.predict(tok, mask) - y) ** 2).mean(-1)
        loss.sum().backward()
        opt.step_ensemble(frozen, freeze_nonfinite=False)
    return steps / (time.perf_counter() - t0)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", nargs="+", default=["linear", "nalu"], choices=HEADS)
    ap.add_argument("--hidden", nargs="+", type=int, default=[10, 20])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=f"{harness.RESULTS}/sequence_step")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    rows, table = [], []
    for head in args.heads:
        for hidden in args.hidden:
            runs = {row: (lambda row=row: step_rate(head, hidden, row, args.steps)) for row in ROWS}
            rounds = harness.interleaved(runs, args.repeats)
            ms = {row: 1e3 / statistics.median(v) for row, v in rounds.items()}
            rows.append({"head": head, "emb": EMB, "hidden": hidden, "members": 2 * E_SEEDS,
                         **{f"{row} (ms)": round(ms[row], 3) for row in ROWS},
                         **{f"{row} rounds (steps/s)": [round(x, 2) for x in rounds[row]] for row in ROWS}})
            table.append([head, f"{EMB} x {hidden}", *(f"{ms[r]:.2f}" for r in ROWS),
                          f"{ms['torch'] / ms['native LSTM']:.2f}x", f"{ms['torch'] / ms['native']:.2f}x"])
            print(" | ".join(table[-1]), flush=True)
    md = harness.markdown_table(["head", "size", *(f"{r} (ms)" for r in ROWS), "native LSTM speed-up",
                                 "native speed-up"], table)
    meta = harness.machine("cpu", command=harness.command(__file__, argv), threads=args.threads,
                           steps=args.steps, repeats=args.repeats)
    for path in harness.write(args.out, meta, rows, md, title="The language task's training step"):
        print("wrote", path)


if __name__ == "__main__":
    main()
