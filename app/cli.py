"""`reprise`: the GUI with no arguments; subcommands for the terminal."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import app.engine  # noqa: F401  (loads OpenBLAS before anything imports mlx)
from app import __version__


def _add_generation_options(parser: argparse.ArgumentParser) -> None:
    """Flags left out keep the saved preferences (the window's), so the terminal
    answers as the window would; a flag given overrides its preference."""
    from app.engine.kvscheme import GROUP_SIZES, PREFERENCE_BITS  # plain data, no mlx

    parser.add_argument("--model", help="model name in the library, or a model folder")
    parser.add_argument("--system", help="system prompt")
    parser.add_argument("--temp", type=float, help="temperature (0 = greedy)")
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--min-p", type=float)
    parser.add_argument("--repetition-penalty", type=float)
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument(
        "--kv-bits", type=int, choices=PREFERENCE_BITS, help="quantize the KV cache"
    )
    parser.add_argument(
        "--no-kv-quantization", action="store_true", help="keep the KV cache in 16 bits"
    )
    parser.add_argument("--kv-group-size", type=int, choices=GROUP_SIZES)
    parser.add_argument(
        "--quantized-kv-start",
        type=int,
        help="quantize the KV cache once it holds this many tokens",
    )
    parser.add_argument(
        "--max-context", type=int, help="cap prompt plus reply below the model's context length"
    )
    parser.add_argument("--json", action="store_true", help="one JSON object per turn")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="reprise", description="Chat with local models on MLX.")
    parser.add_argument("--version", action="version", version=f"reprise {__version__}")
    commands = parser.add_subparsers(dest="command")

    _add_chat(commands)
    _add_store_commands(commands)
    _add_model_commands(commands)
    _add_bench_commands(commands)
    return parser


def _add_chat(commands) -> None:
    chat = commands.add_parser("chat", help="chat in the terminal")
    chat.add_argument("message", nargs="?", help="send one message and print the reply")
    chat.add_argument(
        "--conversation",
        metavar="new|ID",
        help="store the chat (messages and KV cache); ID continues one",
    )
    _add_generation_options(chat)


def _add_store_commands(commands) -> None:
    convs = commands.add_parser("conversations", help="stored conversations")
    conv_commands = convs.add_subparsers(dest="conversations_command", required=True)
    conv_list = conv_commands.add_parser("list", help="newest first")
    conv_list.add_argument("--json", action="store_true")
    conv_commands.add_parser("show", help="print one").add_argument("id", type=int)
    conv_commands.add_parser("search", help="full-text search").add_argument("text")
    conv_commands.add_parser("delete", help="delete one, with its cache").add_argument(
        "id", type=int
    )
    export = conv_commands.add_parser("export", help="as Markdown or JSON")
    export.add_argument("id", type=int)
    export.add_argument("--format", choices=["markdown", "json"], default="markdown")
    export.add_argument("--output", "-o", help="file to write (default: print)")

    cache = commands.add_parser("cache", help="the KV cache files on disk")
    cache_commands = cache.add_subparsers(dest="cache_command", required=True)
    cache_commands.add_parser("ls", help="per conversation").add_argument(
        "--json", action="store_true"
    )
    cache_verify = cache_commands.add_parser("verify", help="check every file")
    cache_verify.add_argument("--json", action="store_true")
    cache_commands.add_parser("gc", help="remove orphaned and unreferenced files")
    cache_export = cache_commands.add_parser("export", help="as an mlx-lm prompt cache file")
    cache_export.add_argument("id", type=int)
    cache_export.add_argument("out")


def _add_model_commands(commands) -> None:
    models = commands.add_parser("models", help="list and import models")
    model_commands = models.add_subparsers(dest="models_command", required=True)
    listing = model_commands.add_parser("list", help="installed models")
    listing.add_argument("--json", action="store_true")
    found = model_commands.add_parser(
        "found", help="models LM Studio, Ollama and the Hugging Face cache keep here"
    )
    found.add_argument("--json", action="store_true")
    gguf = model_commands.add_parser(
        "import-gguf", help="import a llama, qwen, gemma or phi-3 GGUF file"
    )
    gguf.add_argument("path", help="a .gguf file, or the name `reprise models found` shows")
    gguf.add_argument("--name", help="model name (default: the file name)")
    gguf.add_argument(
        "--bits",
        choices=("file", "4", "8", "16"),
        default="file",
        help="weights at the file's own precision (default), every matrix at 4 or 8 bits, "
        "or all float16",
    )
    gguf.add_argument(
        "--if-missing", action="store_true", help="do nothing if a model of that name is installed"
    )
    use = model_commands.add_parser(
        "use", help="add an MLX model folder, used in place (nothing is copied)"
    )
    use.add_argument("folder", help="the folder, or the name `reprise models found` shows")
    use.add_argument("--name", help="model name (default: the folder's)")
    delete = model_commands.add_parser("delete", help="delete an installed model")
    delete.add_argument("name")


def _add_peer_arguments(bench) -> None:
    bench.add_argument(
        "--peer", choices=["llama.cpp"], help="also measure llama.cpp (needs llama-cpp-python)"
    )
    bench.add_argument(
        "--peer-gguf", type=Path, help="the GGUF the peer reads (default: $REPRISE_STARTER_GGUF)"
    )


def _add_bench_commands(commands) -> None:
    from app.engine.kvscheme import GROUP_SIZES, PREFERENCE_BITS  # plain data, no mlx

    bench = commands.add_parser("bench", help="measure the engine")
    bench_commands = bench.add_subparsers(dest="bench_command", required=True)
    cpu = bench_commands.add_parser("cpu", help="engine vs plain mlx-lm, prefill and decode")
    cpu.add_argument("--model", help="model name or folder (default: the starter model)")
    cpu.add_argument("--prompt-tokens", type=int, default=512)
    cpu.add_argument(
        "--context", type=int, nargs="+", help="also long prompts of these many tokens"
    )
    _add_peer_arguments(cpu)
    cpu.add_argument("--json", action="store_true")
    reopen = bench_commands.add_parser("reopen", help="restore from disk vs recompute")
    reopen.add_argument("--model", help="model name or folder (default: the starter model)")
    reopen.add_argument(
        "--tokens", type=int, nargs="+", default=[1024, 4096], help="history lengths to measure"
    )
    reopen.add_argument(
        "--shape",
        help="a real shape with random weights instead of a model: qwen3-1.7b, "
        "llama-3.1-8b, gemma3-1b (sliding window), qwen3-next-hybrid; tiny, tiny-sliding",
    )
    reopen.add_argument(
        "--cold",
        action="store_true",
        help="drop the cache files from the OS's page cache before each read (Linux)",
    )
    reopen.add_argument(
        "--rows-to",
        type=Path,
        metavar="FILE",
        help="also append each size's row to FILE as a JSON line, as soon as it is measured",
    )
    reopen.add_argument(
        "--kv-bits",
        type=int,
        choices=PREFERENCE_BITS,
        help="save and restore the cache quantized, as the KV preference does (default: 16-bit)",
    )
    reopen.add_argument("--kv-group-size", type=int, choices=GROUP_SIZES, default=64)
    _add_peer_arguments(reopen)
    reopen.add_argument("--json", action="store_true")
    kv = bench_commands.add_parser("kv", help="KV-cache quantization: quality, memory, speed")
    kv.add_argument("--model", help="model name or folder (default: the starter model)")
    kv.add_argument("--tokens", type=int, default=4096, help="text length, continuation included")
    kv.add_argument("--continuation", type=int, default=256, help="tokens scored one at a time")
    kv.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    kv.add_argument("--modes", nargs="+", help="only these rows (and 16-bit)")
    kv.add_argument("--json", action="store_true")
    kv.add_argument("--save", type=Path, help="also write the JSON here (resources/kv-bench.json)")
    speed = bench_commands.add_parser(
        "kv-speed", help="decode speed per KV scheme at long contexts, random weights"
    )
    speed.add_argument("--shape", default="qwen3-1.7b", help="qwen3-1.7b, or tiny for a smoke run")
    speed.add_argument("--tokens", type=int, nargs="+", default=[4096, 16384])
    speed.add_argument("--steps", type=int, default=64, help="decode steps timed per mode")
    speed.add_argument(
        "--attention", action="store_true", help="also time each step's attention alone"
    )
    speed.add_argument("--json", action="store_true")
    decode = bench_commands.add_parser(
        "kv-decode", help="decode speed of the app's 8-bit and 4-bit KV caches, interleaved"
    )
    decode.add_argument("--model", help="model name or folder (default: the starter model)")
    decode.add_argument("--tokens", type=int, default=2048, help="context before the steps")
    decode.add_argument("--steps", type=int, default=64, help="decode steps timed per mode")
    decode.add_argument("--group-size", type=int, default=64, choices=(32, 64, 128))
    decode.add_argument("--json", action="store_true")
    weights = bench_commands.add_parser(
        "weights", help="a quantized model as float32, as codes and as stored, on the CPU"
    )
    weights.add_argument("--model", help="model name or folder (default: the starter model)")
    weights.add_argument("--context", type=int, nargs="+", default=[1024, 4096])
    weights.add_argument(
        "--paths", nargs="+", choices=("dense", "codes", "stored"), default=["dense", "codes"]
    )
    weights.add_argument(
        "--shape", help="a real shape with random 4-bit weights instead: qwen3-1.7b, ..."
    )
    weights.add_argument("--json", action="store_true")
    ui = bench_commands.add_parser("ui", help="the window offscreen: first paint, streaming")
    ui.add_argument("--json", action="store_true")


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from app.engine.errors import UserError
    from app.logs import setup_logging

    setup_logging()

    try:
        if args.command is None:
            import app.engine  # noqa: F401  (OpenBLAS before mlx, before Qt starts the worker)
            from app.ui.app import run

            return run()
        if args.command == "chat":
            return _chat(args)
        if args.command == "models":
            return _models(args)
        if args.command == "bench":
            return _bench(args)
        if args.command == "conversations":
            from app.commands import store

            return store.conversations(args)
        if args.command == "cache":
            from app.commands import store

            return store.cache(args)
    except UserError as exc:
        print(f"reprise: {exc}", file=sys.stderr)
        return 1
    return 2


def _chat(args: argparse.Namespace) -> int:
    from app.commands import chat

    return chat.run(args)


def _models(args: argparse.Namespace) -> int:
    from app.commands import models

    return models.run(args)


def _bench(args: argparse.Namespace) -> int:
    if args.bench_command == "reopen":
        from app.bench import reopen

        return reopen.main(args)
    if args.bench_command == "kv-speed":
        from app.bench import kv_speed

        return kv_speed.main(args)
    if args.bench_command == "kv-decode":
        from app.bench import kv_decode

        return kv_decode.main(args)
    if args.bench_command == "weights":
        from app.bench import compute_paths

        return compute_paths.main(args)
    if args.bench_command == "ui":
        from app.bench import ui

        return ui.main(args)
    if args.bench_command == "kv":
        from app.bench import kv_quality

        return kv_quality.main(args)
    from app.bench import cpu_path

    return cpu_path.main(args)


if __name__ == "__main__":
    sys.exit(main())
