"""Hugging Face checkpoints in and out: Llama, Mistral, Qwen2 and GPT-2, safetensors only.

Our parameter names follow HF's Llama layout (fivefold/model/transformer.py), so the Llama family
maps name for name. GPT-2 needs real work: its Conv1D layers store weights as (in, out), the
transpose of nn.Linear, and q, k, v live in one fused `c_attn` matrix.

The tokenizer travels with the weights: import copies tokenizer.json and its companions (TOKENIZER_FILES)
into the checkpoint, where `fivefold generate` finds tokenizer.json as it does for a trained run, and
export writes whichever of them the checkpoint holds back out.
"""

from __future__ import annotations

import json
import os
import re
import warnings
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from tokenizers import Tokenizer

from fivefold.checkpoint.files import read_json
from fivefold.checkpoint.store import load_weights
from fivefold.config import ConfigError, ModelConfig
from fivefold.data.chat import DEFAULT_CHAT_TEMPLATE
from fivefold.errors import CheckpointError
from fivefold.model import Transformer

ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "gpt2": "GPT2LMHeadModel"}
_FAMILY_OF = {arch: family for family, arch in ARCHITECTURES.items()}
# transformers' "gelu_new" and "gelu_pytorch_tanh" are both the tanh approximation our MLP uses.
_GPT2_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh")
# Copied byte for byte, whichever exist: HF dir -> checkpoint on import, checkpoint -> HF dir on export.
# None collides with a checkpoint's own files (config.json, state/, trainer_state.json, rng.safetensors).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")


# --------------------------------------------------------------------------------------------
# config.json <-> ModelConfig


def _family(hf: dict) -> str:
    archs = hf.get("architectures") or []
    for arch in archs:
        if arch in _FAMILY_OF:
            return _FAMILY_OF[arch]
    if not archs and hf.get("model_type") in ARCHITECTURES:
        return hf["model_type"]
    raise ConfigError(f"architectures={archs} (model_type={hf.get('model_type')!r}) is not supported; "
                      f"fivefold imports {', '.join(ARCHITECTURES.values())}")


def _rope_fields(hf: dict) -> dict:
    # transformers 5 nests rope settings in `rope_parameters`; 4.x has top-level rope_theta/rope_scaling.
    params = hf.get("rope_parameters")
    if params and all(isinstance(v, dict) for v in params.values()):
        raise ConfigError("rope_parameters per layer type is not supported; fivefold uses one RoPE for all layers")
    theta = float((params or {}).get("rope_theta", hf.get("rope_theta", 10000.0)))
    scaling = params or hf.get("rope_scaling") or {}
    kind = scaling.get("rope_type", scaling.get("type", "default"))
    partial = scaling.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise ConfigError(f"partial_rotary_factor={partial} is not supported; fivefold rotates the whole head")
    if kind == "default":
        return dict(rope_theta=theta, rope_scaling="none")
    if kind != "llama3":
        raise ConfigError(f"rope_scaling.rope_type={kind!r} is not supported; fivefold implements "
                          f"'default' and 'llama3' RoPE only")
    return dict(rope_theta=theta, rope_scaling="llama3", rope_scaling_factor=float(scaling["factor"]),
                rope_low_freq_factor=float(scaling["low_freq_factor"]),
                rope_high_freq_factor=float(scaling["high_freq_factor"]),
                rope_original_max_seq_len=int(scaling["original_max_position_embeddings"]))


def _warn_sliding_window(hf: dict, family: str) -> None:
    # We attend over the full causal context. A window only changes the output once a sequence is
    # longer than it, so the model is still exact up to that length: warn rather than refuse.
    max_len = hf.get("max_position_embeddings", 2048)
    window = hf.get("sliding_window", 4096 if family == "mistral" else None)  # MistralConfig's default
    if family == "qwen2":  # Qwen2 slides only when asked to, and only from layer max_window_layers on
        sliding = "sliding_attention" in (hf.get("layer_types") or [])
        sliding |= bool(hf.get("use_sliding_window")) and hf.get("max_window_layers", 0) < hf["num_hidden_layers"]
        window = window if sliding else None
    if window is not None and window < max_len:
        warnings.warn(f"sliding_window={window} < max_position_embeddings={max_len}: fivefold has no "
                      f"sliding-window attention; outputs match only for sequences of <= {window} tokens")


