"""What checkpoint integrity costs: the checksum's speed against the alternatives, and what the manifest
adds to a real save and a real load, printed as ms per GB and as ratios to the save / load itself.

    python bench/checkpoint_verify.py                      # a 125M-parameter model: a 1.5 GB checkpoint
    python bench/checkpoint_verify.py --hidden 1024 --layers 20 --json bench/results/checkpoint_verify.json

Measured, on this process's one core (the hash runs on the rank that wrote or reads the file):
- hashes: each candidate over the same 512 MiB in memory (xxh3-64 is the one fivefold uses; crc32c,
  blake3 and xxh64 are timed when their packages are installed, zlib.crc32 and sha256 always).
- save: write_checkpoint of the model's weights and Adam moments, the same call fivefold's trainer makes;
  the part spent hashing the written files (for the manifest) is timed on its own.
- load: verify_checkpoint (map + hash every file against the manifest) and read_state (the DCP load of
  every tensor), each from the page cache (the checkpoint was just written), best of 3. With --cold
  (root only: it writes /proc/sys/vm/drop_caches) also from disk: caches dropped, verify, then load (which
  then finds the files cached by the verification), against a load from a cold cache without verifying.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import tempfile
import time
import zlib
from pathlib import Path

import torch

from fivefold.config_load import load_config
from fivefold.checkpoint import store as ckpt
from fivefold.checkpoint.pieces import read_state


def hash_speeds(size: int = 512 * 2**20) -> dict[str, float]:
    """ms per GB (1e9 bytes) of each checksum over `size` bytes in memory (best of 3)."""
    import xxhash

    data = memoryview(os.urandom(size))
    candidates = {"xxh3_64 (fivefold)": lambda: xxhash.xxh3_64(data).digest(),
                  "xxh64": lambda: xxhash.xxh64(data).digest(),
                  "zlib.crc32": lambda: zlib.crc32(data),
                  "sha256": lambda: hashlib.sha256(data).digest()}
    try:
        import crc32c
        candidates["crc32c"] = lambda: crc32c.crc32c(data)
    except ImportError:
        pass
    try:
        import blake3
        candidates["blake3 (1 thread)"] = lambda: blake3.blake3(data).digest()
    except ImportError:
        pass
    speeds = {}
    for name, fn in candidates.items():
        best = min(_timed(fn) for _ in range(3))
        speeds[name] = best / (size / 1e9) * 1e3
    return speeds


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def drop_page_cache() -> None:
    os.sync()
    Path("/proc/sys/vm/drop_caches").write_text("3\n")


def checkpoint_costs(cfg, root: Path, cold: bool = False) -> dict:
    from fivefold.model import Transformer, materialise

    with torch.device("meta"):
        model = Transformer(cfg.model)
    materialise(model, "cpu", seed=0, dtype=torch.float32)
    tensors = {}
    for name, p in model.named_parameters():
        tensors[f"model.{name}"] = p.detach()
        tensors[f"optim.{name}.exp_avg"] = torch.randn_like(p)
        tensors[f"optim.{name}.exp_avg_sq"] = torch.rand_like(p)

    real_entry, hashing = ckpt.file_entry, [0.0]

    def timed_entry(path):
        start = time.perf_counter()
        try:
            return real_entry(path)
        finally:
            hashing[0] += time.perf_counter() - start
    ckpt.file_entry = timed_entry
    try:
        start = time.perf_counter()
        path = ckpt.write_checkpoint(root, "step_00000001", cfg, tensors)
        save = time.perf_counter() - start
    finally:
        ckpt.file_entry = real_entry
    size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
    verify = min(_timed(lambda: ckpt.verify_checkpoint(path)) for _ in range(3))
    assert ckpt.verify_checkpoint(path) == []
    targets = {k: torch.empty_like(v) for k, v in tensors.items()}
    load = min(_timed(lambda: read_state(path, targets)) for _ in range(3))
    gb = size / 1e9
    extra = {}
    if cold:
        drop_page_cache()
        cold_verify = _timed(lambda: ckpt.verify_checkpoint(path))
        load_after = _timed(lambda: read_state(path, targets))
        drop_page_cache()
        cold_load = _timed(lambda: read_state(path, targets))
        extra = {"cold_verify_s": cold_verify, "cold_load_after_verify_s": load_after, "cold_load_s": cold_load,
                 "cold_verify_ms_per_gb": cold_verify / gb * 1e3, "cold_load_ms_per_gb": cold_load / gb * 1e3,
                 "cold_verified_load_over_load": (cold_verify + load_after) / cold_load}
    return {**extra, "checkpoint_bytes": size, "save_s": save, "save_hash_s": hashing[0], "verify_s": verify,
            "load_s": load, "save_hash_ms_per_gb": hashing[0] / gb * 1e3, "verify_ms_per_gb": verify / gb * 1e3,
            "load_ms_per_gb": load / gb * 1e3, "hash_share_of_save": hashing[0] / save,
            "verify_over_load": verify / load}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--dir", help="where to write the checkpoint (default: a temporary directory)")
    parser.add_argument("--json", help="write the results here")
    parser.add_argument("--cold", action="store_true", help="also from disk (drops the page cache: root only)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    heads = args.hidden // 64
    cfg = load_config(overrides=[f"model.hidden_size={args.hidden}", f"model.num_layers={args.layers}",
                                 f"model.num_heads={heads}", f"model.num_kv_heads={heads}",
                                 f"model.ffn_hidden_size={args.hidden * 8 // 3 // 64 * 64}",
                                 f"model.vocab_size={args.vocab}"])
    speeds = hash_speeds()
    print("checksum over 512 MiB in memory, one core:")
    chosen = speeds["xxh3_64 (fivefold)"]
    for name, ms in sorted(speeds.items(), key=lambda kv: kv[1]):
        print(f"  {name:20s} {ms:8.0f} ms/GB   {ms / chosen:5.1f}x xxh3_64's time")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        costs = checkpoint_costs(cfg, Path(tmp), args.cold)
    gb = costs["checkpoint_bytes"] / 1e9
    print(f"\ncheckpoint: {gb:.2f} GB (weights + Adam moments, {costs['checkpoint_bytes'] / 12 / 1e6:.0f}M parameters)")
    print(f"  save   {costs['save_s']:7.2f} s, of which hashing for the manifest {costs['save_hash_s']:.2f} s "
          f"({costs['save_hash_ms_per_gb']:.0f} ms/GB, {100 * costs['hash_share_of_save']:.0f}% of the save)")
    print(f"  verify {costs['verify_s']:7.2f} s ({costs['verify_ms_per_gb']:.0f} ms/GB) from the page cache")
    print(f"  load   {costs['load_s']:7.2f} s ({costs['load_ms_per_gb']:.0f} ms/GB) from the page cache; "
          f"verify / load = {costs['verify_over_load']:.2f}")
    if args.cold:
        print(f"  from disk: verify {costs['cold_verify_s']:.2f} s ({costs['cold_verify_ms_per_gb']:.0f} ms/GB) + "
              f"load {costs['cold_load_after_verify_s']:.2f} s, against an unverified load of "
              f"{costs['cold_load_s']:.2f} s ({costs['cold_load_ms_per_gb']:.0f} ms/GB): "
              f"{costs['cold_verified_load_over_load']:.2f}x")
    if args.json:
        result = {"model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab},
                  "hash_ms_per_gb": speeds, **costs, "torch": torch.__version__}
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
