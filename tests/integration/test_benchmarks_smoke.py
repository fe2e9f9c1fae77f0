"""Every benchmark's `--smoke` mode (tiny shapes on the CPU) runs as `python -m benchmarks.<group>.<name>`
and prints its JSON line. The scripts that run in-process run one after another in a single child
interpreter (the libraries imported once); those that start processes of their own run alone and are slow.
Both forked from the warm interpreter of tests/helpers/forkserver.py.
`decode_ab --kv-cache` is left out: its compiled mode needs inductor's C++ compiler and minutes."""

from __future__ import annotations

import contextlib
import json
import os
import runpy
import sys
import time
import traceback
from pathlib import Path

import pytest

from tests.helpers.cli import run_script
from tests.helpers.repo import REPO_ROOT, cli_env

CKPT, DATA = "{smoke_ckpt}", "{multi30k}"  # a tiny translation checkpoint made by the fixture; $MULTI30K_DIR
IN_PROCESS = {
    "train.bench_train": ["--smoke", "--data-dir", ""],  # "": the end-to-end epoch's synthetic lengths
    "train.bench_loss": ["--smoke"],
    "train.bench_attention": ["--smoke"],
    "decode.bench_decode": ["--smoke"],
    "decode.bench_decode --export-ckpt": ["--smoke", "--export-ckpt", CKPT, "--data-dir", DATA],
    "decode.decode_ab": ["--smoke", "HEAD"],
    "decode.decode_ab --features": ["--smoke", "--features"],
    "decode.decode_host": ["--smoke"],
    "decode.decode_host --cpu-time": ["--smoke", "--cpu-time", "--baseline", "HEAD", "--cuda-path"],
    "decode.bench_student": ["--smoke"],
    "decode.bench_pretrained": ["--smoke", "--data-dir", DATA],  # ~10 s: a tiny Marian, imported, exported
    "decode.constraints_eval": ["--smoke"],
    "gpu.bench_gpu": ["--smoke", "--models", "ours,torch"],
    "gpu.gpu_profile": ["--smoke", "--models", "ours"],
    "gpu.bytes_per_step": ["--smoke"],
    "data.padding_waste": ["--smoke"],
    "data.bench_clean": ["--smoke", "--data-dir", DATA],  # the cleaning filters on a noisy Multi30k sample
    "data.langid_choice": ["--smoke", "--data-dir", DATA],
    "data.noisy_data_dir": ["--smoke", "--data-dir", DATA],  # a noisy Multi30k data_dir (issue 66's runs)
}
OWN_PROCESSES = {  # each starts processes of its own (a model a process; train.py runs)
    "data.bench_clean_scale": ["--smoke"],  # python -m data.clean in a child per size and filter set
    "train.bench_checkpointing": ["--smoke", "--repeats", "1"],
    "data.bench_data": ["--smoke"],
    "serve.load": ["--smoke"],  # python serve.py processes (two per backend) and their clients
}
# what the scripts that print no JSON line print (each of them, a line per measurement)
TEXT_ONLY = {
    "decode.decode_ab": "median",
    "decode.decode_ab --features": "median ratio",
    "decode.decode_host --cpu-time": "ms/step CPU",
    "gpu.gpu_profile": "Self CPU time total",
}


def _module(case: str) -> str:
    return "benchmarks." + case.split()[0]


