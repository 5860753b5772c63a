"""docs/gpu_report.md, the GPU check's report: one table of the --quick figures, a row for each that was
measured (or failed), then a section for each longer part (tools/gpu_check.py writes each part's JSON, then
this)."""

import json
import os


def overhead_words(overhead: float | None) -> str:
    """A share of time lost, in words: "2.0% slower than plain", "85.0% faster than plain" (a negative loss).
    """
    if overhead is None:
        return "not measured (no tokens/s logged)"
    return f"{100 * abs(overhead):.1f}% {'slower' if overhead >= 0 else 'faster'} than plain"


def quick_table(found: dict) -> list[str]:
    """--quick's figures as one table, a row for each that was measured."""
    pct = lambda v: f"{100 * v:.1f}%" if v else "n/a"  # noqa: E731
    rows = [(f"part `{name}`", f"failed: {part['failed']}")
            for name, part in found.items() if "failed" in part]
    found = {name: part for name, part in found.items() if "failed" not in part}
    if "default_run" in found:
        d = found["default_run"]
        corpus = "FineWeb-Edu, the GPU default," if d["default_corpus"] else \
            "FineWeb-Edu's path by --sources (a dry run),"
        rows.append(("the no-flag trainer as a first run, stopped "
                     f"{d['stopped_after_s']:.0f} s after its first step",
                     f"`{d['preset']}` at {d['batch']}; first step {d['first_step_s']:.0f} s after launch, "
                     f"then {d['steps']} steps, {d['tokens_per_s']:,.0f} tokens/s, MFU {pct(d['mfu'])}, "
                     f"{d['vram_gb']:.1f} GB; {corpus} {d['files_fetched']} file(s) from a stand-in Hub "
                     "holding the bundled corpus's text (no network "
                     f"here){', training while they arrived' * d['while_arriving']}"))
    for r in found.get("first_token", {}).get("rows", []):
        rows.append((f"one-shot generation, {r['mode']}", f"{r['launch_to_exit_s']:.1f} s launch to exit"
                     + (f" ({r['compile_s']:.0f} s compiling)" if r["compile_s"] else "")))
    if "first_reply" in found.get("first_token", {}):
        r = found["first_token"]["first_reply"]
        rows.append(("a prompt on stdin (as the REPL), decode step compiling in the background",
                     f"failed: {r['error'].splitlines()[-1]}" if "error" in r else
                     f"reply {r['loaded_to_reply_s']:.1f} s after the model loaded, "
                     f"{r['launch_to_exit_s']:.1f} s launch to exit"))
    train = found.get("quick_throughput", {}).get("rows", [])
    for ours, hf in zip(train[::2], train[1::2]):
        rows.append((f"training `{ours['preset']}`, {ours['batch']}, bf16",
                     f"ours {ours['tokens_per_s']:,.0f} tokens/s, MFU {pct(ours['mfu'])}, "
                     f"{ours.get('peak_gib') or 0:.1f} GiB; Hugging Face {hf['tokens_per_s']:,.0f} "
                     f"({pct(hf['mfu'])}): {ours['tokens_per_s'] / hf['tokens_per_s']:.2f}x"))
    for r in found.get("fp8", {}).get("rows", []):
        layers = "{} of {} linear layers".format(*r["fp8_layers"])
        rows.append((f"training `large`, FP8 in {layers}", f"{r['tokens_per_s']:,.0f} "
                                                           f"tokens/s, MFU {pct(r['mfu'])}"))
    if "skipped" in found.get("fp8", {}):
        rows.append(("training `large`, FP8", found["fp8"]["skipped"]))
    if "quick_autotune" in found:
        (d, t), pays = found["quick_autotune"]["rows"], found["quick_autotune"]["pays_after_s"]
        rows.append(("training `large`, max-autotune against compile default, empty compile caches",
                     f"{t['tokens_per_s']:,.0f} tokens/s against {d['tokens_per_s']:,.0f}: "
                     f"{t['tokens_per_s'] / d['tokens_per_s']:.3f}x; compile and warmup "
                     f"{t['warmup_s']:.0f} s against {d['warmup_s']:.0f} s; "
                     + (f"pays for its compile after {pays / 60:.1f} minutes of training"
                        if pays is not None else "never pays: no faster")))
    for r in found.get("quick_graphs", {}).get("rows", []):
        rows.append(("CUDA graphs (reduce-overhead) under accumulation 4",
                     f"largest relative loss difference {r['max_relative_difference']:.1e} over "
                     f"{len(r['losses'])} steps, within bf16 noise: {r['within_noise']}"))
    dec, leads = found.get("decode", {}), found.get("decode_leads", {})
    for r in dec.get("rows", []) + leads.get("rows", []):
        lead = f", {r['lead']}" if "lead" in r else ""
        rows.append((f"decode, `{dec.get('shape') or leads['shape']}` shape, batch {r['batch']}{lead}",
                     f"{r['tokens_per_s']:,.0f} tokens/s, {r['ms_per_step']:.2f} ms a step, "
                     f"{pct(r['bound_share'])} of the bandwidth bound"))
    if dec:
        rows.append(("greedy tokens against transformers (trained checkpoint, float32)",
                     "identical" if dec["greedy_identical"] else "DIFFERENT"))
    for lead, same in leads.get("greedy_identical", {}).items():
        rows.append((f"the same, {lead}", "identical" if same else "DIFFERENT"))
    for lead, error in leads.get("errors", {}).items():
        rows.append((f"decode with {lead}", f"failed: {error}"))
    if "short_budget" in found:
        b = found["short_budget"]
        rows.append(("`--preset small --max_minutes 1`, cold compile cache",
                     f"failed: {b['error'].splitlines()[-1]}" if "error" in b
                     else f"{b['steps']} steps, {b['seconds']:.0f} s launch to exit, checkpoint "
                          f"{'written' if b['checkpoint'] else 'MISSING'}"
                          f"{', a traceback' if b['traceback'] else ''}"))
    for r in found.get("beside_preparation", {}).get("rows", []):
        rounds = {k: ", ".join(f"{v:,.0f}" for v in r[f"{k}_tokens_per_s"]) for k in ("beside", "alone")}
        rows.append(("training `small` beside a thread preparing a token cache (a Hub corpus arriving)",
                     f"{r['ratio']:.2f}x the tokens/s alone (tokens/s by round: {rounds['beside']} beside, "
                     f"{rounds['alone']} alone)"))
    if "scores" in found:
        s = found["scores"]
        items, seconds = sum(t["items"] for t in s["rows"]), sum(t["seconds"] for t in s["rows"])
        first = max(t["items"] for t in s["rows"])
        rows.append(("evaluate.py's default suite on the first run's checkpoint, the "
                     f"first {first} items of each task",
                     f"{items:,} items in {seconds:.0f} s ({items / max(seconds, 1e-9):,.0f} items/s), "
                     f"{s['launch_to_exit_s']:.0f} s launch to exit; accuracy "
                     + ", ".join(f"{t['task']} {100 * t['acc']:.1f}%" for t in s["rows"])))
    if not rows:
        return []
    return ["| what | result |", "| --- | --- |", *[f"| {a} | {b} |" for a, b in rows], ""]


