"""RAG with documents in any order, blended: answer quality and TTFT against a full prefill.

The QA set is built locally from real text: a pool of --documents documents of
--doc-tokens tokens, each carrying one planted fact ("The secret code of project NAME
is NNNN."). A query is a chat prompt: a system prompt, k documents of the pool in a
random order, and a question asking for the code of the project of one of them (the
others' codes are distractors). The prompt is marked as segments with a separator in
the chat messages (engine/blend), so every document reuses its stored KV wherever it
appears.

Quality: every query is answered greedily (--answer-len tokens) by a full prefill of
the same tokens (an engine that never blends) and, on one engine per recompute ratio
(--ratios, --kv-blend-recompute-ratio), blended. Per ratio: answer accuracy (the code
appears in the answer), agreement of the greedy answer with the full prefill's (the
share of the longer of the two before their first difference; the same answer), and
the KL divergence of the first output token's distribution from the full prefill's
(read from the logits the engine samples).

Speed: on the same engines, --ttft-queries queries of k documents of --ttft-doc-tokens
tokens, one request at a time: each query's documents are stored first (the query is
sent once in another order, untimed), then its TTFT blended and as a full prefill (a
cache_salt of its own, so nothing hits), in alternating order. No order of the timed
documents is used twice, so every timed blend is a blend, not a hit on an earlier one.
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
from dataclasses import dataclass

import torch

from bench import plots
from bench.common import add_cost_epilog, markdown_table, median, percentile, smoke_engine_options
from bench.kv_common import delta, numeric_stats
from bench.profiling import profile_call, profile_note, profile_tables
from bench.summary import publish, result_header, workload_parser
from bench.text_corpus import documents
from engine import LLM, SamplingParams
from engine.blend import SegmentedTokens
from engine.models import load_tokenizer

NAME = "rag-blend"
SEPARATOR = "<kvtier-segment>"
SYSTEM = "You are a helpful assistant. Answer the question using the documents."
PROJECTS = ("Orion", "Falcon", "Cedar", "Maple", "Nimbus", "Quartz", "Willow", "Harbor", "Summit", "Ember",
            "Juniper", "Cobalt", "Aurora", "Granite", "Lotus", "Tundra", "Mistral", "Beacon", "Saffron", "Zephyr")
DEFAULT_RATIO = 0.15
TTFT_TARGET = 0.4  # blended TTFT at the default ratio, as a fraction of the full prefill's
ACCURACY_TARGET = 0.95  # blended accuracy at the default ratio, as a fraction of the full prefill's
SMOKE = {"documents": 5, "doc_tokens": [30, 60], "queries": 3, "k": 3, "answer_len": 4, "ttft_queries": 1,
         "ttft_doc_tokens": 40, "ratios": [0.0, 0.15, 1.0], "num_kv_blocks": 256, "max_num_seqs": 4}


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = workload_parser(NAME, __doc__, "a blended request at the default ratio")
    p.set_defaults(dtype="float32")
    p.add_argument("--documents", type=int, default=20, help="Documents in the pool.")
    p.add_argument("--doc-tokens", type=int, nargs=2, default=[300, 600], metavar=("MIN", "MAX"))
    p.add_argument("-k", type=int, default=4, help="Documents per query.")
    p.add_argument("--queries", type=int, default=100)
    p.add_argument("--answer-len", type=int, default=32, help="Greedy tokens per answer.")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.0, 0.05, 0.15, 0.3, 1.0])
    p.add_argument("--ttft-queries", type=int, default=6)
    p.add_argument("--ttft-doc-tokens", type=int, default=500)
    p.add_argument("--num-kv-blocks", type=int, default=8192,
                   help="Room for every document beside the running queries: a document evicted while "
                        "its queries wait is computed in context, which is no longer a blend.")
    p.add_argument("--max-num-seqs", type=int, default=8)
    p.add_argument("--max-num-batched-tokens", type=int, default=4096,
                   help="Large enough for a whole prompt, so the full prefill is one step.")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads (0: torch's default).")
    p.add_argument("--smoke", action="store_true", help="Tiny sizes for CI: checks that it runs, nothing more.")
    add_cost_epilog(p)
    args = p.parse_args(argv)
    if args.smoke:
        for name, value in SMOKE.items():
            setattr(args, name, value)
    if not 3 <= args.k <= args.documents:
        raise SystemExit("-k must be at least 3 (the timing needs three orders) and at most --documents")
    if math.factorial(args.k) < 3 * args.ttft_queries:
        raise SystemExit(f"--ttft-queries: at most {math.factorial(args.k) // 3} for -k {args.k} "
                         "(each timed query needs three orders of its k documents not used by another)")
    if args.documents > len(PROJECTS):
        raise SystemExit(f"--documents: at most {len(PROJECTS)}")
    if args.threads:
        torch.set_num_threads(args.threads)
    return args


# ---- the QA set -------------------------------------------------------------------------


@dataclass(frozen=True)
class Document:
    text: str
    project: str
    code: str


@dataclass(frozen=True)
class Query:
    documents: tuple[int, ...]  # pool indices, in prompt order
    target: int  # the pool index whose code is asked for


def make_documents(tokenizer, count: int, tokens: tuple[int, int], rng: random.Random, seed: int) -> list[Document]:
    """`count` passages of real text of `tokens[0]`..`tokens[1]` tokens, each with its
    own project's code planted at a random line."""
    texts = documents(count, 4 * tokens[0], 4 * tokens[1], seed=seed)
    out = []
    for index, text in enumerate(texts):
        length = rng.randint(*tokens)
        body = tokenizer.decode(tokenizer.encode(text, add_special_tokens=False)[:length])
        lines = body.split("\n")
        project, code = PROJECTS[index], str(rng.randint(1000, 9999))
        lines.insert(rng.randrange(len(lines) + 1), f"The secret code of project {project} is {code}.")
        out.append(Document("\n".join(lines), project, code))
    return out