def _eos(hf: dict, vocab_size: int) -> int:
    eos = hf.get("eos_token_id")
    if isinstance(eos, list):  # Llama 3.1 lists several stop tokens; the first is end-of-text
        eos = eos[0] if eos else None
    eos = 0 if eos is None else int(eos)
    if not 0 <= eos < vocab_size:
        raise ConfigError(f"eos_token_id={eos} is outside the vocabulary (vocab_size={vocab_size}); fix config.json")
    return eos


def config_from_hf(hf: dict) -> ModelConfig:
    """A Hugging Face config.json (as a dict) -> ModelConfig; unsupported features raise ConfigError."""
    family = _family(hf)
    if hf.get("quantization_config"):
        raise ConfigError("quantization_config: quantized checkpoints are not supported; use the fp16/bf16/fp32 one")
    if family == "gpt2":
        act = hf.get("activation_function", "gelu_new")
        if act not in _GPT2_ACTIVATIONS:
            raise ConfigError(f"activation_function={act!r} is not supported; expected one of {_GPT2_ACTIVATIONS}")
        for key, expected in (("scale_attn_weights", True), ("scale_attn_by_inverse_layer_idx", False),
                              ("add_cross_attention", False)):
            if hf.get(key, expected) != expected:
                raise ConfigError(f"{key}={hf[key]} is not supported by fivefold's GPT-2 (needs {expected})")
        h, heads = hf["n_embd"], hf["n_head"]
        return ModelConfig(
            vocab_size=hf["vocab_size"], hidden_size=h, num_layers=hf["n_layer"], num_heads=heads,
            num_kv_heads=heads, ffn_hidden_size=hf.get("n_inner") or 4 * h, max_seq_len=hf["n_positions"],
            norm="layernorm", norm_eps=hf.get("layer_norm_epsilon", 1e-5), activation="gelu", position="learned",
            tie_embeddings=hf.get("tie_word_embeddings", True), linear_bias=True,
            eos_token_id=_eos(hf, hf["vocab_size"]))
    act = hf.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r} is not supported; fivefold's SwiGLU MLP needs 'silu'")
    attention_bias, mlp_bias = hf.get("attention_bias", False), hf.get("mlp_bias", False)
    if attention_bias != mlp_bias:
        raise ConfigError(f"attention_bias={attention_bias} with mlp_bias={mlp_bias} is not supported; fivefold "
                          f"puts biases on q/k/v only (Qwen2) or on every linear layer (both true)")
    _warn_sliding_window(hf, family)
    h, heads = hf["hidden_size"], hf["num_attention_heads"]
    head_dim = hf.get("head_dim") or h // heads
    return ModelConfig(
        vocab_size=hf["vocab_size"], hidden_size=h, num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, ffn_hidden_size=hf["intermediate_size"],
        head_dim=0 if head_dim * heads == h else head_dim, max_seq_len=hf.get("max_position_embeddings", 2048),
        norm="rmsnorm", norm_eps=hf.get("rms_norm_eps", 1e-6), activation="swiglu", position="rope",
        **_rope_fields(hf), tie_embeddings=hf.get("tie_word_embeddings", False),
        qkv_bias=family == "qwen2", linear_bias=attention_bias and mlp_bias,
        eos_token_id=_eos(hf, hf["vocab_size"]))


