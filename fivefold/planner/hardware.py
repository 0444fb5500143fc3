"""Hardware profiles: what one accelerator and its links can do, in one small TOML file per machine kind.

Fields (SI units: bytes, bytes per second, seconds, FLOP/s):

    name, description, device ("cuda" or "cpu"), source (datasheet or calibration record)
    memory_bytes          memory of one device (HBM; RAM for a CPU host)
    memory_bandwidth      its bandwidth, bytes/s
    gpus_per_node         devices that share the fast intra-node links
    intra_node_bandwidth  bytes/s one device sends in one direction to the others in its node
                          (NVLink: half the bidirectional datasheet figure)
    intra_node_latency    seconds for a small message inside a node
    inter_node_bandwidth  bytes/s one device sends across nodes (its share of the NICs)
    inter_node_latency    seconds for a small message across nodes
    [flops]               dense matmul FLOP/s per dtype: bf16, fp16, fp8, fp32 (0 or absent: none)

How close kernels come to those peaks (the step-time model, fivefold.planner.speed; optional, defaults below):

    matmul_efficiency     a large matmul's rate over the [flops] figure (0.8): below 1 against a datasheet
                          peak; a calibrated profile's [flops] is measured at 2048^3, where the knee already
                          costs, so its asymptote may lie above 1 (at most 4)
    matmul_knee           a matmul dimension d runs at d / (d + knee) of that: small or skinny shapes leave
                          tensor-core tiles idle (128)
    attention_efficiency  fraction of the peak fused (flash) attention reaches, forward and backward, at head
                          size 128 (0.5)
    attention_knee        a head size d runs at d / (d + knee) of that, relative to 128's (0: every head size
                          alike; fivefold.planner.speed.attention_efficiency)
    memory_efficiency     fraction of memory_bandwidth elementwise kernels (norms, activations, Adam) reach (0.8)
    op_overhead           seconds of device time per kernel launched, the gap between dependent kernels (5e-6)
    host_step_s           seconds a step's host spends while the device idles (between reading the step's
                          result and issuing the next step's first kernel: the loop, the data, the first
                          guards) (0)
    host_launch_s         seconds of host work per kernel a forward or backward issues (Python, dynamo's guards,
                          autograd, the launchers) (0)
    host_param_s          seconds of host work per parameter tensor the optimizer steps (0); with these three the
                          step is never shorter than the host takes to issue it (fivefold.planner.speed.host_bound)
    overlap               fraction of overlappable communication that actually hides behind compute: 1 on
                          GPUs (copy engines, NCCL's own SMs); a CPU host's gloo threads share the cores (1)
    comm_interference     fraction of the compute rate lost while an overlapped collective is in flight:
                          NCCL's kernels hold one SM per channel (CTA) for the whole collective, so the
                          kernels they overlap run on the rest (0: not modelled, as in a calibrated profile)
    speed_spread          how far apart devices of this one kind run, slowest to fastest, as a fraction of the
                          typical one's speed (manufacturing and power management: same-SKU GPUs differ by 8%
                          on average, Sinha et al. 2022, arXiv 2208.11035v3). A synchronous step waits for its
                          slowest device, so N devices take longer than one (fivefold.planner.speed.slowest_of) (0)
    [kernels.<dtype>]     matmul_efficiency, matmul_knee and attention_efficiency measured for one dtype (bf16,
                          fp16, fp8, fp32) apart from the figures above, which every other dtype uses:
                          `fivefold calibrate` times both fp32 and bf16, and on a CPU bf16's kernels sit much
                          further below its peak than fp32's (there: attention 0.11 of the bf16 peak, 0.40 of fp32's)

The serving engine's step costs (fivefold.serve.step_cost; an optional [serving] table, written by `fivefold
calibrate --serve`; defaults there):

    skinny_knee           the token dimension of a serving step's matmuls runs at m / (m + knee) of the peak:
                          a decode batch is a skinny product, far below the square-matmul rate
    linear_flops_<dtype>  the square-product rate of the linear the engine runs (serve.linear: oneDNN on a
                          CPU, which the training peak's torch.mm does not time); the knee is relative to it
    step_s, seq_s         the engine's host work per step, and per sequence in it (scheduling, inputs, sampling)
    layer_s, layer_seq_s  per layer of a step run eagerly (launches; a CUDA-graph replay has none), and per
                          sequence and layer (the CPU attention's gathers and calls)
    elementwise_bandwidth bytes/s the engine's norms, residuals, RoPE and activations move at, from a prefill
                          step (on a CPU well under the streaming bandwidth; default: memory_bandwidth x
                          memory_efficiency)
    kv_bandwidth          bytes/s the CPU attention path's cache gathers and SDPA reads move at, from decode
                          steps at two context lengths (CPU only; default: memory_bandwidth x memory_efficiency)

Shipped: fivefold/planner/profiles/*.toml (h100-sxm, h200, a100-80gb, a100-40gb from vendor datasheets;
h100-hbm2e-500w, the power-limited H100s torchtitan benchmarked on, from that page).
A user's own file is given by path. A link figure of 0 means "not measured" (e.g. a calibration run on one
process cannot see a link). `profile_for_device_name` finds the shipped profile of a CUDA device by its name.
"""