def make_queries(count: int, pool: int, k: int, rng: random.Random) -> list[Query]:
    queries = []
    for _ in range(count):
        picked = rng.sample(range(pool), k)
        queries.append(Query(tuple(picked), rng.choice(picked)))
    return queries


def distinct_orders(k: int, count: int, rng: random.Random) -> list[tuple[int, ...]]:
    """`count` different orders of k documents: a prompt in an order not sent before has
    no blended blocks to hit."""
    orders: list[tuple[int, ...]] = []
    while len(orders) < count:
        order = tuple(rng.sample(range(k), k))
        if order not in orders:
            orders.append(order)
    return orders


def messages(query: Query, docs: list[Document]) -> list[dict[str, str]]:
    """The chat of one query, segments marked: the system prompt and chat header, each
    document, the question."""
    parts = [f"{SEPARATOR}Document:\n{docs[d].text}\n\n" for d in query.documents]
    question = f"{SEPARATOR}Question: What is the secret code of project {docs[query.target].project}? " \
               "Answer with the code."
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "".join(parts) + question}]


def encode(llm: LLM, query: Query, docs: list[Document]) -> SegmentedTokens:
    tokens = llm.engine.encode_chat(messages(query, docs), separator=SEPARATOR)
    if not isinstance(tokens, SegmentedTokens):
        raise RuntimeError("the chat template dropped the segment separators")
    return tokens


# ---- measuring --------------------------------------------------------------------------


class FirstTokenLogprobs:
    """Records each request's first sampled distribution (log-softmax of its logits), by
    wrapping the engine's sampler: each request has its own SamplingParams object."""

    def __init__(self, llm: LLM) -> None:
        self.sampler = llm.engine.runner.sampler
        self.original = self.sampler.sample
        self.rows: dict[int, torch.Tensor] = {}
        self.sampler.sample = self._sample

    def _sample(self, logits: torch.Tensor, params, generators):
        for row, p in zip(logits, params, strict=True):
            if id(p) not in self.rows:
                self.rows[id(p)] = row.float().log_softmax(-1).cpu()
        return self.original(logits, params, generators)

    def of(self, params: SamplingParams) -> torch.Tensor:
        return self.rows[id(params)]


def answer(llm: LLM, prompts: list, answer_len: int) -> tuple[list[list[int]], list[torch.Tensor], dict]:
    """Greedy answers of every prompt, their first-token log-probs and the engine
    counters the run moved."""
    recorder = FirstTokenLogprobs(llm)
    params = [SamplingParams(max_tokens=answer_len, temperature=0.0) for _ in prompts]
    before = numeric_stats(llm.engine)
    outputs = llm.generate(prompts, params, use_tqdm=False)
    if any(o.error for o in outputs):
        raise RuntimeError(f"a request failed: {next(o.error for o in outputs if o.error)}")
    return ([o.outputs[0].token_ids for o in outputs], [recorder.of(p) for p in params],
            delta(before, numeric_stats(llm.engine)))


