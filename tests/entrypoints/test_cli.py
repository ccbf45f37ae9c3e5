"""The `asyncexec` command line end to end, its flags, and examples/embed_fastapi.py as a real server."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from asyncexec import AsyncEngine, EngineConfig, SamplingParams
from asyncexec.entrypoints.cli import build_parser
from asyncexec.entrypoints.config_args import engine_config_from_args
from tests.engine.test_engine import collect
from tests.entrypoints.server import ServerProcess

REPO = Path(__file__).resolve().parents[2]


def cli(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "asyncexec", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )


async def test_make_model_then_generate_streams_the_engine_output(tmp_path: Path) -> None:
    model = tmp_path / "tiny-gpt2"
    made = cli("make-model", str(model), "--arch", "gpt2", "--seed", "3")
    assert made.returncode == 0, made.stderr
    assert "[1/2]" in made.stderr and "[2/2] wrote" in made.stderr
    assert (model / "config.json").is_file() and (model / "tokenizer.json").is_file()
    gen = cli("generate", "--model", str(model), "--max-tokens", "10", "--ignore-eos", "hello", "world")
    assert gen.returncode == 0, gen.stderr
    assert "20 tokens in" in gen.stderr
    sp = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
    async with AsyncEngine(EngineConfig(model=str(model))) as engine:
        refs = [await collect(engine, p, sp) for p in ("hello", "world")]
    assert gen.stdout == "".join(f"[{i}] {r.text}\n" for i, r in enumerate(refs))


def test_generate_labels_each_prompt_once_even_when_its_first_outputs_are_empty(
    capsys: pytest.CaptureFixture[str],
) -> None:
    from asyncexec.entrypoints.cli import _InOrder

    printer = _InOrder(2)
    printer.update(1, "later", 3)  # buffered until prompt 0 is done
    printer.update(0, "", None)  # a partial UTF-8 character: no text yet
    printer.update(0, "", None)
    printer.update(0, "ab", None)
    printer.update(0, "abc", 4)
    assert capsys.readouterr().out == "[0] abc\n[1] later\n"
    assert printer.tokens == 7


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (
            ["generate", "--model", "/nonexistent/dir", "hi"],
            "is neither a folder, a GGUF file nor a built-in model",
        ),
        (["generate", "--model", "{model}", "--bogus", "hi"], "unrecognized arguments: --bogus"),
        (["generate", "--model", "{model}", "--max-num-seqs", "x", "hi"], "invalid int value"),
        (["generate", "--model", "{model}", "--executor", "tpu", "hi"], "'tpu' is not one of uni, mp, ray"),
        (["generate", "--model", "{model}", "--max-num-seqs", "0", "hi"], "max_num_seqs must be >= 1"),
        (["generate", "--model", "{model}"], "the following arguments are required: PROMPT"),
        (
            ["serve", "--model", "nosuchmodel"],
            "is neither a folder, a GGUF file nor a built-in model (smollm2-135m-instruct",
        ),
        (["serve", "--model", "{model}", "--port", "70000"], "--port must be in 0..65535"),
        (["make-model", "{model}"], "exists and is not an empty folder"),
        (["make-model", "/tmp/x", "--arch", "bert"], "invalid choice: 'bert'"),
        (["frobnicate"], "invalid choice: 'frobnicate'"),
        (["stress", "--duration", "5", "--requests", "3"], "not both"),
    ],
)
def test_bad_command_lines_give_one_line_and_status_2(
    args: list[str], needle: str, tiny_models: dict[str, Path]
) -> None:
    r = cli(*(a.replace("{model}", str(tiny_models["llama"])) for a in args))
    assert r.returncode == 2, (r.returncode, r.stderr)
    assert r.stdout == "" and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert needle in r.stderr and "Traceback" not in r.stderr


def test_every_engine_config_field_is_a_flag_with_help() -> None:
    for command in ("generate", "serve", "stress"):
        r = cli(command, "--help", timeout=60)
        assert r.returncode == 0
        for f in dataclasses.fields(EngineConfig):
            assert "--" + f.name.replace("_", "-") in r.stdout, (command, f.name)
    assert "--enable-prefix-caching, --no-enable-prefix-caching" in r.stdout
    assert "(default: 64)" in r.stdout  # max_num_seqs


def test_flags_become_an_engine_config() -> None:
    ns = build_parser().parse_args(
        [
            "serve",
            "--model",
            "m",
            "--tensor-parallel-size",
            "2",
            "--executor",
            "mp",
            "--rpc-timeout-s",
            "none",
            "--cudagraph-capture-sizes",
            "4",
            "2",
            "--no-enable-prefix-caching",
            "--gpu-memory-utilization",
            "0.5",
            "--max-num-seqs",
            "8",
            "--restart-on-worker-failure",
        ]
    )
    cfg = engine_config_from_args(ns)
    assert cfg == EngineConfig(
        model="m",
        tensor_parallel_size=2,
        executor="mp",
        rpc_timeout_s=None,
        cudagraph_capture_sizes=(4, 2),
        enable_prefix_caching=False,
        gpu_memory_utilization=0.5,
        max_num_seqs=8,
        restart_on_worker_failure=True,
    )
    assert engine_config_from_args(build_parser().parse_args(["serve", "--model", "m"])) == EngineConfig(
        model="m"
    )


def test_the_fastapi_example_embeds_the_engine(tiny_models: dict[str, Path]) -> None:
    script = [
        sys.executable,
        str(REPO / "examples" / "embed_fastapi.py"),
        "--model",
        str(tiny_models["llama"]),
    ]
    with ServerProcess(tiny_models["llama"], script=script) as srv:
        r = httpx.post(srv.url + "/summarize", json={"text": "hello", "max_tokens": 5}, timeout=60)
        assert r.status_code == 200 and r.json()["tokens"] >= 1
        r = httpx.post(srv.url + "/v1/completions", json={"prompt": "hi", "max_tokens": 3}, timeout=60)
        assert r.status_code == 200 and r.json()["model"] == "tiny"
        r = httpx.post(srv.url + "/summarize", json={"text": "", "max_tokens": 5}, timeout=60)
        assert r.status_code == 400 and "empty" in r.json()["error"]["message"]
        assert srv.stop() in (0, -15)  # uvicorn re-raises the SIGTERM it drained on


def test_sigterm_during_generate_shuts_the_engine_down(tiny_models: dict[str, Path]) -> None:
    import signal
    import time

    import psutil

    from tests.conftest import asyncexec_segments

    before = asyncexec_segments()
    argv = [
        sys.executable,
        "-m",
        "asyncexec",
        "generate",
        "--model",
        str(tiny_models["llama"]),
        "--executor",
        "mp",
        "--max-tokens",
        "1500",
        "--ignore-eos",
        "hello",
    ]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        proc.stdout.read(1)  # streaming has begun
        workers = psutil.Process(proc.pid).children()
        assert workers
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 130 and "interrupted; the engine was shut down" in err, err[-2000:]
    deadline = time.monotonic() + 5
    while any(w.is_running() and w.status() != psutil.STATUS_ZOMBIE for w in workers):
        assert time.monotonic() < deadline, "workers outlived the CLI"
        time.sleep(0.05)
    # nothing new; a SIGKILLed earlier process's segment may have been swept by this engine's start
    assert asyncexec_segments() <= before


def test_generate_and_serve_default_to_the_built_in_model() -> None:
    for argv in (["generate", "hi"], ["serve"]):
        assert engine_config_from_args(build_parser().parse_args(argv)).model == "smollm2"
    help_text = subprocess.run(
        [sys.executable, "-m", "asyncexec", "serve", "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "default: smollm2" in " ".join(help_text.split())
