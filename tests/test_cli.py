"""The `radixrt` command as a user runs it: a subprocess, its exit code, its stdout and stderr."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

import radixrt

TINY = ["--device", "cpu", "--dtype", "float32"]


def radixrt_cli(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "radixrt.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def test_version() -> None:
    done = radixrt_cli("--version")
    assert done.returncode == 0
    assert done.stdout.strip() == f"radixrt {radixrt.__version__}"


def test_global_options_work_before_or_after_the_command(tiny_llama_dir: Path) -> None:
    request = ["generate", "hello", "--max-new-tokens", "5", "--ignore-eos", "--json"]
    after = radixrt_cli(*request, "--model", str(tiny_llama_dir), *TINY)
    assert after.returncode == 0, after.stderr
    result = json.loads(after.stdout)
    assert result["meta_info"]["completion_tokens"] == 5

    from radixrt.cli import build_parser

    before = build_parser().parse_args(["--model", str(tiny_llama_dir), *TINY, *request])
    mixed = build_parser().parse_args(["--model", str(tiny_llama_dir), *request, *TINY])
    assert vars(before) == vars(mixed)


# A script that runs the CLI in-process and then reports whether torch was imported: a bad
# value must fail before anything heavy is loaded, let alone a model.
_WITHOUT_TORCH = """
import sys
from radixrt.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exit:
    code = exit.code
print("torch imported" if "torch" in sys.modules else "torch not imported")
sys.exit(code)
"""


@pytest.mark.parametrize(
    "args, message",
    [
        (["generate", "hi", "--temperature", "-1"], "--temperature: temperature must be >= 0"),
        (["generate", "hi", "--top-p", "0"], r"--top-p: top_p must be in \(0, 1\]"),
        (["generate", "hi", "--top-k", "0"], "--top-k: top_k must be -1 .off. or >= 1"),
        (["generate", "hi", "--min-p", "1.5"], r"--min-p: min_p must be in \[0, 1\]"),
        (["generate", "hi", "--max-new-tokens", "-3"], "--max-new-tokens: max_new_tokens must be >= 0"),
        (["generate", "hi", "--max-total-tokens", "0"], "--max-total-tokens: must be an int >= 1"),
        (["--page-size", "0", "demo"], "--page-size: must be an int >= 1"),
        (["demo", "--device", "gpu"], "--device: must be auto, cpu, cuda or cuda:N"),
        (["demo", "--dtype", "half"], "--dtype: invalid choice"),
        (["serve", "--max-queued-requests", "-1"], "--max-queued-requests: must be an int >= 0"),
        (["serve", "--decode-steps", "0"], "--decode-steps: must be an int >= 1"),
    ],
)
def test_bad_values_fail_before_anything_loads(args: list[str], message: str) -> None:
    # --model points nowhere: were the model looked at first, the error would be about it.
    done = subprocess.run([sys.executable, "-c", _WITHOUT_TORCH, "--model", "/no/such/model", *args],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stdout.strip() == "torch not imported"
    assert len(re.findall(message, done.stderr)) == 1, done.stderr
    assert "/no/such/model" not in done.stderr


def test_unknown_option_is_named() -> None:
    done = radixrt_cli("generate", "hi", "--temprature", "0")
    assert done.returncode == 2 and "unrecognized arguments: --temprature" in done.stderr


def test_ctrl_c_exits_130_with_one_line(tiny_llama_dir: Path, tmp_path: Path) -> None:
    """SIGINT while a long generation streams: exit code 130, one line on stderr, no traceback."""
    long_context = tmp_path / "long-context"
    long_context.mkdir()
    for file in tiny_llama_dir.iterdir():
        (long_context / file.name).symlink_to(file)
    config = json.loads((tiny_llama_dir / "config.json").read_text())
    (long_context / "config.json").unlink()
    (long_context / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 1 << 20}))
    # Far more tokens than the test waits for: the signal always arrives mid-generation.
    command = [sys.executable, "-m", "radixrt.cli", "generate", "hello", "--model", str(long_context), *TINY,
               "--max-new-tokens", "50000", "--ignore-eos", "--max-total-tokens", "50100"]
    # A shell starts background jobs with SIGINT ignored, and an ignored signal stays ignored
    # across exec (Python then installs no KeyboardInterrupt handler): give the CLI the default
    # disposition a terminal user's process has, whoever runs the suite.
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert process.stdout is not None and process.stdout.read(1), "no output streamed"
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
    finally:
        process.kill()
    assert process.returncode == 130
    assert stderr.decode().strip().splitlines() == ["radixrt: interrupted"]