def ttft(llm: LLM, prompt, salt: str | None) -> float:
    out = llm.generate([prompt], SamplingParams(max_tokens=1, temperature=0.0), use_tqdm=False, cache_salt=salt)[0]
    return out.metrics.time_to_first_token


def time_pairs(llm: LLM, pairs: list[tuple[SegmentedTokens, SegmentedTokens]]) -> list[dict]:
    """Per query: its documents stored (sent once in its first order, untimed), then the
    TTFT of its second order blended and as a full prefill, in alternating order."""
    samples = []
    for index, (first, second) in enumerate(pairs):
        ttft(llm, first, None)
        times = {}
        for kind in ("blend", "full") if index % 2 == 0 else ("full", "blend"):
            times[kind] = ttft(llm, second, None) if kind == "blend" else ttft(llm, list(second), f"full-{index}")
        samples.append({**times, "ratio": times["blend"] / times["full"], "prompt_tokens": len(second)})
    return samples


def time_stored_replays(args: argparse.Namespace, qa: QASet) -> list[dict]:
    """Per timed query, on an engine with a cpu tier at the default ratio: its second
    order blended (untimed, saved to the tier), the device prefix cache emptied, then the
    TTFT of the same prompt again (loaded from the tier, not blended again) and as a full
    prefill, in alternating order."""
    samples = []
    with LLM(**engine_options(args, kv_blend_recompute_ratio=DEFAULT_RATIO, kv_offload="cpu")) as llm:
        for index, (first, second, _) in enumerate(qa.timed):
            ttft(llm, first, None)
            ttft(llm, second, None)
            llm.engine.connector.store.drain(60)
            before = numeric_stats(llm.engine)
            times = {}
            for kind in ("replay", "full") if index % 2 == 0 else ("full", "replay"):
                llm.engine.kv_cache_manager.reset_prefix_cache()
                salt = None if kind == "replay" else f"replay-full-{index}"
                times[kind] = ttft(llm, second if kind == "replay" else list(second), salt)
            moved = delta(before, numeric_stats(llm.engine))
            if moved.get("kv_blend_stored_requests") != 1:
                raise RuntimeError("a stored blend was not served from the store")
            samples.append({**times, "ratio": times["replay"] / times["full"]})
    return samples


def profile_blend(llm: LLM, prompt: SegmentedTokens) -> dict:
    profile = profile_call(lambda: ttft(llm, prompt, None))
    profile.update(label="a blended request, its documents stored", requests=1, prompt_tokens=len(prompt),
                   output_tokens=1)
    return profile


def accuracy_ratio_interval(
    reference: list[bool], other: list[bool], seed: int, samples: int = 2000
) -> tuple[float, float]:
    """95% interval of `other`'s accuracy over `reference`'s on the same queries: a paired
    bootstrap (queries resampled with replacement, both answers kept together). A greedy
    answer of a small model flips on small numeric differences, so the point estimate on
    a few dozen queries is noisy; the interval says how much."""
    if not reference:
        return float("nan"), float("nan")
    rng = random.Random(seed)
    pairs = list(zip(reference, other, strict=True))
    ratios = []
    for _ in range(samples):
        drawn = rng.choices(pairs, k=len(pairs))
        right = sum(r for r, _ in drawn)
        if right:
            ratios.append(sum(o for _, o in drawn) / right)
    return percentile(ratios, 2.5), percentile(ratios, 97.5)


def kl_divergence(reference: torch.Tensor, other: torch.Tensor) -> float:
    """KL(reference || other) of two log-prob vectors, in nats."""
    return float((reference.exp() * (reference - other)).sum())


def agreement(reference: list[int], other: list[int]) -> float:
    """The fraction of the longer answer that both share before their first difference
    (1.0: the same tokens; answers end at --answer-len or at EOS)."""
    same = 0
    for a, b in zip(reference, other, strict=False):
        if a != b:
            break
        same += 1
    return same / max(len(reference), len(other), 1)


def score(tokenizer, answers: list[list[int]], qa: QASet) -> list[bool]:
    """Whether each answer holds the code its question asks for."""
    return [qa.docs[q.target].code in tokenizer.decode(a) for a, q in zip(answers, qa.queries, strict=True)]


