"""The model files `real_models_bench.py` reads: random weights, SmolLM2's tokenizer, never committed.

    python bench/real_models_files.py /work/models [--llamacpp-python /work/llama-native-venv/bin/python]
        [--only smollm2-q4_0,smollm2-q4_k_m,llama8b-q4_k_m]

  smollm2-1.7b-shape.F16.gguf      SmolLM2-1.7B's shape (`SMOLLM2_1_7B`), every matrix F16,
                                   norms F32, written by `gguf_models.write_llama_gguf`: the
                                   quantizer's input
  smollm2-1.7b-shape.Q4_0.gguf     llama.cpp's quantizer (`llama_model_quantize`, ftype Q4_0)
  smollm2-1.7b-shape.Q4_K_M.gguf   llama.cpp's quantizer, ftype Q4_K_M
  llama-3.1-8b-shape.Q4_K_M.gguf   Llama-3.1-8B's shape (`LLAMA_3_1_8B`) written directly as
                                   llama.cpp's Q4_K_M mix (`write_q4_k_m_gguf`: random valid
                                   K-quant blocks, no dense intermediate)

The quantizer runs in the llama-cpp-python venv given (2 threads). For each
1.7B file quantized by llama.cpp, the types it chose are compared with
`q4_k_m_types` (Q4_K_M) or with its Q4_0 rule (every matrix Q4_0, the tied
embedding Q6_K), so the 8B file's mix is checked against the quantizer's own.
Prints each file's size and tensor-type counts; an existing file is kept.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixrt.benchmarks.gguf_models import (LLAMA_3_1_8B, SMOLLM2_1_7B, q4_k_m_types, tensor_type_counts,
                                            write_llama_gguf, write_q4_k_m_gguf)  # fmt: skip
from radixrt.model.gguf_file import GGUFFile

FILES = ("smollm2-q4_0", "smollm2-q4_k_m", "llama8b-q4_k_m")
# llama.cpp's llama_ftype numbers
FTYPES = {"Q4_0": 2, "Q4_K_M": 15}
_QUANTIZE = """
import ctypes, sys, llama_cpp
params = llama_cpp.llama_model_quantize_default_params()
params.ftype, params.nthread = int(sys.argv[3]), 2
if llama_cpp.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), ctypes.byref(params)):
    sys.exit("llama_model_quantize failed")
"""


def quantize(python: str, source: Path, target: Path, ftype: str) -> None:
    partial = target.with_suffix(".partial")
    subprocess.run([python, "-c", _QUANTIZE, str(source), str(partial), str(FTYPES[ftype])], check=True)
    partial.rename(target)


def expected_types(ftype: str) -> dict[str, str]:
    """The type llama.cpp's quantizer gives each matrix of the 1.7B shape (tied embedding)."""
    types = q4_k_m_types(SMOLLM2_1_7B)
    if ftype == "Q4_0":
        types = {name: "Q4_0" for name in types} | {"token_embd.weight": "Q6_K"}
    return types


def check_types(path: Path, expected: dict[str, str]) -> None:
    stored = {name: t.type_name for name, t in GGUFFile(path).tensors.items() if t.type_name != "F32"}
    wrong = {name: (stored.get(name), kind) for name, kind in expected.items() if stored.get(name) != kind}
    if wrong or set(stored) != set(expected):
        raise RuntimeError(f"{path.name}: types differ from the expected mix (stored, expected): {wrong}")


def describe(path: Path) -> None:
    print(f"{path}: {path.stat().st_size:,} bytes ({path.stat().st_size / 2**30:.2f} GiB), "
          f"types {tensor_type_counts(path)}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("folder", type=Path)
    parser.add_argument("--llamacpp-python", default="/work/llama-native-venv/bin/python",
                        help="a python with llama-cpp-python installed (its quantizer)")
    parser.add_argument("--only", default=",".join(FILES), help=f"comma-separated, from {', '.join(FILES)}")
    args = parser.parse_args()
    wanted = [f.strip() for f in args.only.split(",") if f.strip()]
    if unknown := sorted(set(wanted) - set(FILES)):
        parser.error(f"--only must name some of {', '.join(FILES)}; unknown: {', '.join(unknown)}")
    args.folder.mkdir(parents=True, exist_ok=True)
    f16 = args.folder / "smollm2-1.7b-shape.F16.gguf"
    for name in wanted:
        started = time.perf_counter()
        if name.startswith("smollm2"):
            ftype = "Q4_0" if name.endswith("q4_0") else "Q4_K_M"
            target = args.folder / f"smollm2-1.7b-shape.{ftype}.gguf"
            if not f16.is_file():
                write_llama_gguf(f16.with_suffix(".partial"), SMOLLM2_1_7B, projection_type="F16",
                                 embedding_type="F16").rename(f16)
                describe(f16)
            if not target.is_file():
                quantize(args.llamacpp_python, f16, target, ftype)
            check_types(target, expected_types(ftype))
        else:
            target = args.folder / "llama-3.1-8b-shape.Q4_K_M.gguf"
            if not target.is_file():
                write_q4_k_m_gguf(target.with_suffix(".partial"), LLAMA_3_1_8B).rename(target)
            check_types(target, q4_k_m_types(LLAMA_3_1_8B))
        describe(target)
        print(f"  ({time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
