"""Several LoRA adapters served at once over one base model (the idea of S-LoRA and Punica, simply).

The base's weights stay as they are: each adapter's A and B sit beside them, and a forward hook on every
adapted linear adds (alpha / r) B A x to the rows of the flattened batch whose request named that adapter.
One step's batch can mix requests of the base and of any adapters; a request computes exactly what the
adapter's merged model (W + (alpha / r) B A) computes, up to float rounding, at the cost of two thin matmuls
per adapter present in the batch. The prefix cache keeps each adapter's keys and values apart: an adapted
k / v projection gives other keys for the same tokens (fivefold.serve.blocks, the chain's salt).

An adapter comes from a fivefold LoRA run or checkpoint, or from a PEFT adapter directory
(fivefold.finetune.peft), and must have been trained on a base of this model's shapes.
"""

from __future__ import annotations

import gc
import hashlib
import weakref
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from fivefold.config import ConfigError, ModelConfig
from fivefold.serve.fused import unfuse_projections
from fivefold.weights import adapter_weights

# An engine prepares its model in place: a plain engine fuses the projections (fivefold.serve.fused), an
# engine with adapters hooks them. Per model: the engines that took it, and the adapters' hook handles.
_ENGINES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_HOOKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def take_model(model: nn.Module, engine, adapters: bool) -> None:
    """Let `engine` (serving LoRA adapters or not) prepare `model`. Live engines share a model only when none
    serves adapters: fused projections would bypass the adapters' hooks, and the hooks would add one
    engine's adapters to another's rows. Once the others are gone, their hooks are removed and, for
    adapters, the projections unfused."""
    engines = _ENGINES.setdefault(model, weakref.WeakSet())

    def others_adapted() -> bool:
        return any(e.adapters is not None for e in engines)

    if engines and (adapters or others_adapted()):
        gc.collect()  # an engine nobody holds may only wait for the cycle collector
    if engines and (adapters or others_adapted()):
        has = "with LoRA adapters" if others_adapted() else "without LoRA adapters"
        raise ConfigError(f"this model is already served by another engine ({has}), which changed it in place "
                          f"(fused projections, adapter hooks); engines share a model only when none serves "
                          f"adapters. Serve this one from another copy (build or load the model again, or "
                          f"copy.deepcopy it), or let the other engine go first (del llm)")
    if not engines:
        for handle in _HOOKS.pop(model, []):
            handle.remove()
        if adapters:
            unfuse_projections(model)
    engines.add(engine)


@dataclass
class Adapter:
    name: str
    scaling: float
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]  # linear's module name -> (A (r, in), B (out, r))

    @property
    def salt(self) -> bytes:
        return hashlib.sha256(f"fivefold-adapter:{self.name}".encode()).digest()


def load_adapter(name: str, source: str | Path, model_cfg: ModelConfig) -> Adapter:
    """Adapter `name` from a fivefold LoRA run / checkpoint or a PEFT adapter directory."""
    lora, tensors = adapter_weights(source, model_cfg, f"adapter {name!r}")
    modules = sorted({key.split(".lora_")[0] for key in tensors})
    weights = {m: (tensors[f"{m}.lora_A.weight"], tensors[f"{m}.lora_B.weight"]) for m in modules}
    return Adapter(name, lora.scaling, weights)


class AdapterSet:
    """The adapters an engine serves, and which rows of the current forward use which of them."""

    def __init__(self, model: nn.Module):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self.hooked: set[str] = set()
        self.rows: list[tuple[Adapter, torch.Tensor]] = []  # this forward's (adapter, row indices)
        param = next(model.parameters())
        self.device, self.dtype = param.device, param.dtype

    def check_name(self, name: str) -> None:
        """Refuse a name clients could not address (they ask for 'BASE:NAME') or one already taken; asked
        before the adapter's weights are read, so that a bad name is the error reported."""
        if name in self.adapters:
            raise ConfigError(f"an adapter named {name!r} is already loaded")
        if not name or ":" in name:
            raise ConfigError(f"adapter name {name!r}: give a non-empty name without ':'")

    def add(self, adapter: Adapter) -> None:
        self.check_name(adapter.name)
        modules = dict(self.model.named_modules())
        missing = sorted(set(adapter.weights) - set(modules))
        if missing:
            raise ConfigError(f"adapter {adapter.name!r} adapts {missing[0]}, which this model does not have")
        adapter.weights = {m: (a.to(self.device, self.dtype), b.to(self.device, self.dtype))
                           for m, (a, b) in adapter.weights.items()}
        for m in adapter.weights:
            if m not in self.hooked:
                _HOOKS.setdefault(self.model, []).append(modules[m].register_forward_hook(self._hook(m)))
                self.hooked.add(m)
        self.adapters[adapter.name] = adapter

    def select(self, names: list[str | None]) -> None:
        """The adapter of each row of the next forward's flattened batch (None: the base)."""
        self.rows = []
        for name in sorted({n for n in names if n is not None}):
            index = torch.tensor([i for i, n in enumerate(names) if n == name], device=self.device)
            self.rows.append((self.adapters[name], index))

    def _hook(self, module_name: str):
        owner = weakref.ref(self)  # the model holds the hook: no cycle back through us to the model

        def hook(module, args, output):
            adapters = owner()
            if adapters is None:
                return output
            x = args[0]
            for adapter, index in adapters.rows:
                weights = adapter.weights.get(module_name)
                if weights is None:
                    continue
                a, b = weights
                rows = x.flatten(0, -2).index_select(0, index)
                output.view(-1, output.shape[-1]).index_add_(0, index, (rows @ a.T) @ b.T * adapter.scaling)
            return output
        return hook