def engine_options(args: argparse.Namespace, **extra: object) -> dict[str, object]:
    return {"model": args.model, "dtype": args.dtype, "seed": args.seed, "num_kv_blocks": args.num_kv_blocks,
            "max_num_seqs": args.max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
            **smoke_engine_options(args), **extra}


@dataclass(frozen=True)
class QASet:
    docs: list[Document]
    queries: list[Query]
    prompts: list[SegmentedTokens]
    timed: list[list[SegmentedTokens]]  # per timed query: three orders of its documents


def full_prefill(args: argparse.Namespace, rng: random.Random) -> tuple[QASet, list[list[int]], list[torch.Tensor]]:
    """Build the QA set and answer it by full prefills (an engine given no segments)."""
    with LLM(**engine_options(args)) as full:
        tokenizer = full.tokenizer
        docs = make_documents(tokenizer, args.documents, tuple(args.doc_tokens), rng, args.seed)
        queries = make_queries(args.queries, args.documents, args.k, rng)
        prompts = [encode(full, q, docs) for q in queries]
        timed_docs = make_documents(tokenizer, args.k, (args.ttft_doc_tokens,) * 2, rng, args.seed + 1)
        # no order twice across the timed queries: a blended prompt in an order sent before
        # (whatever its question) hits that blend's blocks instead of blending
        flat = distinct_orders(args.k, 3 * args.ttft_queries, rng)
        orders = [flat[3 * i : 3 * i + 3] for i in range(args.ttft_queries)]
        timed = [[encode(full, Query(o, rng.choice(o)), timed_docs) for o in three] for three in orders]
        answers, logprobs, _ = answer(full, [list(p) for p in prompts], args.answer_len)
    return QASet(docs, queries, prompts, timed), answers, logprobs


def blended(args: argparse.Namespace, ratio: float, qa: QASet) -> dict:
    """Answer the QA set blended at `ratio`, then time the timed queries; the engine is
    gone when this returns."""
    with LLM(**engine_options(args, kv_blend_recompute_ratio=ratio)) as llm:
        answers, logprobs, moved = answer(llm, qa.prompts, args.answer_len)
        run = {"answers": answers, "logprobs": logprobs, "moved": moved,
               "samples": time_pairs(llm, [(t[0], t[1]) for t in qa.timed])}
        if args.profile and ratio == DEFAULT_RATIO:  # where a blended TTFT goes: an order not seen yet
            run["profile"] = profile_blend(llm, qa.timed[0][2])
    return run


def main(argv: list[str] | None = None) -> int:
    argv = list(argv or [])
    args = parse_args(argv)
    result = result_header(NAME, argv, args)
    qa, reference, reference_logprobs = full_prefill(args, random.Random(args.seed))
    tokenizer = load_tokenizer(result["model"]["path"])
    correct = score(tokenizer, reference, qa)
    result["set"] = {
        "prompt_tokens": [len(p) for p in qa.prompts],
        "document_tokens": [end - start for p in qa.prompts for start, end in p.bounds[1:-1]],
        "ttft_prompt_tokens": [len(t[1]) for t in qa.timed],
    }
    result["full"] = {"accuracy": sum(correct) / len(correct), "correct": correct}
    result["ratios"] = {}
    for ratio in args.ratios:
        run = blended(args, ratio, qa)
        if "profile" in run:
            result["profile"] = run["profile"]
        hits = score(tokenizer, run["answers"], qa)
        agree = [agreement(r, b) for r, b in zip(reference, run["answers"], strict=True)]
        pairs = list(zip(reference_logprobs, run["logprobs"], strict=True))
        kls = [kl_divergence(r, b) for r, b in pairs]
        samples = run["samples"]
        result["ratios"][str(ratio)] = {
            "ratio": ratio,
            "accuracy": sum(hits) / len(hits),
            "correct": hits,
            "accuracy_ratio_95": accuracy_ratio_interval(correct, hits, args.seed),
            "agreement": agree,
            "agreement_mean": statistics.fmean(agree),
            "all_equal": sum(r == b for r, b in zip(reference, run["answers"], strict=True)) / len(agree),
            "kl": kls,
            "kl_mean": statistics.fmean(kls),
            "kl_max": max(kls),
            "top1_agreement": statistics.fmean(int(r.argmax()) == int(b.argmax()) for r, b in pairs),
            "max_logprob_diff": max(float((r - b).abs().max()) for r, b in pairs),
            "counters": {k: v for k, v in run["moved"].items() if k.startswith("kv_blend_")},
            "ttft": samples,
            "ttft_blend_ms": 1000 * median([s["blend"] for s in samples]),
            "ttft_full_ms": 1000 * median([s["full"] for s in samples]),
            "ttft_ratio": median([s["ratio"] for s in samples]),
        }
    replays = time_stored_replays(args, qa)
    result["stored_replay"] = {"ttft": replays, "ttft_ms": 1000 * median([s["replay"] for s in replays]),
                               "ttft_full_ms": 1000 * median([s["full"] for s in replays]),
                               "ttft_ratio": median([s["ratio"] for s in replays])}
    plot(result)
    publish(NAME, result, render(result))
    return 0