def _export_family(cfg: ModelConfig, arch: str | None) -> str:
    if cfg.num_experts:
        raise ConfigError(f"model.num_experts={cfg.num_experts}: a mixture of experts has no Hugging Face layout "
                          f"fivefold writes (Mixtral's is not among {', '.join(ARCHITECTURES)}); keep the fivefold "
                          f"checkpoint, which generate and serve load")
    gpt2_style = cfg.position == "learned" or cfg.activation == "gelu" or cfg.norm == "layernorm"
    family = arch or ("gpt2" if gpt2_style else "qwen2" if cfg.qkv_bias and not cfg.linear_bias else "llama")
    if family not in ARCHITECTURES:
        raise ConfigError(f"arch={arch!r} is not supported; choose one of {', '.join(ARCHITECTURES)}")
    if family == "gpt2":
        needs = dict(position="learned", activation="gelu", norm="layernorm", linear_bias=True,
                     num_kv_heads=cfg.num_heads, head_size=cfg.hidden_size // cfg.num_heads)
    else:
        needs = dict(position="rope", activation="swiglu", norm="rmsnorm")
        if family == "mistral":
            needs.update(qkv_bias=False, linear_bias=False)
        elif family == "qwen2":
            needs.update(qkv_bias=True, linear_bias=False)
        elif not cfg.linear_bias:
            needs.update(qkv_bias=False)  # Llama's attention_bias also adds an o_proj bias
    for key, value in needs.items():
        if getattr(cfg, key) != value:
            raise ConfigError(f"arch={family!r} needs model.{key}={value!r}, the model has {getattr(cfg, key)!r}; "
                              f"choose another --arch or leave it out to pick one automatically")
    return family


def hf_config_from(cfg: ModelConfig, arch: str | None = None) -> dict:
    """ModelConfig -> a config.json dict for `arch` (llama, mistral, qwen2, gpt2; None picks one)."""
    family = _export_family(cfg, arch)
    out = {"architectures": [ARCHITECTURES[family]], "model_type": family, "vocab_size": cfg.vocab_size,
           "tie_word_embeddings": cfg.tie_embeddings, "eos_token_id": cfg.eos_token_id,
           "dtype": "float32", "torch_dtype": "float32",  # transformers 5 and 4 spellings
           "initializer_range": cfg.init_std, "use_cache": True}
    if family == "gpt2":
        # ModelConfig has no bos id; GPT-2 uses <|endoftext|> for both.
        return {**out, "bos_token_id": cfg.eos_token_id, "n_embd": cfg.hidden_size, "n_layer": cfg.num_layers,
                "n_head": cfg.num_heads, "n_inner": cfg.ffn_hidden_size, "n_positions": cfg.max_seq_len,
                "n_ctx": cfg.max_seq_len, "activation_function": "gelu_new", "layer_norm_epsilon": cfg.norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False}
    rope = {"rope_type": "default"}
    if cfg.rope_scaling == "llama3":
        rope = {"rope_type": "llama3", "factor": cfg.rope_scaling_factor,
                "low_freq_factor": cfg.rope_low_freq_factor, "high_freq_factor": cfg.rope_high_freq_factor,
                "original_max_position_embeddings": cfg.rope_original_max_seq_len}
    out.update({
        "bos_token_id": None, "hidden_size": cfg.hidden_size, "intermediate_size": cfg.ffn_hidden_size,
        "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_size, "hidden_act": "silu",
        "max_position_embeddings": cfg.max_seq_len, "rms_norm_eps": cfg.norm_eps, "attention_dropout": 0.0,
        # Both spellings, so transformers 4.x (rope_theta/rope_scaling) and 5.x (rope_parameters) agree.
        "rope_theta": cfg.rope_theta, "rope_scaling": rope if cfg.rope_scaling != "none" else None,
        "rope_parameters": {**rope, "rope_theta": cfg.rope_theta},
    })
    if family == "llama":
        out.update(attention_bias=cfg.linear_bias, mlp_bias=cfg.linear_bias)
    elif family == "mistral":
        out.update(sliding_window=None)  # full attention, as we train it
    else:
        out.update(sliding_window=None, use_sliding_window=False, max_window_layers=cfg.num_layers)
    return out


# --------------------------------------------------------------------------------------------
# Weight names. Llama family: ours = HF minus the `model.` prefix, with three module renames.

_LLAMA_MODULES = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "attn": "self_attn",
                  "mlp": "mlp"}
_LLAMA_MODULES_FROM_HF = {hf: ours for ours, hf in _LLAMA_MODULES.items()}
# Buffers some checkpoints carry: old Llama rotary tables, GPT-2's causal mask.
_IGNORED = re.compile(r".*rotary_emb\.inv_freq|(transformer\.)?h\.\d+\.attn\.(bias|masked_bias)")


def _llama_name(name: str, modules: dict[str, str], prefix_in: str, prefix_out: str) -> str:
    if name == "lm_head.weight":
        return name
    if not name.startswith(prefix_in):
        raise CheckpointError(f"unexpected tensor {name!r} in a Llama-family checkpoint")
    parts = name[len(prefix_in):].split(".")
    if parts[0] == "layers" and len(parts) > 3 and parts[2] in modules:
        parts[2] = modules[parts[2]]
    return prefix_out + ".".join(parts)