from __future__ import annotations

import dataclasses
import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from fivefold.config import ConfigError

PROFILE_DIR = Path(__file__).parent / "profiles"
DTYPES = ("bf16", "fp16", "fp8", "fp32")
EFFICIENCY = {"matmul_efficiency": 0.8, "matmul_knee": 128.0, "attention_efficiency": 0.5, "attention_knee": 0.0,
              "memory_efficiency": 0.8, "op_overhead": 5e-6, "host_step_s": 0.0, "host_launch_s": 0.0,
              "host_param_s": 0.0, "overlap": 1.0, "comm_interference": 0.0,
              "speed_spread": 0.0}
_FRACTIONS = ("attention_efficiency", "memory_efficiency", "overlap")
DTYPE_KERNELS = ("matmul_efficiency", "matmul_knee", "attention_efficiency")  # what [kernels.<dtype>] may hold
SERVING = ("skinny_knee", "step_s", "seq_s", "layer_s", "layer_seq_s", "linear_flops_fp32", "linear_flops_bf16",
           "linear_flops_fp16", "elementwise_bandwidth", "kv_bandwidth")
_NUMBERS = ("memory_bytes", "memory_bandwidth", "intra_node_bandwidth", "intra_node_latency",
            "inter_node_bandwidth", "inter_node_latency")


