"""Assemble docs/BENCHMARKS.md from the result files under bench/results/.

Every workload of `bench/cli.py` writes `NAME.json`, `NAME.md` and `NAME.png` there, NAME
being its name in the registry. For each `NAME.json` found: a section with the
workload's description, the command that produced it, the machine it ran on, its
Markdown tables (`NAME.md`), its plot (`NAME.png`, copied to docs/img/) and, when the
workload module has a `describe(result)` function, the paragraph it computes from the
numbers. A result written before its workload recorded its command or drew a plot gets
the command rebuilt from the options it recorded, and its plot drawn from the JSON by
the module's `plot(result)`. Run it with `python -m bench.report` (or `make bench`, which
runs every workload first).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import shlex
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from bench import common, plots
from bench.cli import WORKLOADS

SECTION_ORDER = ("engine", "store", "store-hits", "eviction", "long-doc-qa", "multi-round-qa", "rag", "rag-blend", "agent-replay", "throughput",
                 "zero-reuse", "preemption", "chunked-prefill", "cross-instance", "startup")
INTRO = """\
# Benchmarks

Every number here comes from a result file under `bench/results/`; `make bench` reruns
every registered workload and regenerates this page (`python -m bench.report`; a subset:
`make bench BENCH_WORKLOADS="rag throughput"`). Each section gives the exact command, the
machine, the tables the workload wrote, its plot, and a paragraph computed from its
numbers that says what they mean and where the time goes (from a torch.profiler run of
the workload's slowest path where the run made one, else from the numbers themselves).

How to read them. The machine is a small CPU box shared with other jobs, so wall times
are noisy; the workloads on the shared request driver therefore run torch
single-threaded (`--threads 1`: two intra-op threads that spin-wait for each other on a
contended core made every op several times slower; each section's machine line gives
the torch threads of its run), record the load average before and after, and also
report CPU time, which counts the work done whatever else runs. Comparisons are made
inside one command: the variants run on the same model in the same process, one after
another (interleaved across repeats where a workload has `--repeats`), and percentiles
pool every request of a variant. With tens of requests per group, a p99 is close to the
maximum. The model is the built-in SmolLM2-135M-Instruct (30 layers, hidden 576, 9 heads,
3 KV heads of 64; 23 KB of bf16 KV per token), run in bf16 unless a section says
otherwise, on prompts of real text (the pydoc pages of Python standard-library modules,
bench/text_corpus.py). No GPU was available: every number is a CPU number.
"""


@dataclass
class Result:
    name: str
    data: dict
    markdown: str
    png: Path | None


def ordered_names() -> list[str]:
    return [n for n in SECTION_ORDER if n in WORKLOADS] + [n for n in WORKLOADS if n not in SECTION_ORDER]


def load_results(directory: Path) -> list[Result]:
    """The result of every registered workload found in `directory` (`NAME.json`, NAME as
    in bench/cli.py), in section order; other JSON files are named on stderr and skipped."""
    results = []
    for name in ordered_names():
        path = directory / f"{name}.json"
        if path.exists():
            md, png = path.with_suffix(".md"), path.with_suffix(".png")
            results.append(Result(name, json.loads(path.read_text()), md.read_text() if md.exists() else "",
                                  png if png.exists() else None))
    strays = sorted(p.name for p in directory.glob("*.json") if p.stem not in WORKLOADS)
    if strays:
        print(f"skipped (not named after a workload of bench/cli.py): {', '.join(strays)}", file=sys.stderr)
    return results


def workload_module(name: str) -> ModuleType | None:
    return importlib.import_module(WORKLOADS[name][0]) if name in WORKLOADS else None


def command_line(result: Result) -> tuple[str, bool]:
    """The command that produced the result and whether it was rebuilt: as recorded, else
    from the options the result recorded that differ from the workload's defaults."""
    if "command" in result.data:
        return result.data["command"], False
    options = result.data.get("options") or result.data.get("args") or {}
    defaults = vars(workload_module(result.name).parse_args([]))
    argv = []
    for key, value in options.items():
        default = defaults.get(key)
        if key not in defaults or value is None or _plain(value) == _plain(default):
            continue
        flag = "--" + key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + key.replace("_", "-"))
        else:
            argv += [flag, *map(str, value if isinstance(value, list | tuple) else [value])]
    return shlex.join(["kvtier", "bench", result.name, *argv]), True