def _gpt2_names(cfg: ModelConfig) -> list[tuple[str, str]]:
    """(HF name without `transformer.`, our name) for every GPT-2 tensor but the fused q/k/v."""
    names = [("wte.weight", "embed_tokens.weight"), ("wpe.weight", "embed_positions.weight"),
             ("ln_f.weight", "norm.weight"), ("ln_f.bias", "norm.bias")]
    modules = (("ln_1", "attn_norm"), ("attn.c_proj", "attn.o_proj"), ("ln_2", "mlp_norm"),
               ("mlp.c_fc", "mlp.up_proj"), ("mlp.c_proj", "mlp.down_proj"))
    for i in range(cfg.num_layers):
        names += [(f"h.{i}.{hf}.{kind}", f"layers.{i}.{ours}.{kind}") for hf, ours in modules
                  for kind in ("weight", "bias")]
    return names


def _is_conv1d(hf_name: str) -> bool:
    return hf_name.endswith(".weight") and ".c_" in hf_name  # Conv1D weight: (in, out) = Linear's transpose


def _gpt2_from_hf(t: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    t = {k.removeprefix("transformer."): v for k, v in t.items()}

    def take(name):
        if name not in t:
            raise CheckpointError(f"GPT-2 checkpoint lacks tensor {name!r}")
        return t.pop(name).T if _is_conv1d(name) else t.pop(name)

    out = {ours: take(hf) for hf, ours in _gpt2_names(cfg)}
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):  # c_attn: q, k, v stacked along the output dim, (3h, h) once transposed
            parts = take(f"h.{i}.attn.c_attn.{kind}").split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            out.update({f"layers.{i}.attn.{p}_proj.{kind}": part for p, part in zip("qkv", parts)})
    if "lm_head.weight" in t:
        out["lm_head.weight"] = t.pop("lm_head.weight")
    if t:
        raise CheckpointError(f"unexpected tensors in GPT-2 checkpoint: {sorted(t)[:5]}")
    return out