@dataclass(frozen=True)
class HardwareProfile:
    name: str
    description: str
    device: str
    memory_bytes: float
    memory_bandwidth: float
    gpus_per_node: int
    intra_node_bandwidth: float
    intra_node_latency: float
    inter_node_bandwidth: float
    inter_node_latency: float
    flops: dict[str, float] = field(default_factory=dict)
    source: str = ""
    matmul_efficiency: float = EFFICIENCY["matmul_efficiency"]
    matmul_knee: float = EFFICIENCY["matmul_knee"]
    attention_efficiency: float = EFFICIENCY["attention_efficiency"]  # at head size 128
    attention_knee: float = EFFICIENCY["attention_knee"]  # in head sizes (fivefold.planner.speed.attention_efficiency)
    memory_efficiency: float = EFFICIENCY["memory_efficiency"]
    op_overhead: float = EFFICIENCY["op_overhead"]
    host_step_s: float = EFFICIENCY["host_step_s"]
    host_launch_s: float = EFFICIENCY["host_launch_s"]
    host_param_s: float = EFFICIENCY["host_param_s"]
    overlap: float = EFFICIENCY["overlap"]
    comm_interference: float = EFFICIENCY["comm_interference"]
    speed_spread: float = EFFICIENCY["speed_spread"]
    serving: dict[str, float] = field(default_factory=dict)  # [serving]: measured engine step costs
    kernels: dict[str, dict[str, float]] = field(default_factory=dict)  # [kernels.<dtype>]: per-dtype figures

    def for_dtype(self, dtype: str) -> "HardwareProfile":
        """This profile with `dtype`'s own matmul and attention figures ([kernels.<dtype>]) where it has them."""
        own = self.kernels.get(dtype)
        return dataclasses.replace(self, **own) if own else self

    def peak_flops(self, dtype: str) -> float:
        """Dense matmul FLOP/s for `dtype` (bf16, fp16, fp8, fp32); an error if the device has none."""
        value = self.flops.get(dtype, 0.0)
        if not value:
            have = ", ".join(k for k, v in self.flops.items() if v) or "none"
            raise ConfigError(f"hardware profile {self.name!r} has no {dtype} matmul figure (it has: {have})")
        return value

    def to_toml(self) -> str:
        lines = ["# fivefold hardware profile (fields: fivefold/planner/hardware.py)",
                 f"name = {_quote(self.name)}", f"description = {_quote(self.description)}",
                 f"device = {_quote(self.device)}", f"source = {_quote(self.source)}",
                 f"gpus_per_node = {self.gpus_per_node}"]
        lines += [f"{key} = {getattr(self, key):.6g}" for key in (*_NUMBERS, *EFFICIENCY)]
        lines += ["", "[flops]"] + [f"{dtype} = {value:.6g}" for dtype, value in self.flops.items()]
        if self.serving:
            lines += ["", "[serving]"] + [f"{key} = {value:.6g}" for key, value in self.serving.items()]
        for dtype, figures in self.kernels.items():
            lines += ["", f"[kernels.{dtype}]"] + [f"{key} = {value:.6g}" for key, value in figures.items()]
        return "\n".join(lines) + "\n"


def _quote(text: str) -> str:
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def shipped_profiles() -> list[str]:
    return sorted(p.stem for p in PROFILE_DIR.glob("*.toml"))


# The words of a CUDA device name (torch.cuda.get_device_name, split at spaces and dashes, lower case) that
# identify the part each shipped profile describes. All of a profile's words must be there. The profiles are
# SXM parts: a name with "pcie" or "nvl" is another card of the same chip at lower clocks and power (the H100
# PCIe: 756 dense bf16 TFLOP/s, not 989) and matches nothing. Examples:
#   "NVIDIA H200" -> h200; "NVIDIA H100 80GB HBM3" -> h100-sxm; "NVIDIA A100-SXM4-80GB" -> a100-80gb;
#   nothing for "NVIDIA H100 PCIe", "NVIDIA H100 NVL", "NVIDIA H200 NVL", "NVIDIA GH200 480GB" (word gh200),
#   "NVIDIA A100-PCIE-40GB", "NVIDIA A100 80GB PCIe", "NVIDIA H800", and h100-hbm2e-500w's power-limited
#   HBM2e part (its device name does not tell it from other H100s).
DEVICE_NAME_WORDS = {
    "h200": {"h200"},
    "h100-sxm": {"h100", "hbm3"},  # the SXM5 part; the PCIe card's name has no memory type
    "a100-80gb": {"a100", "sxm4", "80gb"},
    "a100-40gb": {"a100", "sxm4", "40gb"},
}
_OTHER_BOARDS = {"pcie", "nvl"}


def profile_for_device_name(device_name: str) -> str | None:
    """The shipped profile whose part has this CUDA device name (rule above DEVICE_NAME_WORDS), or None."""
    words = set(re.split(r"[\s\-_]+", device_name.lower()))
    if words & _OTHER_BOARDS:
        return None
    return next((name for name, needed in DEVICE_NAME_WORDS.items() if needed <= words), None)


def load_profile(name_or_path: str | Path) -> HardwareProfile:
    """A shipped profile by name (h100-sxm, ...) or a profile file by path, validated."""
    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILE_DIR / f"{name_or_path}.toml"
        if not path.is_file():
            shipped = shipped_profiles()
            near = [n for n in shipped if n.startswith(str(name_or_path).lower())]
            hint = f" (did you mean {' or '.join(near)}?)" if near else ""
            raise ConfigError(f"no hardware profile {str(name_or_path)!r}{hint}: give a TOML file (e.g. from "
                              f"`fivefold calibrate --out FILE`) or one of {', '.join(shipped)}")
    try:
        values = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"hardware profile {path} is not valid TOML: {e}") from None
    return profile_from_dict(values, str(path))