# ---- output -------------------------------------------------------------------------------


def _recompute_share(run: dict) -> float:
    """Prompt tokens computed in context (the question, segment tails, the selected
    tokens) as a fraction of the prompt."""
    counters = run["counters"]
    return counters.get("kv_blend_recomputed_tokens", 0) / max(counters.get("kv_blend_prompt_tokens", 0), 1)


def render(result: dict) -> str:
    o, s = result["options"], result["set"]
    intro = (f"{o['queries']} queries, each a system prompt, {o['k']} of {o['documents']} documents of real text "
             f"({min(s['document_tokens'])}-{max(s['document_tokens'])} tokens) in a random order, and a question "
             f"on the code planted in one of them; prompts of {min(s['prompt_tokens'])}-{max(s['prompt_tokens'])} "
             f"tokens, {o['answer_len']} greedy tokens per answer, {o['dtype']}. Full prefill accuracy "
             f"{100 * result['full']['accuracy']:.0f}%. TTFT: {o['ttft_queries']} queries of {o['k']} stored "
             f"documents of {o['ttft_doc_tokens']} tokens ({median(s['ttft_prompt_tokens']):.0f}-token prompts), "
             "one at a time.\n\n")
    rows = []
    for run in result["ratios"].values():
        rows.append([run["ratio"], f"{100 * _recompute_share(run):.0f}%", f"{100 * run['accuracy']:.0f}%",
                     _relative_accuracy(result, run),
                     f"{100 * run['agreement_mean']:.0f}%", f"{100 * run['all_equal']:.0f}%",
                     f"{100 * run['top1_agreement']:.0f}%", run["kl_mean"], run["kl_max"],
                     run["ttft_blend_ms"], run["ttft_full_ms"], run["ttft_ratio"]])
    table = markdown_table(["recompute ratio", "prompt computed", "accuracy", "accuracy / full (95% interval)",
                            "answer shared with full prefill",
                            "same answer", "same first token", "KL mean", "KL max", "TTFT blend ms",
                            "TTFT full ms", "TTFT blend / full"], rows)
    return intro + table + "\n" + _replay_line(result) + _targets(result) + "\n" + profile_tables(result)


def _accuracy_vs_full(result: dict, run: dict) -> tuple[float, float, float]:
    """A run's accuracy over the full prefill's, and that ratio's 95% interval."""
    full = result["full"]["accuracy"]
    low, high = run["accuracy_ratio_95"]
    return (run["accuracy"] / full if full else float("nan")), low, high


def _relative_accuracy(result: dict, run: dict) -> str:
    relative, low, high = _accuracy_vs_full(result, run)
    return f"{relative:.2f} ({low:.2f}-{high:.2f})"


def _replay_line(result: dict) -> str:
    replay = result.get("stored_replay")
    if replay is None:
        return ""
    return (f"Served again from the cpu tier (a timed query at ratio {DEFAULT_RATIO}, after the device cache "
            f"dropped it: loaded, not blended again): TTFT {replay['ttft_ms']:.0f} ms against "
            f"{replay['ttft_full_ms']:.0f} ms for a full prefill, {replay['ttft_ratio']:.2f}x.\n\n")