def _gpt2_to_hf(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {hf: w[ours].T if _is_conv1d(hf) else w[ours] for hf, ours in _gpt2_names(cfg)}
    for i in range(cfg.num_layers):
        for kind in ("weight", "bias"):
            fused = torch.cat([w[f"layers.{i}.attn.{p}_proj.{kind}"] for p in "qkv"])
            out[f"h.{i}.attn.c_attn.{kind}"] = fused.T if kind == "weight" else fused
    out = {f"transformer.{k}": v for k, v in out.items()}
    if "lm_head.weight" in w:
        out["lm_head.weight"] = w["lm_head.weight"]
    return out


def weights_from_hf(tensors: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """HF tensor names -> ours, as fp32. A tied model drops HF's (redundant) lm_head copy if present."""
    tensors = {k: v.float() for k, v in tensors.items() if not _IGNORED.fullmatch(k)}
    if cfg.position == "learned":
        out = _gpt2_from_hf(tensors, cfg)
    else:
        out = {_llama_name(k, _LLAMA_MODULES_FROM_HF, "model.", ""): v for k, v in tensors.items()}
    if cfg.tie_embeddings:
        out.pop("lm_head.weight", None)
    return out


def hf_name(name: str) -> str:
    """A Llama-family parameter's Hugging Face name: layers.0.attn.q_proj.weight ->
    model.layers.0.self_attn.q_proj.weight."""
    return _llama_name(name, _LLAMA_MODULES, "", "model.")


def weights_to_hf(weights: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    if cfg.position == "learned":
        out = _gpt2_to_hf(weights, cfg)
    else:
        out = {hf_name(k): v for k, v in weights.items()}
    return {k: v.detach().float().cpu().contiguous() for k, v in out.items()}


# --------------------------------------------------------------------------------------------
# Reading and writing checkpoint directories


def empty_model(cfg: ModelConfig) -> Transformer:
    """A model with allocated but unset weights, ready for load_weights (no wasted random init)."""
    with torch.device("meta"):
        model = Transformer(cfg)
    model.to_empty(device="cpu")
    model.tie_weights()  # to_empty gives each module a fresh Parameter, untying lm_head
    model.reset_buffers()
    return model


def read_hf_config(src: Path) -> dict:
    return read_json(Path(src) / "config.json", missing_ok=False)


def _shard_files(index: Path) -> list[str]:
    try:
        return sorted(set(read_json(index, missing_ok=False)["weight_map"].values()))
    except (KeyError, AttributeError, TypeError):
        raise CheckpointError(f"{index} has no weight_map of tensor -> file") from None


def _safetensors(path: Path, open_fn):
    try:
        return open_fn(str(path))
    except (SafetensorError, OSError) as e:
        if isinstance(e, FileNotFoundError):
            raise FileNotFoundError(f"{path} is missing (named by the model's safetensors index)") from None
        raise CheckpointError(f"{path} is not a readable safetensors file ({e})") from None


def read_hf_tensors(src: Path) -> dict[str, torch.Tensor]:
    index = src / "model.safetensors.index.json"
    if (src / "model.safetensors").is_file():
        return _safetensors(src / "model.safetensors", load_file)
    if index.is_file():
        tensors = {}
        for shard in _shard_files(index):
            tensors.update(_safetensors(src / shard, load_file))
        return tensors
    if any(src.glob("pytorch_model*.bin")):
        raise FileNotFoundError(
            f"{str(src)!r} has only pytorch_model*.bin weights, which are pickles that fivefold never loads; "
            f"convert them first: AutoModelForCausalLM.from_pretrained(dir).save_pretrained(out, "
            f"safe_serialization=True)")
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {str(src)!r}")


# Fields that decide which tensors a model has and their shapes: a checkpoint can only start a model that
# agrees on all of them.
_SHAPE_FIELDS = ("vocab_size", "hidden_size", "num_layers", "num_heads", "num_kv_heads", "ffn_hidden_size",
                 "head_size", "tie_embeddings", "qkv_bias", "linear_bias", "norm", "activation", "position")


def check_same_shapes(ours: ModelConfig, theirs: ModelConfig, source: str) -> None:
    """A clear error naming the first shape-deciding setting on which `theirs` (a checkpoint's) differs."""
    for name in _SHAPE_FIELDS:
        mine, wanted = getattr(ours, name), getattr(theirs, name)
        if mine != wanted:
            key = "head_dim" if name == "head_size" else name  # head_size is derived from head_dim
            raise ConfigError(f"{source} has model.{key}={wanted} but the config says {mine}; use --set "
                              f"model.{key}={wanted} (or the matching --preset)")


class HFWeights:
    """A Hugging Face model directory as a source of parameter values for `ParallelModel.materialise`:
    (our name, placement) -> this rank's part, in fp32. Tensors are read one at a time from the
    safetensors files, and a tensor-parallel rank reads only its slice (safe_open(...).get_slice), so no
    rank ever holds the checkpoint, nor more than one whole tensor of it."""

    def __init__(self, src_dir: str | Path, cfg: ModelConfig):
        from safetensors import safe_open

        self.src = Path(src_dir)
        if not (self.src / "config.json").is_file():
            raise FileNotFoundError(f"no config.json in {str(self.src)!r}; expected a Hugging Face model directory")
        theirs = config_from_hf(read_hf_config(self.src))
        check_same_shapes(cfg, theirs, f"train.init_from={str(self.src)!r}")
        self.cfg = cfg
        index = self.src / "model.safetensors.index.json"
        if (self.src / "model.safetensors").is_file():
            files = ["model.safetensors"]
        elif index.is_file():
            files = _shard_files(index)
        else:
            read_hf_tensors(self.src)  # raises the same clear error as import-hf (pickles, nothing)
            files = []
        self.handles = {}
        for file in files:
            handle = _safetensors(self.src / file, lambda path: safe_open(path, framework="pt"))
            self.handles.update({name: handle for name in handle.keys()})

    def _read(self, hf_name: str, placement=None, transposed: bool = False) -> torch.Tensor:
        if hf_name not in self.handles:
            raise CheckpointError(f"{self.src} lacks tensor {hf_name!r}")
        part = self.handles[hf_name].get_slice(hf_name)
        if placement is None or not placement.tp_sharded:
            return part[:].float()
        axis = placement.tp_axis if not transposed else 1 - placement.tp_axis
        start = placement.offsets[placement.tp_axis]
        index = [slice(None)] * len(placement.global_shape)
        index[axis] = slice(start, start + placement.local_shape[placement.tp_axis])
        # A slice along a later axis is a strided view into the whole tensor: copy it out, contiguous,
        # so the whole tensor is not kept alive and the parameter's strides are its gradient's.
        return part[tuple(index)].float().contiguous()

    def __call__(self, name: str, placement) -> torch.Tensor:
        if self.cfg.position != "learned":
            return self._read(hf_name(name), placement)
        return placement.local(self._gpt2(name))

    def _gpt2(self, name: str) -> torch.Tensor:
        """Our tensor `name`, whole, from GPT-2's layout (Conv1D transposes, fused q/k/v)."""
        hf = dict((ours, theirs) for theirs, ours in _gpt2_names(self.cfg)).get(name)
        if hf is not None:
            t = self._read("transformer." + hf)
            return t.T.contiguous() if _is_conv1d(hf) else t
        if name == "lm_head.weight":
            return self._read("lm_head.weight")
        layer, proj, kind = re.fullmatch(r"layers\.(\d+)\.attn\.([qkv])_proj\.(weight|bias)", name).groups()
        fused = self._read(f"transformer.h.{layer}.attn.c_attn.{kind}")
        fused = fused.T if kind == "weight" else fused
        c = self.cfg
        return fused.split([c.q_size, c.kv_size, c.kv_size])["qkv".index(proj)].contiguous()


def import_hf(src_dir: str | Path) -> tuple[ModelConfig, Transformer]:
    """Load a Hugging Face checkpoint directory (config.json + safetensors) as an fp32 fivefold model."""
    src = Path(src_dir)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"no config.json in {str(src)!r}; expected a Hugging Face model directory")
    cfg = config_from_hf(read_hf_config(src))
    model = empty_model(cfg)
    load_weights(model, weights_from_hf(read_hf_tensors(src), cfg))
    return cfg, model


def with_tokenizer_config(cfg: ModelConfig, files: dict[str, bytes]) -> dict[str, bytes]:
    """Tokenizer files to export: `files`, plus a tokenizer_config.json where a tokenizer.json came without one
    (a tokenizer fivefold trained), so that transformers' AutoTokenizer knows its end-of-sequence token, the
    context, and the chat template `fivefold serve` uses for it (fivefold.data.chat's default)."""
    if "tokenizer.json" not in files or "tokenizer_config.json" in files:
        return files
    eos = Tokenizer.from_str(files["tokenizer.json"].decode()).id_to_token(cfg.eos_token_id) \
        if cfg.eos_token_id is not None else None
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": cfg.max_seq_len,
              "clean_up_tokenization_spaces": False, "chat_template": DEFAULT_CHAT_TEMPLATE,
              **({"eos_token": eos} if eos else {})}
    return {**files, "tokenizer_config.json": (json.dumps(config, indent=2) + "\n").encode()}


def read_tokenizer_files(directory: str | Path) -> dict[str, bytes]:
    """{name: bytes} of the TOKENIZER_FILES present in `directory` (an HF model dir or a checkpoint)."""
    d = Path(directory)
    return {name: (d / name).read_bytes() for name in TOKENIZER_FILES if (d / name).is_file()}


def _write_atomic(path: Path, data: bytes) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def _shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict[str, torch.Tensor]]:
    """Greedy in name order; a tensor larger than max_bytes gets a shard of its own (as HF does)."""
    shards, size = [{}], 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    return shards