def _plain(value: object) -> object:
    return list(value) if isinstance(value, list | tuple) else value


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
    describer = getattr(workload_module(result.name), "describe", None)
    return describer(result.data) if describer else ""


def figure(result: Result, img_dir: Path) -> Path | None:
    """The result's plot in `img_dir`: copied from the results, or drawn from the JSON
    by the workload's `plot(result)` when the run wrote none; None without either."""
    target = img_dir / f"{result.name}.png"
    img_dir.mkdir(parents=True, exist_ok=True)
    if result.png is not None:
        shutil.copyfile(result.png, target)
        return target
    draw = getattr(workload_module(result.name), "plot", None)
    if draw is None:
        return None
    with plots.drawing_into(img_dir):
        draw(result.data)
    return target


def section(result: Result, out: Path, img_dir: Path) -> str:
    description = WORKLOADS.get(result.name, ("", ""))[1]
    command, rebuilt = command_line(result)
    lines = [f"## {result.name}", ""]
    if description:
        lines += [description[0].upper() + description[1:] + ".", ""]
    lines += ["```", command, "```", ""]
    if rebuilt:
        lines += ["(Command rebuilt from the options in the result, which predates recorded commands; options the "
                  "workload gained since are at their defaults.)", ""]
    lines += [f"Machine: {machine_line(result.data)}; {model_line(result.data)}."]
    lines[-1] += run_line(result.data)
    lines += ["", result.markdown.strip(), ""]
    target = figure(result, img_dir)
    if target is not None:
        lines += [f"![{result.name}]({os.path.relpath(target, out.parent)})", ""]
    paragraph = describe(result)
    if paragraph:
        lines += [f"**What the numbers mean.** {paragraph}", ""]
    return "\n".join(lines)


def build(results: list[Result], out: Path, img_dir: Path, kept: dict[str, str] | None = None,
          intro: str = INTRO) -> str:
    """The page: a section per result, and `kept` sections (name -> text) of the workloads
    without one, in the order of SECTION_ORDER, then the registry's."""
    kept = kept or {}
    sections = {r.name: section(r, out, img_dir) for r in results}
    sections.update({name: text for name, text in kept.items() if name not in sections})
    names = [n for n in ordered_names() if n in sections]
    toc = "\n".join(f"- [{n}](#{n})" for n in names)
    body = "\n".join(sections[n].rstrip("\n") + "\n" for n in names)
    missing = [n for n in WORKLOADS if n not in sections]
    tail = f"\nNo result yet for: {', '.join(missing)}.\n" if missing else ""
    return f"{intro}\n{toc}\n\n{body}{tail}"


def split_page(text: str) -> tuple[str, dict[str, str]]:
    """An existing page: its introduction (up to the table of contents) and its sections
    by workload name."""
    head, _, rest = text.partition("\n## ")
    intro = head.split("\n- [", 1)[0].rstrip("\n") + "\n"
    sections = {}
    for chunk in ("## " + rest).split("\n## ") if rest else []:
        chunk = chunk if chunk.startswith("## ") else "## " + chunk
        name = chunk.split("\n", 1)[0][3:].strip()
        if name in WORKLOADS:
            sections[name] = chunk.split("\nNo result yet for:", 1)[0].rstrip("\n") + "\n"
    return intro, sections


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.report", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--results-dir", type=Path, default=common.DEFAULT_RESULTS_DIR)
    p.add_argument("--out", type=Path, default=Path("docs/BENCHMARKS.md"))
    p.add_argument("--img-dir", type=Path, default=Path("docs/img"))
    p.add_argument("--merge", action="store_true",
                   help="Replace only the sections of the workloads with a result file; keep the page's other "
                        "sections and its introduction (results are per machine and not in the repository).")
    args = p.parse_args(argv)
    results = load_results(args.results_dir)
    if not results:
        raise SystemExit(f"no result files in {args.results_dir}; run `kvtier bench WORKLOAD` first")
    if args.merge and not args.out.exists():
        raise SystemExit(f"--merge: {args.out} does not exist")
    intro, kept = split_page(args.out.read_text()) if args.merge else (INTRO, {})
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(build(results, args.out, args.img_dir, kept, intro))
    print(f"wrote {args.out} ({len(results)} workloads)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
