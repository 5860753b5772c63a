"""Recipe changes measured at equal tokens: each variant against the default, on the same seeds.

    python tools/ablate.py --steps 2300 --seeds 0 1 --variants "wsd=--lr_schedule wsd --min_lr_ratio 0"
    python tools/ablate.py --preset small --steps 300 --variants "wsd=--lr_schedule wsd --min_lr_ratio 0"

Every run is `gpu_training_optimized.py` on the default corpus (or --sources) for exactly --steps steps, in a
process and run folder of its own under --out; a finished run is reused, so an interrupted ablation continues.
The baseline is the trainer's defaults with the same preset, steps and seeds. Each run ends with a full
evaluation on the same validation split, so the figures compare: bits per byte per seed, their mean, and the
change against the baseline with the spread of its seeds. A change is kept only where it wins beyond that
spread. The trainer's evaluation reads a sample of the split's windows and counts their bytes by the split's
average; each finished run is also scored on every token of the validation split with its exact bytes
(text_generator.py --eval's measure), which is what compares variants that change the tokenizer. Prints a
Markdown table for docs/training.md; writes results.json into --out.
"""

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project's modules

from config import DataConfig
from llm.base import atomic
from llm.base.errors import ConfigError, error_contract
from llm.data.preparation import split_texts
from llm.generate.inference import load_for_inference
from llm.reports.monitor import read_metrics
from llm.scores.evaluation import bits_per_byte

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the project root
BASELINE = "baseline"


def run_once(args, name: str, flags: list[str], seed: int) -> dict:
    """Train one run (or reuse a finished one); its last evaluation and seconds."""
    run_dir = os.path.join(args.out, f"{name}_seed{seed}")
    if not any(r.get("step") == steps_of(flags, args.steps) for r in read_metrics(run_dir, "eval")):
        shutil.rmtree(run_dir, ignore_errors=True)  # a run cut short starts over
        os.makedirs(args.out, exist_ok=True)
        cmd = [sys.executable, os.path.join(HERE, "gpu_training_optimized.py"), "--preset", args.preset,
               "--max_steps", str(args.steps), "--max_minutes", "0", "--seed", str(seed),
               "--run_dir", run_dir, "--eval_interval", str(args.steps), "--save_interval", str(args.steps),
               "--keep_checkpoints", "1", *(["--sources", *args.sources] if args.sources else []),
               *args.extra, *flags]
        print(f"running {name} seed {seed}: {' '.join(cmd[2:])}", flush=True)
        with open(run_dir + ".log", "w", encoding="utf-8") as f:
            if subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=HERE).returncode != 0:
                tail = "".join(open(run_dir + ".log", encoding="utf-8").readlines()[-5:])
                sys.exit(f"error: {name} seed {seed} failed; the end of {run_dir}.log:\n{tail}")
    last = read_metrics(run_dir, "eval")[-1]
    trains = read_metrics(run_dir, "train")
    return {"name": name, "seed": seed, "val_bpb": last["val_bpb"], "val_loss": last["val_loss"],
            "whole_bpb": whole_split_bpb(run_dir, args.sources),
            "tokens": trains[-1]["tokens"] if trains else None}


def steps_of(flags: list[str], default: int) -> int:
    """A run's length: the variant's own (last) --max_steps, where it sets one (equal time for a larger model,
    say), else --steps. A run whose last evaluation is at that step is finished."""
    given = [flags[i + 1] for i, flag in enumerate(flags[:-1]) if flag == "--max_steps"]
    return int(given[-1]) if given else default


def whole_split_bpb(run_dir: str, sources: list[str]) -> float:
    """Bits per byte of the run's last checkpoint on every token of the validation split (exact bytes), kept
    in the run folder once measured."""
    path = os.path.join(run_dir, "whole_split.json")
    if not os.path.exists(path):
        model, tokenizer, *_ = load_for_inference(run_dir, "cpu")
        result = bits_per_byte(model, tokenizer, split_texts(DataConfig(sources=sources)))
        atomic.write_text(path, json.dumps(result))  # a run stopped while writing leaves no half a file
    with open(path, encoding="utf-8") as f:
        return json.load(f)["bits_per_byte"]


def variants_of(args) -> dict[str, list[str]]:
    out = {BASELINE: []}
    for spec in args.variants:
        name, sep, flags = spec.partition("=")
        if not sep or not name or name == BASELINE or name in out:
            raise ConfigError(f"--variants {spec!r}: give NAME=FLAGS with a new name (not {BASELINE!r})")
        out[name] = flags.split()
    return out


def table(results: list[dict], seeds: list[int], key: str = "val_bpb") -> str:
    base = {r["seed"]: r[key] for r in results if r["name"] == BASELINE}
    names = list(dict.fromkeys(r["name"] for r in results))
    lines = [f"| change | {' | '.join(f'seed {s}' for s in seeds)} | mean | against the baseline |",
             "| --- |" + " --- |" * (len(seeds) + 2)]
    for name in names:
        bpb = {r["seed"]: r[key] for r in results if r["name"] == name}
        deltas = [bpb[s] - base[s] for s in seeds]
        change = "" if name == BASELINE else (f"{statistics.mean(deltas):+.4f} (per seed "
                                               f"{', '.join(f'{d:+.4f}' for d in deltas)})")
        lines.append(f"| {name} | {' | '.join(f'{bpb[s]:.4f}' for s in seeds)} | "
                     f"{statistics.mean(bpb.values()):.4f} | {change} |")
    return "\n".join(lines)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variants", nargs="+", required=True, help="NAME=TRAINER FLAGS, each "
                                                                "against the baseline")
    p.add_argument("--steps", type=int, default=2300, help="optimizer steps of every run (equal tokens)")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    p.add_argument("--preset", default="tiny")
    p.add_argument("--sources", nargs="*", default=[], help="the corpus; default: the "
                                                            "trainer's default corpus")
    p.add_argument("--out", default="runs/ablate", help="run folders, logs and results.json")
    p.add_argument("--extra", nargs=argparse.REMAINDER, default=[], help="trainer flags for every run, last")
    return p.parse_args(argv)


@error_contract
def main(argv=None) -> int:
    args = parse_args(argv)
    results = [run_once(args, name, flags, seed) for seed in args.seeds
               for name, flags in variants_of(args).items()]  # seed by seed: a first result comes early
    with open(os.path.join(args.out, "results.json"), "w", encoding="utf-8") as f:
        json.dump(results, f, indent=1)
    tokens = results[0]["tokens"]
    print(f"\n{args.preset} preset, {args.steps} steps ({tokens:,} tokens) a run, seeds "
          f"{', '.join(map(str, args.seeds))}; validation bits per byte (lower is better), the trainer's "
          "evaluation\n")
    print(table(results, args.seeds))
    print("\nthe same runs on every token of the validation split, exact bytes (compare tokenizers here)\n")
    print(table(results, args.seeds, key="whole_bpb"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
