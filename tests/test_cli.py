"""`reprise` as a user runs it: a real subprocess of the console script."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import tiny
from app.engine import kvnative

REPRISE = str(Path(sys.executable).with_name("reprise"))


def reprise(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [REPRISE, *args], capture_output=True, text=True, timeout=300, check=False, **kwargs
    )


def test_version():
    from app import __version__

    done = reprise("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"reprise {__version__}"


def test_import_list_and_delete_a_model(tmp_path, app_dirs):
    gguf = tiny.write_gguf(tmp_path / "tiny.gguf")
    done = reprise("models", "import-gguf", str(gguf), "--name", "tiny")
    assert done.returncode == 0, done.stderr
    assert "Building the tokenizer" in done.stderr  # progress is shown

    listed = json.loads(reprise("models", "list", "--json").stdout)
    assert [m["name"] for m in listed] == ["tiny"]
    assert Path(listed[0]["path"]).parent == app_dirs["models"]

    again = reprise("models", "import-gguf", str(gguf), "--name", "tiny", "--if-missing")
    assert again.returncode == 0 and "already installed" in again.stdout

    assert reprise("models", "delete", "tiny").returncode == 0
    assert json.loads(reprise("models", "list", "--json").stdout) == []


def test_a_bad_gguf_gets_a_message_not_a_traceback(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 10)
    done = reprise("models", "import-gguf", str(bad))
    assert done.returncode == 1
    assert "reprise: bad.gguf could not be read" in done.stderr
    assert "Traceback" not in done.stderr


def test_import_gguf_names_an_empty_file_and_a_folder_as_such(tmp_path, capsys):
    """A walk: an empty file read "not a GGUF file", a folder "No such file"."""
    from app.cli import main

    (tmp_path / "empty.gguf").touch()
    assert main(["models", "import-gguf", str(tmp_path / "empty.gguf")]) == 1
    assert capsys.readouterr().err.endswith("\nreprise: empty.gguf is empty, not a GGUF file\n")
    assert main(["models", "import-gguf", str(tmp_path)]) == 1
    said = capsys.readouterr().err
    assert said.startswith(f"reprise: {tmp_path} is a folder, not a GGUF file")
    assert f"reprise models use '{tmp_path}'" in said


def test_chat_without_models_explains_how_to_get_one():
    done = reprise("chat", "hello")
    assert done.returncode == 1
    assert "No models" in done.stderr and "import-gguf" in done.stderr


def test_chat_json_prints_reply_and_stats(tiny_model_dir):
    done = reprise(
        "chat",
        "--model",
        str(tiny_model_dir),
        "--temp",
        "0",
        "--max-tokens",
        "7",
        "--kv-bits",
        "8",
        "--kv-group-size",
        "32",
        "--json",
        "hello",
    )
    assert done.returncode == 0, done.stderr
    record = json.loads(done.stdout)
    assert record["model"] == "tiny-random-llama"
    assert record["generated_tokens"] == 7 and record["finish_reason"] == "length"
    assert record["kv_format"] == "8-bit (group 32, 16-bit first 4 + last 64 tokens)"
    for key in (
        "reply",
        "prompt_tokens",
        "reused_tokens",
        "prefill_s",
        "ttft_s",
        "decode_tps",
        "kv_bytes",
        "peak_memory_bytes",
        "compute",
    ):
        assert key in record
    if sys.platform == "linux":  # the console script loads OpenBLAS before mlx (14x prefill)
        assert record["compute"].endswith("BLAS: openblas"), record["compute"]


def test_interactive_chat_reuses_the_cache_across_turns(tiny_model_dir):
    done = reprise(
        "chat",
        "--model",
        str(tiny_model_dir),
        "--temp",
        "0",
        "--max-tokens",
        "5",
        "--json",
        input="hello\n\nagain\n",
    )
    assert done.returncode == 0, done.stderr
    first, second = (json.loads(line) for line in done.stdout.splitlines())
    # The random model's bytes need not re-tokenize the same, so only the prompt is sure.
    assert second["reused_tokens"] >= first["prompt_tokens"]
    assert second["prefilled_tokens"] == second["prompt_tokens"] - second["reused_tokens"]


def test_ctrl_c_stops_the_reply_not_the_program(starter_model_dir):
    process = subprocess.Popen(
        [REPRISE, "chat", "--model", str(starter_model_dir), "--temp", "0", "--max-tokens", "2000"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1"},
    )
    process.stdin.write("Tell me a very long story about a dragon.\n")
    process.stdin.flush()
    first = process.stdout.read(1)  # the reply has started streaming
    assert first
    time.sleep(0.5)
    process.send_signal(signal.SIGINT)
    out, err = process.communicate("What is the capital of France?\n", timeout=300)
    assert process.returncode == 0, err
    assert "[stopped]" in out
    assert "Paris" in out.split("[stopped]", 1)[1]


def test_the_gui_explains_when_there_is_no_display():
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in ("DISPLAY", "WAYLAND_DISPLAY", "QT_QPA_PLATFORM")
    }
    done = subprocess.run(
        [REPRISE], capture_output=True, text=True, env=env, timeout=60, check=False
    )
    assert done.returncode == 1
    assert "no display found" in done.stderr and "reprise chat" in done.stderr


def test_bench_kv_prints_one_row_per_mode_side_by_side(tiny_model_dir, tmp_path):
    """The command behind the README's KV table, shortened to run on the tiny model."""
    saved = tmp_path / "kv.json"
    done = reprise(
        "bench", "kv", "--model", str(tiny_model_dir), "--tokens", "400", "--continuation",
        "12", "--group-size", "32", "--modes", "mlx-lm 4-bit", "k4v4 hadamard sink+window128",
        "--json", "--save", str(saved),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert json.loads(saved.read_text()) == result
    rows = result["rows"]
    assert [r["mode"] for r in rows] == ["16-bit", "mlx-lm 4-bit", "k4v4 hadamard sink+window128"]
    keys = {"ppl", "kl", "kv_bytes", "peak_bytes", "repeat_4gram", "prefill_tps", "decode_tps"}
    for row in rows:
        assert keys <= set(row) and row["ppl"] > 1 and row["kv_bytes"] > 0
    assert rows[0]["kl"] == 0 and all(r["kl"] > 0 for r in rows[1:])
    assert all(r["kv_bytes"] < rows[0]["kv_bytes"] for r in rows[1:])
    assert result["app_modes"] == {"4-bit": "k4v4 hadamard sink+window128"}
    # The reference is the cache the app keeps with quantization Off: on the CPU path,
    # where the model computes in float32, that is float16 (2 bytes a number), as the
    # Memory preference's shares assume (a new-user walk found them against float32).
    numbers = tiny.LAYERS * 2 * tiny.KV_HEADS * (tiny.HIDDEN // tiny.HEADS) * 400
    assert 2 * numbers <= rows[0]["kv_bytes"] < 3 * numbers


def test_bench_kv_decode_interleaves_16_bit_and_the_app_modes(tiny_model_dir):
    done = reprise(
        "bench", "kv-decode", "--model", str(tiny_model_dir), "--tokens", "300", "--steps",
        "6", "--group-size", "32", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    rows = json.loads(done.stdout)["rows"]
    app = ["k8v8 sink+window", "k4v4 hadamard sink+window128"]
    # The numpy fallback is timed beside the compiled products where they are built.
    again = [f"{mode} (numpy)" for mode in app] if kvnative.available() else []
    assert [r["mode"] for r in rows] == ["16-bit", *app, *again]
    assert rows[0]["vs_16_bit"] == 1 and all(r["step_ms"] > 0 for r in rows)


def test_bench_kv_speed_runs_each_scheme_on_a_random_model():
    done = reprise("bench", "kv-speed", "--shape", "tiny", "--tokens", "300", "--steps", "4")
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    for mode in ("16-bit", "app 8-bit (k8v8g64s4)", "app 4-bit (k4v4g64s4h)"):
        row = next(line for line in lines if line.startswith(mode))
        assert float(row.split()[-4]) > 0  # decode tokens/s


def test_bench_reopen_measures_each_size_and_skips_one_past_the_context(tiny_model_dir):
    """A size the model cannot hold is a note, not the loss of the sizes measured."""
    done = reprise(
        "bench", "reopen", "--model", str(tiny_model_dir), "--tokens", "80", "99999", "--json"
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    [row] = result["rows"]
    assert row["history_tokens"] >= 80 and row["cache_bytes"] > 0
    assert row["ttft_prefetched_s"] > 0 and row["ttft_in_memory_s"] > 0
    assert result["skipped"] == ["99999 tokens: beyond the model's context (2048)"]
    assert "skipped: 99999 tokens" in done.stderr


def test_bench_reopen_measures_the_kv_preference_it_is_given(tiny_model_dir):
    """`--kv-bits`: the cache is saved and restored in that preference's format, and
    the row says how fast its bytes came back against a plain read of them."""
    done = reprise(
        "bench", "reopen", "--model", str(tiny_model_dir), "--tokens", "80",
        "--kv-bits", "4", "--kv-group-size", "32", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    [row] = result["rows"]
    assert result["kv"].startswith("4-bit (group 32")
    assert row["kv_format"] == "k4v4g32s4h"
    assert row["restore_bytes"] == row["cache_bytes"] > 0
    assert row["restore_mb_s"] > 0 and row["raw_read_mb_s"] > 0
    # and the same over five restores of it, each beside a plain read: their medians
    assert row["restore_median_s"] > 0 and row["raw_read_median_s"] > 0
    assert row["restore_vs_raw_read_median"] > 0
    # and what a chat that goes on writes per token (tests/test_cache_window.py has what
    # each turn writes; here a chunk file's header outweighs a tiny model's tokens)
    assert row["follow_ups"] == 8 and row["follow_ups_bytes_written"] > 0


def test_bench_reopen_writes_each_row_as_it_is_measured(tiny_model_dir, tmp_path):
    """`--rows-to`: a JSON line per size, the skipped ones included, appended as they
    come (a run cut short keeps what it finished)."""
    rows_file = tmp_path / "rows.jsonl"
    rows_file.write_text('{"earlier": "run"}\n')
    done = reprise(
        "bench", "reopen", "--model", str(tiny_model_dir), "--shape", "tiny",
        "--tokens", "80", "999999", "--rows-to", str(rows_file),
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    earlier, measured, skipped = (json.loads(line) for line in rows_file.read_text().splitlines())
    assert earlier == {"earlier": "run"}
    assert measured["model"] == "random-tiny" and measured["target"] == 80
    assert measured["history_tokens"] >= 80 and measured["ttft_restore_s"] > 0
    assert skipped["target"] == 999999 and "beyond the model's context" in skipped["skipped"]


def test_bench_reopen_on_a_shape_builds_it_with_random_weights(tiny_model_dir):
    """`--shape`: a real shape's model class with random weights and the installed model's
    tokenizer, measured like an installed model; an unknown shape is a clear error.
    `--cold` reads dropped files; the planner's turn is measured as an app takes it, after
    a restart (on the CPU path: no race), and its estimates from the second size on."""
    done = reprise(
        "bench", "reopen", "--model", str(tiny_model_dir), "--shape", "tiny",
        "--tokens", "80", "160", "--cold", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    assert result["model"] == "random-tiny"
    first, second = result["rows"]
    assert first["history_tokens"] >= 80 and first["ttft_restore_s"] > 0
    assert first["cold"] is True
    # a new token's rows in every layer (2 layers x 2 heads x (64 + 64) wide x 2 bytes),
    # which a cache of full attention holds for every token of its history, and more
    assert first["new_rows_bytes_per_token"] == 2 * 2 * 128 * 2
    assert first["cache_bytes"] / first["history_tokens"] > first["new_rows_bytes_per_token"]
    # The planned turn's estimates: the read's rate from the restore timed before it, no
    # prefill measured yet at the first size (the cautious choice: restore).
    assert first["planner_estimates_s"]["restore"] > 0
    assert first["planner_estimates_s"]["recompute"] is None
    assert first["planner_choice"] == "restore" and first["ttft_planned_s"] > 0
    assert all(v > 0 for v in second["planner_estimates_s"].values())
    assert second["planner_choice"] in ("restore", "recompute")
    wrong = reprise("bench", "reopen", "--model", str(tiny_model_dir), "--shape", "gpt-9")
    assert wrong.returncode == 1 and "Traceback" not in wrong.stderr
    assert "Unknown shape 'gpt-9'" in wrong.stderr


def test_bench_reopen_on_a_sliding_shape_reuses_its_checkpoint(tiny_model_dir):
    """A sliding-window cache cannot be trimmed: the reopened turn must extend the saved
    tokens exactly, so the random shape's one-token replies must survive being stored
    and rendered again (bare words, as a real model writes after "assistant\\n")."""
    done = reprise(
        "bench", "reopen", "--model", str(tiny_model_dir), "--shape", "tiny-sliding",
        "--tokens", "120", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    (row,) = json.loads(done.stdout)["rows"]
    assert row["restore_s"] > 0 and row["ttft_restore_s"] > 0
    assert row["prefetch_s"] > 0 and row["history_tokens"] >= 120
    # its window holds a bounded part of the history: a new token's rows are more than
    # the saved cache's bytes per token
    assert row["cache_bytes"] / row["history_tokens"] < row["new_rows_bytes_per_token"]


def test_bench_reopen_peer_without_what_it_needs_says_what_to_do(tiny_model_dir, tmp_path):
    """llama-cpp-python is a bench extra: without it, or without a GGUF to read, the peer
    is a message naming what is missing, before anything is measured."""
    done = reprise(
        "bench", "reopen", "--model", str(tiny_model_dir), "--tokens", "80",
        "--peer", "llama.cpp", "--peer-gguf", str(tmp_path / "missing.gguf"),
    )  # fmt: skip
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("reprise: --peer llama.cpp ")
    assert "pip install llama-cpp-python" in done.stderr or "--peer-gguf PATH" in done.stderr


def test_bench_weights_measures_a_shape_as_float32_as_codes_and_as_stored(starter_model_dir):
    done = reprise(
        "bench", "weights", "--model", str(starter_model_dir), "--shape", "tiny",
        "--context", "64", "--paths", "dense", "codes", "stored", "--json",
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout)
    held = {name: path["weight_bytes"] for name, path in result["paths"].items()}
    assert held["stored"] < held["codes"] < held["dense"]
    assert result["paths"]["codes"]["compute"].endswith("4-bit codes, BLAS: openblas")
    (row,) = result["contexts"]
    assert all(row[name]["decode_tps"] > 0 for name in held)
