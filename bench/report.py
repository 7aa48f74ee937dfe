"""Assemble docs/BENCHMARKS.md from the result files under bench/results/.

For every `NAME.json` there (ours and other issues' workloads alike): a section with the
workload's description, the command that produced it, the machine it ran on, its
Markdown tables (`NAME.md`), its plot (`NAME.png`, copied to docs/img/) and, when the
workload module has a `describe(result)` function, the paragraph it computes from the
numbers. Run it with `python -m bench.report` (or `make bench`, which runs every
workload first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from bench import common
from bench.cli import WORKLOADS

SECTION_ORDER = ("engine", "store", "long-doc-qa", "multi-round-qa", "rag", "agent-replay", "throughput",
                 "zero-reuse", "preemption", "chunked-prefill", "cross-instance")
INTRO = """\
# Benchmarks

Every number here comes from a result file under `bench/results/`; `make bench` reruns
every registered workload and regenerates this page (`python -m bench.report`; a subset:
`make bench BENCH_WORKLOADS="rag throughput"`). Each section gives the exact command, the
machine, the tables the workload wrote, its plot, and a paragraph computed from its
numbers that says what they mean and where the time goes (a torch.profiler run of the
workload's slowest path).

How to read them. The machine is a small CPU box shared with other jobs, so wall times
are noisy; the workloads of this suite therefore run torch single-threaded (`--threads
1`: two intra-op threads that spin-wait for each other on a contended core made every op
several times slower), record the load average before and after, and also report CPU
time, which counts the work done whatever else runs. Comparisons are made inside one
command: the variants run on the same model in the same process, one after another
(interleaved across repeats where a workload has `--repeats`), and percentiles pool
every request of a variant. With tens of requests per group, a p99 is close to the
maximum. The built-in model has random weights: its text is meaningless, its cost and
cache behaviour are those of a real 8-layer Llama (hidden 512, 2 KV heads), run in bf16.
No GPU was available: every number is a CPU number.
"""


@dataclass
class Result:
    name: str
    data: dict
    markdown: str
    png: Path | None


def load_results(directory: Path) -> list[Result]:
    """Every result in `directory`, named as its workload (`long_doc_qa.json` is `long-doc-qa`)."""
    found = {}
    for path in directory.glob("*.json"):
        md, png = path.with_suffix(".md"), path.with_suffix(".png")
        name = path.stem.replace("_", "-")
        found[name] = Result(name, json.loads(path.read_text()),
                             md.read_text() if md.exists() else "", png if png.exists() else None)
    ordered = [n for n in SECTION_ORDER if n in found] + sorted(n for n in found if n not in SECTION_ORDER)
    return [found[n] for n in ordered]


def machine_line(data: dict) -> str:
    m = data.get("machine", {})
    gpu = m.get("cuda") or "no GPU"
    cpu = m.get("cpu_model", m.get("platform", "?"))
    return (f"{cpu}, {m.get('cpu_count')} cores ({m.get('torch_threads')} torch threads), {gpu}; "
            f"Python {m.get('python')}, torch {m.get('torch')}, transformers {m.get('transformers')}")


def model_line(data: dict) -> str:
    model = data.get("model")
    if not isinstance(model, dict):
        return f"model: {model or 'built-in default'}"
    shape = ", ".join(f"{k} {model[k]}" for k in ("num_hidden_layers", "hidden_size", "num_key_value_heads",
                                                  "head_dim", "vocab_size") if k in model)
    options = data.get("options") or data.get("args") or {}
    dtype = options.get("dtype", model.get("dtype", "?"))
    return f"model: {Path(str(model.get('path', '?'))).name} ({shape}), run in {dtype}"


def run_line(data: dict) -> str:
    """When it ran and how busy the shared cores were (1-minute load average)."""
    text = f" Run started {data['started']}." if "started" in data else ""
    loads = [data.get(k) for k in ("load_average_start", "load_average_end")]
    if all(loads):
        text += f" Load average {loads[0][0]:.1f} at the start, {loads[1][0]:.1f} at the end."
    return text


def describe(result: Result) -> str:
    if result.name not in WORKLOADS:
        return ""
    module = importlib.import_module(WORKLOADS[result.name][0])
    describer = getattr(module, "describe", None)
    return describer(result.data) if describer else ""


def section(result: Result, out: Path, img_dir: Path) -> str:
    description = WORKLOADS.get(result.name, ("", ""))[1]
    command = result.data.get("command", f"kvtier bench {result.name}")
    lines = [f"## {result.name}", ""]
    if description:
        lines += [description[0].upper() + description[1:] + ".", ""]
    lines += ["```", command, "```", "", f"Machine: {machine_line(result.data)}; {model_line(result.data)}."]
    lines[-1] += run_line(result.data)
    lines += ["", result.markdown.strip(), ""]
    if result.png is not None:
        target = img_dir / f"{result.name}.png"
        img_dir.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(result.png, target)
        lines += [f"![{result.name}]({os.path.relpath(target, out.parent)})", ""]
    paragraph = describe(result)
    if paragraph:
        lines += [f"**What the numbers mean.** {paragraph}", ""]
    return "\n".join(lines)


def build(results: list[Result], out: Path, img_dir: Path) -> str:
    toc = "\n".join(f"- [{r.name}](#{r.name})" for r in results)
    body = "\n".join(section(r, out, img_dir) for r in results)
    missing = [n for n in WORKLOADS if n not in {r.name for r in results}]
    tail = f"\nNo result yet for: {', '.join(missing)}.\n" if missing else ""
    return f"{INTRO}\n{toc}\n\n{body}{tail}"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=common.RESULTS_DIR)
    p.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    p.add_argument("--img-dir", type=Path, default=Path("docs/img"))
    args = p.parse_args(argv)
    results = load_results(args.results_dir)
    if not results:
        raise SystemExit(f"no result files in {args.results_dir}; run `kvtier bench WORKLOAD` first")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(build(results, args.out, args.img_dir))
    print(f"wrote {args.out} ({len(results)} workloads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