def _targets(result: dict) -> str:
    run = result["ratios"].get(str(DEFAULT_RATIO))
    if run is None:
        return f"(no run at the default ratio {DEFAULT_RATIO}: targets not measured)\n"
    relative, low, high = _accuracy_vs_full(result, run)
    rows = [[f"TTFT blend / full at ratio {DEFAULT_RATIO}", f"<= {TTFT_TARGET}", f"{run['ttft_ratio']:.2f}",
             "met" if run["ttft_ratio"] <= TTFT_TARGET else "not met"],
            [f"accuracy at ratio {DEFAULT_RATIO} / full prefill's", f">= {ACCURACY_TARGET}",
             f"{relative:.2f} (95% interval {low:.2f}-{high:.2f})", "met" if relative >= ACCURACY_TARGET else "not met"]]
    return "Targets:\n\n" + markdown_table(["target", "wanted", "measured", ""], rows)


def plot(result: dict) -> None:
    runs = list(result["ratios"].values())
    x = [r["ratio"] for r in runs]
    quality = {"accuracy": [r["accuracy"] for r in runs],
               "answer shared with full prefill": [r["agreement_mean"] for r in runs],
               "same answer as full prefill": [r["all_equal"] for r in runs]}
    plots.save_figure(plots.png_path(NAME), [
        plots.Panel("Quality vs recompute ratio", "recompute ratio", "fraction", x, quality,
                    hlines={"full prefill accuracy": result["full"]["accuracy"]}),
        plots.Panel("KL(full || blend), first token", "recompute ratio", "nats",
                    x, {"mean": [max(r["kl_mean"], 1e-9) for r in runs]}, logy=True),
        plots.Panel("TTFT blend / full prefill", "recompute ratio", "ratio", x,
                    {"median": [r["ttft_ratio"] for r in runs]}, hlines={"target": TTFT_TARGET}),
        plots.Panel("Quality-speed curve", "TTFT blend / full prefill", "accuracy",
                    [round(r["ttft_ratio"], 3) for r in runs], {"accuracy": [r["accuracy"] for r in runs]},
                    hlines={"full prefill": result["full"]["accuracy"]}),
    ], "RAG, documents in any order: blended prefill vs full prefill")


def describe(result: dict) -> str:
    """What the numbers say, computed from them (a paragraph of docs/BENCHMARKS.md)."""
    runs = result["ratios"]
    full = result["full"]["accuracy"]
    parts = [f"ratio {r['ratio']:g}: {100 * r['accuracy']:.0f}% correct, KL {r['kl_mean']:.3f}, "
             f"TTFT {r['ttft_ratio']:.2f}x" for r in runs.values()]
    text = (f"A full prefill answers {100 * full:.0f}% of the queries. Blended, the documents' stored KV is moved "
            "to each prompt's order and only part of it recomputed: " + "; ".join(parts) + ". ")
    zero, one = runs.get("0.0"), runs.get("1.0")
    if one is not None:
        text += (f"Ratio 1 recomputes every token: its answers are the full prefill's on "
                 f"{100 * one['all_equal']:.0f}% of the queries (largest first-token log-prob difference "
                 f"{one['max_logprob_diff']:.1e}), and its TTFT ({one['ttft_ratio']:.2f}x) is the cost of the "
                 "blend path over the plain one. ")
    if zero is not None:
        text += (f"Ratio 0 moves the documents' KV and computes only the question and the segment tails "
                 f"({100 * _recompute_share(zero):.0f}% of the prompt); what the ratios above it add is the "
                 "cross-attention between documents that the recomputed tokens restore. ")
    replay = result.get("stored_replay")
    if replay is not None:
        text += (f"A query served again after the device cache dropped it loads its own stored blend from the "
                 f"cpu tier instead of blending again: {replay['ttft_ratio']:.2f}x the full prefill's TTFT. ")
    return (text + _targets_sentence(result) + " " + profile_note(result)).strip()


def _targets_sentence(result: dict) -> str:
    run = result["ratios"].get(str(DEFAULT_RATIO))
    if run is None:
        return ""
    relative, low, high = _accuracy_vs_full(result, run)
    return (f"At the default ratio {DEFAULT_RATIO}, TTFT is {run['ttft_ratio']:.2f}x the full prefill's "
            f"(target <= {TTFT_TARGET}: {'met' if run['ttft_ratio'] <= TTFT_TARGET else 'not met'}) and accuracy "
            f"{relative:.2f}x the full prefill's (target >= {ACCURACY_TARGET}: "
            f"{'met' if relative >= ACCURACY_TARGET else 'not met'}; 95% interval of a paired bootstrap over "
            f"the queries {low:.2f}-{high:.2f}).")
