"""Muon + AdamW against AdamW alone: same model, same data, same tokens, each at its own best learning rate.

    python tools/compare_optimizers.py                       # tiny preset, 200 steps, on whatever device is found
    python tools/compare_optimizers.py --preset small --steps 2000 --threads 0

Every run is `gpu_training_optimized.py` in its own process and run folder under --out. The rate is tuned on
the first seed: AdamW's --learning_rate, and Muon's --muon_lr (its AdamW part, embeddings and norms, keeps
the preset's rate), each over the preset's value times --factors, picked by final validation loss. The best
rate of each then runs on the other seeds. Finished runs are reused, so an interrupted comparison continues.
Writes results.json and curves.png into --out and prints a Markdown table for the README.
"""

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from config import PRESETS
from llm.base.errors import error_contract
from llm.reports.monitor import read_metrics

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
RATE_FLAG = {"adamw": "learning_rate", "muon": "muon_lr"}


def run_once(args, optimizer: str, lr: float, seed: int) -> dict:
    """Train one run (or reuse a finished one); its train curve and final validation numbers."""
    run_dir = os.path.join(args.out, f"{optimizer}_lr{lr:g}_seed{seed}")
    if not finished(run_dir, args.steps):
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short starts over
        os.makedirs(args.out, exist_ok=True)
        cmd = [sys.executable, os.path.join(HERE, "gpu_training_optimized.py"), "--preset", args.preset,
               "--max_steps", str(args.steps), "--optimizer", optimizer, f"--{RATE_FLAG[optimizer]}", str(lr),
               "--seed", str(seed), "--run_dir", run_dir, "--compile", args.compile,
               "--eval_interval", str(max(1, args.steps // 4)), "--save_interval", str(args.steps),
               "--log_interval", str(args.log_interval), "--keep_checkpoints", "1", *args.extra]
        env = dict(os.environ, **({"OMP_NUM_THREADS": str(args.threads)} if args.threads else {}))
        log = run_dir + ".log"
        print(f"running {optimizer} lr {lr:g} seed {seed} (log: {log})", flush=True)
        with open(log, "w", encoding="utf-8") as f:
            if subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT).returncode != 0:
                sys.exit(f"error: the run failed; the end of {log}:\n" + "".join(open(log).readlines()[-5:]))
    evals = read_metrics(run_dir, "eval")
    return {"optimizer": optimizer, "lr": lr, "seed": seed,
            "train": [(r["step"], r["loss"]) for r in read_metrics(run_dir, "train")],
            "val_loss": evals[-1]["val_loss"], "val_bpb": evals[-1]["val_bpb"]}


def finished(run_dir: str, steps: int) -> bool:
    """Whether the run in run_dir got as far as its last evaluation."""
    return any(r.get("step") == steps for r in read_metrics(run_dir, "eval"))


def mean_curve(runs: list[dict]) -> list[tuple[int, float]]:
    """The train loss averaged over seeds at every logged step."""
    return [(points[0][0], statistics.fmean(loss for _, loss in points))
            for points in zip(*(r["train"] for r in runs))]


def first_step_at_or_below(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, loss in curve if loss <= target), None)


def plot(best: dict, out: str):
    """curves.png: each seed faint, the mean over seeds bold, one colour per optimizer."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for (name, runs), colour in zip(best.items(), ("tab:blue", "tab:orange")):
        for r in runs:
            ax.plot(*zip(*r["train"]), color=colour, alpha=0.25, linewidth=0.8)
        ax.plot(*zip(*mean_curve(runs)), color=colour, linewidth=2,
                label=f"{name}, lr {runs[0]['lr']:g}, {len(runs)} seeds")
    low = min(loss for runs in best.values() for r in runs for _, loss in r["train"])
    ax.set_ylim(low - 0.1, low + 2.5)  # the first steps' loss would flatten the part worth seeing
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("train loss (nats/token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out, "curves.png"), dpi=110)
    plt.close(fig)


def parse_args(argv=None) -> argparse.Namespace:
    """The command line (the documentation's commands are checked against it)."""
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", default="tiny", choices=[p for p in PRESETS if p != "auto"])
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    parser.add_argument("--factors", type=float, nargs="+", default=[0.5, 1.0, 2.0],
                        help="learning rates tried: the preset's rate times each")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2],
                        help="the first one tunes the rate")
    parser.add_argument("--log_interval", type=int, default=10)
    parser.add_argument("--compile", default="off", help="compile mode of each run (see "
                                                         "the trainer's --compile)")
    parser.add_argument("--threads", type=int, default=0, help="CPU threads per run; 0: torch's default")
    parser.add_argument("--out", default="runs/compare_optimizers")
    parser.add_argument("extra", nargs="*", help="more trainer flags, after --")
    return parser.parse_args(argv)


@error_contract
def main(argv=None):
    args = parse_args(argv)
    base = PRESETS[args.preset]().train
    base_rate = {"adamw": base.learning_rate, "muon": base.muon_lr}
    sweep, best = {}, {}
    for optimizer in ("adamw", "muon"):
        tried = [run_once(args, optimizer, base_rate[optimizer] * f, args.seeds[0]) for f in args.factors]
        sweep[optimizer] = [{"lr": r["lr"], "val_loss": r["val_loss"]} for r in tried]
        winner = min(tried, key=lambda r: r["val_loss"] if math.isfinite(r["val_loss"]) else math.inf)
        best[optimizer] = [winner] + [run_once(args, optimizer, winner["lr"], s) for s in args.seeds[1:]]
    plot(best, args.out)

    adamw_final = mean_curve(best["adamw"])[-1][1]
    reach = first_step_at_or_below(mean_curve(best["muon"]), adamw_final)
    summary = {"preset": args.preset, "steps": args.steps, "sweep": sweep,
               "steps_for_muon_to_reach_adamw_final": reach,
               "best": {k: [{key: r[key] for key in ("lr", "seed", "val_loss", "val_bpb")} for r in runs]
                        for k, runs in best.items()}}
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)

    print(f"\n{args.preset} preset, {args.steps} steps, seeds {args.seeds}; "
          f"rate tuned on seed {args.seeds[0]}")
    print("| optimizer | rates tried (final val loss) | best rate | final val bpb, mean ± sd over seeds |")
    print("|---|---|---|---|")
    for name, runs in best.items():
        tried = ", ".join(f"{s['lr']:g} ({s['val_loss']:.3f})" for s in sweep[name])
        bpb = [r["val_bpb"] for r in runs]
        sd = statistics.stdev(bpb) if len(bpb) > 1 else 0.0
        print(f"| {name} | {tried} | {runs[0]['lr']:g} | {statistics.fmean(bpb):.4f} ± {sd:.4f} |")
    print(f"\nMuon's mean train loss reaches AdamW's final ({adamw_final:.3f}) at step "
          f"{reach if reach is not None else 'never'} of {args.steps}; curves in {args.out}/curves.png")


if __name__ == "__main__":
    sys.exit(main())