def export_hf(model: Transformer, out_dir: str | Path, arch: str | None = None,
              max_shard_bytes: int = 5 * 2**30, extra_files: dict[str, bytes] | None = None) -> Path:
    """Write config.json and fp32 safetensors (sharded past max_shard_bytes) that transformers loads,
    plus `extra_files` ({name: bytes}, e.g. read_tokenizer_files(checkpoint)) next to them."""
    cfg = model.cfg
    hf_config = hf_config_from(cfg, arch)
    weights = dict(model.named_parameters())
    if cfg.tie_embeddings and "lm_head.weight" in weights:  # HF would silently re-tie and drop one of them
        raise CheckpointError("model.tie_embeddings is true but lm_head.weight is a separate parameter; "
                         "call model.tie_weights() after Module.to_empty()")
    tensors = dict(sorted(weights_to_hf(weights, cfg).items()))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    # Stale weights from an earlier export would shadow or contradict the new ones.
    for old in [*out.glob("model-*-of-*.safetensors"), out / "model.safetensors", out / "model.safetensors.index.json"]:
        old.unlink(missing_ok=True)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    for name, data in (extra_files or {}).items():
        _write_atomic(out / name, data)
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        return out
    weight_map = {}
    for k, shard in enumerate(shards, 1):
        name = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    return out
