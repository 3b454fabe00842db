"""Peak and resident memory of loading a bf16 Hugging Face folder, each way in a fresh process.

Ways: `copy` (parameters allocated, then every tensor copied from the mapped file into them:
the loader before folders were shared), `shared` (`load_model`: tensors in the model's dtype
are the parameters, views of the mapped file), `q8_0` and `q4_0` (`load_model(quantize=...)`).
Each child imports torch and radixrt first, then reports (MiB above its RSS then):
  - the peak RSS of the load (VmHWM, reset after the import through /proc/self/clear_refs);
  - the RSS after the load;
  - the RSS after a first step, a 16-token prefill, split into anonymous memory and mapped
    file pages (/proc/self/status). --deterministic auto is `Runtime`'s default:
    batch-invariant steps where radixrt's kernels serve the model, which read the dense
    weights as loaded; false: a bf16 model's projections are packed for oneDNN on that step,
    a copy of their own.
The folder (default: the bundled SmolLM2-135M-Instruct's dense weights written in bf16 to a
temp dir, `radixrt.benchmarks.hf_folders`) is read once before the children so each finds
it in the page cache.

Run: python bench/folder_rss_bench.py [--folder PATH] [--ways copy,shared,q8_0,q4_0] [--reps 3]
         [--deterministic auto|false]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time
import torch
from radixrt.model import loader
from radixrt.model.checkpoint import checkpoint_weights
from radixrt.model.llama import LlamaForCausalLM

def status():
    fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return {key: int(fields[key].split()[0]) for key in ("VmRSS", "RssAnon", "RssFile", "VmHWM")}

folder, way, deterministic = sys.argv[1], sys.argv[2], sys.argv[3] == "auto" and "auto"
torch.empty(1)
with open("/proc/self/clear_refs", "w") as clear:
    clear.write("5")  # the peak (VmHWM) restarts from the RSS now
importing = status()
started = time.perf_counter()
if way == "copy":
    config, tokenizer, _ = loader._config_and_tokenizer(loader.Path(folder))
    model = LlamaForCausalLM(config, dtype=torch.bfloat16)
    model.load_hf_state_dict(checkpoint_weights(loader.Path(folder)))
    model.prepack()
else:
    model = loader.load_model(folder, dtype="bfloat16", quantize=None if way == "shared" else way).model
seconds = time.perf_counter() - started
loaded = status()
from radixrt.kernels.forward_batch import ForwardBatch
from radixrt.kernels.registry import create_backend
from radixrt.memory import KVCache
from radixrt.model.runner import ModelRunner
config = model.config
cache = KVCache(config.kv_shape(model.dtype), 64)
backend = create_backend("torch", cache, config.num_heads, config.num_kv_heads, config.head_dim)
runner = ModelRunner(model, cache, backend, deterministic=deterministic)
runner.forward(ForwardBatch.build([list(range(16))], [0], [torch.arange(16)]))
stepped = status()
print(json.dumps({"peak_mb": (loaded["VmHWM"] - importing["VmRSS"]) / 1024, "load_s": seconds,
                  "loaded_mb": (loaded["VmRSS"] - importing["VmRSS"]) / 1024,
                  **{key + "_mb": (stepped[key] - importing[key]) / 1024 for key in stepped}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--folder", type=Path, default=None)
    parser.add_argument("--ways", default="copy,shared,q8_0,q4_0")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--deterministic", choices=("auto", "false"), default="auto")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as temp:
        folder = args.folder
        if folder is None:
            sys.path.insert(0, str(ROOT))
            from radixrt.benchmarks.hf_folders import write_hf_folder

            folder = write_hf_folder(Path(temp) / "SmolLM2-135M-Instruct-bf16")
        (folder / "model.safetensors").read_bytes()  # into the page cache
        results: dict[str, list[dict[str, float]]] = {way: [] for way in args.ways.split(",")}
        for _ in range(args.reps):
            for way in results:  # interleaved: a slow minute falls on every way alike
                done = subprocess.run([sys.executable, "-c", _CHILD, str(folder), way, args.deterministic],
                                      capture_output=True, text=True, check=True,
                                      env={**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"})
                results[way].append(json.loads(done.stdout.strip().splitlines()[-1]))
    print(f"folder {folder.name}: {(folder / 'model.safetensors').stat().st_size / 2**20:.0f} MiB; medians of "
          f"{args.reps} fresh processes; MiB above the import of torch and radixrt; first step with "
          f"deterministic={args.deterministic}")
    print("| way | peak RSS of the load | RSS after the load | after a first step | of which anonymous | "
          "of which file pages | load s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for way, runs in results.items():
        def median(key: str) -> float:
            return statistics.median(run[key] for run in runs)

        print(f"| {way} | {median('peak_mb'):.0f} | {median('loaded_mb'):.0f} | {median('VmRSS_mb'):.0f} | "
              f"{median('RssAnon_mb'):.0f} | {median('RssFile_mb'):.0f} | {median('load_s'):.2f} |")


if __name__ == "__main__":
    main()