def write_report(out: str, path: str, parts: tuple):
    """docs/gpu_report.md from the JSON of each of these parts found in out."""
    found = {p: json.load(open(os.path.join(out, f"{p}.json"))) for p in parts
             if os.path.isfile(os.path.join(out, f"{p}.json"))}
    meta = next(iter(found.values()), {}).get("meta", {})
    table, found = quick_table(found), {name: part for name, part in found.items() if "failed" not in part}
    lines = ["# GPU report", "",
             f"Written by `python tools/gpu_check.py{' --quick' * meta.get('quick', False)}` on "
             f"{meta.get('device', 'n/a')}, torch {meta.get('torch', 'n/a')}, {meta.get('date', '')}.", ""]
    lines += table
    for part in ("throughput", "autotune", "quick_throughput"):
        if part in found:
            lines += [f"## Training throughput, {part}", "",
                      "| preset | batch | model | tokens/s | MFU | peak GiB | "
                      "estimate GiB | optimizer share |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
            for r in found[part]["rows"]:
                mfu = f"{100 * r['mfu']:.1f}%" if r.get("mfu") else "n/a"
                share = f"{100 * r['share']:.1f}%" if "share" in r else ""
                peak = f"{r['peak_gib']:.1f}" if r.get("peak_gib") is not None else "n/a"
                lines.append(f"| {r['preset']} | {r.get('batch', '')} | {r['model']} | "
                             f"{r['tokens_per_s']:,.0f} | {mfu} | {peak} | "
                             f"{r['estimate_gib']:.1f} | {share} |")
            lines.append("")
    if "graphs" in found:
        lines += ["## CUDA-graph modes against compile default", "",
                  "| mode | accumulation | largest relative loss difference | within bf16 noise |",
                  "| --- | --- | --- | --- |"]
        lines += [f"| {r['mode']} | {r['grad_accum_steps']} | {r['max_relative_difference']:.2e} | "
                  f"{r['within_noise']} |" for r in found["graphs"]["rows"]] + [""]
    if "startup" in found:
        s = found["startup"]
        lines += ["## Start-up and DDP", "", f"- launch to first step (`large`, data prepared): "
                  f"{s['launch_to_first_step_s']:.1f} s", f"- DDP on one GPU: "
                  f"{overhead_words(s['ddp_overhead'])} python ({s['tokens_per_s']['ddp']:,.0f} against "
                  f"{s['tokens_per_s']['plain']:,.0f} tokens/s)", ""]
    if "curves" in found:
        c = found["curves"]
        lines += ["## Loss curves", ""]
        lines += [f"- {k.replace('_vs_', ' against ')}: largest relative loss difference "
                  f"{v['max_relative_difference']:.3f} over the second half, final {v['final'][0]:.3f} "
                  f"against {v['final'][1]:.3f}" for k, v in c.items() if "_vs_" in k]
        lines += [f"- fp8: {c['fp8']}" if isinstance(c.get("fp8"), str) else "", ""]
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        f.write("\n".join(lines).rstrip() + "\n")
