"""`LLM`, the offline front of the serving engine: a model loaded from a path (or given), a list of prompts
in, their outputs back in order; under tensor parallelism every rank calls it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from fivefold.config import ConfigError
from fivefold.data.tokenizer import load_tokenizer
from fivefold.model import Transformer
from fivefold.parallel.mesh import launched_world_size, local_device, resolve_device
from fivefold.serve.engine import Engine, RequestOutput, check_tp_serving, serve_config
from fivefold.serve.loading import load_model_for_serving
from fivefold.serve.sampling import RequestError, SamplingParams


class LLM:
    """Offline generation: `LLM(model, **engine_options).generate(prompts, SamplingParams(...))`.

    `model`: a Hugging Face directory, a fivefold export, run or checkpoint, or a Transformer (then pass
    `tokenizer` for text prompts). Engine options are ServeConfig's fields (block_size, kv_memory,
    num_blocks, max_num_seqs, max_num_batched_tokens, max_model_len, prefix_cache, dtype), plus device and seed.
    """

    def __init__(self, model: str | Path | Transformer, tokenizer=None, device: str = "auto", seed: int = 0,
                 tp: int = 1, adapters: Mapping[str, str | Path] | None = None, **engine_options):
        serve = serve_config(engine_options)
        check_tp_serving(tp, serve, adapters)
        self.chat_template = None
        group = None
        if tp > 1 and (isinstance(model, Transformer) or launched_world_size() != tp):
            raise ConfigError(f"tp={tp} serves a model from its path on {tp} processes: run under "
                              f"torchrun --nproc-per-node {tp} (fivefold generate/serve --tp {tp} launch it)")
        if isinstance(model, Transformer):
            if isinstance(tokenizer, (str, Path)):
                tokenizer = load_tokenizer(tokenizer)
        else:
            where = local_device(resolve_device(device, "device"))
            loaded = load_model_for_serving(model, tokenizer, serve.dtype, where, tp)
            model, tokenizer, self.chat_template, group = loaded.model, loaded.tokenizer, loaded.chat_template, loaded.tp
        self.engine = Engine(model, tokenizer, serve, seed, tp=group, adapters=adapters)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool = False, adapter: str | None | list[str | None] = None) -> list[RequestOutput]:
        """Outputs in the order of `prompts` (a text, a token-id list, or a list of either), each with LoRA
        adapter `adapter` (one name for all, or one per prompt; None: the base). Under tensor parallelism
        every rank calls it; rank 0's prompts are the ones served, and every rank gets the outputs."""
        engine = self.engine
        if engine.tp and not engine.tp.is_driver:
            return engine.follow()
        try:
            outputs = self._generate(prompts, params, progress, adapter)
        except Exception as e:
            engine.release_followers(error=e)
            raise
        engine.release_followers(outputs)
        return outputs

    def _generate(self, prompts, params, progress: bool, adapter) -> list[RequestOutput]:
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if params is None or isinstance(params, SamplingParams):
            params = [params or SamplingParams()] * len(prompts)
        adapters = adapter if isinstance(adapter, list) else [adapter] * len(prompts)
        if len(params) != len(prompts) or len(adapters) != len(prompts):
            raise ValueError(f"{len(params)} SamplingParams and {len(adapters)} adapters for {len(prompts)} prompts; "
                             f"give one, or one per prompt")
        engine = self.engine
        ids = []
        try:
            for prompt, p, a in zip(prompts, params, adapters):
                ids.append(engine.add_request(prompt, p, adapter=a))
        except RequestError as e:
            for request_id in ids:
                engine.abort(request_id)
            raise RequestError(f"prompt {len(ids)}: {e}") from None
        done: dict[str, RequestOutput] = {}
        bar = None
        if progress:
            from tqdm import tqdm
            bar = tqdm(total=len(ids), desc="requests", unit="req")
        while len(done) < len(ids):
            for out in engine.step(finished_only=True):
                if out.finished:
                    done[out.request_id] = out
                    if bar:
                        bar.update()
        if bar:
            bar.close()
        return [done[i] for i in ids]