def profile_from_dict(values: dict, where: str) -> HardwareProfile:
    fields = {f.name for f in dataclasses.fields(HardwareProfile)}
    unknown = sorted(set(values) - fields)
    if unknown:
        raise ConfigError(f"hardware profile {where}: unknown field(s) {', '.join(unknown)}; valid: "
                          f"{', '.join(sorted(fields))}")
    missing = sorted(k for k in ("name", "device", "memory_bytes", "gpus_per_node", *_NUMBERS) if k not in values)
    if missing:
        raise ConfigError(f"hardware profile {where}: missing {', '.join(missing)}")
    for key in (*_NUMBERS, *(k for k in EFFICIENCY if k in values)):
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"hardware profile {where}: {key}={value!r} must be a number >= 0")
    _check_efficiencies(values, where)
    kernels = values.get("kernels", {})
    if not isinstance(kernels, dict) or set(kernels) - set(DTYPES):
        raise ConfigError(f"hardware profile {where}: [kernels.<dtype>] tables are for {', '.join(DTYPES)}")
    kernels = {dtype: _table(kernels, dtype, DTYPE_KERNELS, f"{where} [kernels]") for dtype in kernels}
    for dtype, figures in kernels.items():
        _check_efficiencies(figures, f"{where} [kernels.{dtype}]")
    if "comm_interference" in values and not 0 <= values["comm_interference"] < 1:
        raise ConfigError(f"hardware profile {where}: comm_interference={values['comm_interference']!r} must be a "
                          f"fraction in [0, 1)")
    if "speed_spread" in values and not 0 <= values["speed_spread"] < 1:
        raise ConfigError(f"hardware profile {where}: speed_spread={values['speed_spread']!r} must be a fraction "
                          f"in [0, 1)")
    if values["memory_bytes"] <= 0:
        raise ConfigError(f"hardware profile {where}: memory_bytes must be > 0")
    if not isinstance(values["gpus_per_node"], int) or values["gpus_per_node"] < 1:
        raise ConfigError(f"hardware profile {where}: gpus_per_node={values['gpus_per_node']!r} must be an "
                          f"integer >= 1")
    if values["device"] not in ("cuda", "cpu"):
        raise ConfigError(f"hardware profile {where}: device={values['device']!r} must be cuda or cpu")
    return HardwareProfile(**{**values, "flops": _table(values, "flops", DTYPES, where),
                              "serving": _table(values, "serving", SERVING, where), "kernels": kernels,
                              **{k: float(values[k]) for k in (*_NUMBERS, *EFFICIENCY) if k in values}})


def _check_efficiencies(values: dict, where: str) -> None:
    """The ranges of the efficiency figures present in `values` (the top level, or a [kernels.<dtype>])."""
    if "matmul_efficiency" in values and not 0 < values["matmul_efficiency"] <= 4:
        raise ConfigError(f"hardware profile {where}: matmul_efficiency={values['matmul_efficiency']!r} must be "
                          f"in (0, 4]")
    for key in _FRACTIONS:
        if key in values and not 0 < values[key] <= 1 and not (key == "overlap" and values[key] == 0):
            raise ConfigError(f"hardware profile {where}: {key}={values[key]!r} must be a fraction in (0, 1]")


def _table(values: dict, name: str, keys: tuple[str, ...], where: str) -> dict[str, float]:
    """A profile's [name] table of numbers >= 0 under the given keys (absent: empty)."""
    table = values.get(name, {})
    if not isinstance(table, dict) or set(table) - set(keys):
        raise ConfigError(f"hardware profile {where}: [{name}] takes {', '.join(keys)}")
    for key, value in table.items():
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise ConfigError(f"hardware profile {where}: {name}.{key}={value!r} must be a number >= 0")
    return {k: float(v) for k, v in table.items()}