def _drive(cases_json: str, out_dir: str) -> None:
    """The child interpreter: run each case's module as __main__, its output into OUT_DIR/<n>.txt, then
    OUT_DIR/results.json: {case: {"rc": ..., "seconds": ...}}."""
    import torch

    threads = torch.get_num_threads()
    results = {}
    for n, (case, args) in enumerate(json.loads(cases_json)):
        start, rc = time.perf_counter(), 0
        with open(Path(out_dir) / f"{n}.txt", "w") as out, contextlib.redirect_stdout(out):
            sys.argv = [_module(case), *args]
            try:
                runpy.run_module(_module(case), run_name="__main__", alter_sys=True)
            except SystemExit as stop:
                rc = stop.code if isinstance(stop.code, int) else (0 if stop.code is None else 1)
            except Exception:
                traceback.print_exc(file=out)
                rc = 1
        torch.set_num_threads(threads)  # a script may have set its own, or turned autograd off
        torch.set_grad_enabled(True)
        results[case] = {"rc": rc, "seconds": round(time.perf_counter() - start, 1), "output": f"{n}.txt"}
    (Path(out_dir) / "results.json").write_text(json.dumps(results))


def _last_json(text: str) -> object:
    """The last JSON line, or the indented JSON document that ends the output (constraints_eval)."""
    lines = text.splitlines()
    for start in reversed([i for i, line in enumerate(lines) if line.startswith(("{", "["))]):
        for candidate in (lines[start], "\n".join(lines[start:])):
            with contextlib.suppress(json.JSONDecodeError):
                return json.loads(candidate)
    raise AssertionError(f"no JSON in the output:\n{text[-3000:]}")


@pytest.fixture(scope="module")
def multi30k() -> Path:
    """$MULTI30K_DIR: the decoding scripts read its sentences, bench_data and padding_waste its corpus."""
    if not os.environ.get("MULTI30K_DIR"):
        pytest.skip("needs the real data: run `MULTI30K_DIR=... pytest` (data/task1/raw)")
    return Path(os.environ["MULTI30K_DIR"])


@pytest.fixture(scope="module")
def in_process(tmp_path_factory: pytest.TempPathFactory, multi30k: Path) -> tuple[dict, Path]:
    from benchmarks.common.checkpoints import smoke_checkpoint

    out = tmp_path_factory.mktemp("benchmarks_smoke")
    ckpt = smoke_checkpoint(out / "smoke.ckpt", multi30k)
    given = {CKPT: str(ckpt), DATA: str(multi30k)}
    cases = [[case, [given.get(a, a) for a in args]] for case, args in IN_PROCESS.items()]
    done = run_script(
        "tests.integration.test_benchmarks_smoke",
        [json.dumps(cases), str(out)],
        env=cli_env(MULTI30K_DIR=str(multi30k)),
        timeout=900,
    )
    assert done.returncode == 0 and (out / "results.json").is_file(), done.stderr[-3000:]
    return json.loads((out / "results.json").read_text()), out


@pytest.mark.slow
@pytest.mark.parametrize("case", list(IN_PROCESS))
def test_smoke_in_process(case: str, in_process: tuple[dict, Path]) -> None:
    results, out = in_process
    text = (out / results[case]["output"]).read_text()
    assert results[case]["rc"] == 0, text[-3000:]
    if case in TEXT_ONLY:
        assert TEXT_ONLY[case] in text, text[-3000:]
    else:
        assert _last_json(text)


@pytest.mark.slow
@pytest.mark.parametrize("case", list(OWN_PROCESSES))
def test_smoke_own_processes(case: str, multi30k: Path) -> None:
    done = run_script(
        _module(case), OWN_PROCESSES[case], env=cli_env(MULTI30K_DIR=str(multi30k)), timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert _last_json(done.stdout)


def test_every_script_has_a_smoke_case() -> None:
    """A new benchmark script gets a case here (its parts, modules without a __main__ block, need none)."""
    scripts = {
        ".".join(path.relative_to(REPO_ROOT / "benchmarks").with_suffix("").parts)
        for path in (REPO_ROOT / "benchmarks").rglob("*.py")
        if 'if __name__ == "__main__":' in path.read_text() and path.name != "probe.py"  # bench_data's child
    }
    covered = {case.split()[0] for case in (*IN_PROCESS, *OWN_PROCESSES)}
    assert scripts == covered


if __name__ == "__main__":
    _drive(sys.argv[1], sys.argv[2])
